"""A deleted model gives its memory back by reference counting alone: no reference cycle runs through an injected
model (handle -> model and state -> layers are weak, shrink groups hold their members weakly, the merged cache's
slider replay holds its layers weakly, captured steps hold their module weakly), so `del model` frees the weights,
the banks and the merged-weight copies at once, without `gc.collect()`, and `merge_cache_bytes()` stops counting
them. Each case runs with the cycle collector off."""

from __future__ import annotations

import contextlib
import copy
import gc
import tempfile
import weakref
from pathlib import Path

import pytest
import torch
from support.tiny_sequential import PATHS, lora, net

import fdlora
from fdlora.fixtures.release import merged_steps_model


@pytest.fixture
def cache():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


@contextlib.contextmanager
def no_gc(build):
    """The cycle collector off, after one throwaway build: its lazy imports and one-time set-up run then (an import
    may leave a third-party cycle that holds the importing frames, and with them the caller's locals)."""
    build()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def holders(model) -> list[weakref.ref]:
    """Weak references to the model's parameters and buffers and to every merged copy of its layers."""
    refs = [weakref.ref(t) for t in (*model.parameters(), *model.buffers())]
    for m in model.modules():
        merged = m.__dict__.get("merged") if isinstance(m, fdlora.FusedLoraLinear | fdlora.FusedLoraConv2d) else None
        if merged is not None:
            refs += [weakref.ref(c.buf) for c in (merged, *merged.groups.values()) if c.buf is not None]
    return refs


def freed_on_del(build, outer=None) -> None:
    """Build, delete, and check that every holder died at once (`outer`: the module that holds every weight)."""
    with no_gc(build):
        before = fdlora.merge_cache_bytes()
        model = build()
        refs, copies = holders(outer(model) if outer else model), fdlora.merge_cache_bytes() - before
        assert copies > 0, "the case made no merged copy"
        del model
        assert [r for r in refs if r() is not None] == [], "held by a reference cycle"
        assert fdlora.merge_cache_bytes() == before


def _sequential(frozen: bool = False, captured: bool = False):
    def build():
        model = net()
        h = fdlora.inject(model, PATHS, max_slots=4, max_rank=8)
        h.add_adapter(lora(1), "a")
        h.add_adapter(lora(2), "b")
        h.set_adapters(["a", "b"], [0.5, -0.3])
        if frozen:
            h.freeze()
        if captured:
            from test_grad_modes import StandIn

            fdlora.capture_steps(model, mechanism=StandIn())
        x = torch.randn(4, 32)
        with torch.no_grad():
            for _ in range(3):  # the full pass, then its replay and the hot path
                model(x)
            h.set_adapters(["a"], [0.7])  # a slider move: the kept replay
            model(x)
            with h.per_sample(["a", None, "b", "a"]):
                model(x)
        return model
    return build


def _llama():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        pm = peft.get_peft_model(LlamaForCausalLM(cfg).eval(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
            init_lora_weights=False), adapter_name="p")
        pm.add_adapter("q", peft.LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
        model = fdlora.from_peft(pm)  # q/k/v and gate/up share a shrink (ShrinkGroup)
        ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            model(ids)
            model(ids, adapter_names=["p", "q", "p"])
        return model
    return build


def _pipeline():
    pytest.importorskip("diffusers")
    from fdlora.fixtures import tiny_pipeline as tiny

    folder = Path(tempfile.mkdtemp(prefix="fdlora-release-"))
    for name, data in tiny.random_lora_files(tiny.sd15(), seed=1).items():
        (folder / name).write_bytes(data)

    def build():
        pipe = tiny.sd15()
        pipe.set_progress_bar_config(disable=True)
        pipe.load_fd_lora(str(folder), adapter_name="a")
        lat = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            pipe(**tiny.generate_kwargs(pipe, latents=lat[:1]))
            pipe(**tiny.generate_kwargs(pipe, prompt=["x", "y"], latents=lat, fd_lora_adapters=["a", None]))
        return pipe
    return build


class _Pipe(torch.nn.Module):
    """The tiny pipeline's components as one module, so that `holders` sees every weight."""

    def __init__(self, pipe) -> None:
        super().__init__()
        self.unet, self.text_encoder = pipe.unet, pipe.text_encoder


CASES = [
    pytest.param(lambda: _sequential(), id="eager-cache-replay-hot-per-sample"),
    pytest.param(lambda: _sequential(frozen=True), id="frozen-stamped-cache"),
    pytest.param(lambda: _sequential(captured=True), id="captured-steps"),
    pytest.param(_llama, id="llama-from_peft-shrink-groups-adapter_names"),
]


@pytest.mark.parametrize("case", CASES)
def test_a_deleted_model_frees_its_memory_without_a_collection(case, cache):
    freed_on_del(case())


def test_a_deleted_pipeline_frees_its_components_without_a_collection(cache):
    freed_on_del(_pipeline(), _Pipe)


def test_copies_keep_their_own_handle_and_layers():
    """The weak back-references are rebuilt on copies: a deep copy's handle, state and groups point at the copy."""
    pytest.importorskip("peft")
    model = _llama()()
    twin = copy.deepcopy(model)
    h, t = fdlora.handle(model), fdlora.handle(twin)
    assert t.model is twin and t.state.members is t.layers and t.layers is not h.layers
    group = next(g for g in (lay.__dict__.get("shrink_group") for lay in t.layers.values()) if g is not None)
    assert all(m is t.layers[m.path] for m in group.members)
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits)


def _allocated(dev: torch.device) -> int:
    """Bytes the caching allocator hands out, without cuBLAS's workspaces: torch keeps one per (handle, stream)
    for the process (32 MiB each on Hopper), and a captured step's warm-up and capture streams add theirs."""
    torch.cuda.synchronize(dev)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured-cuda-graphs"])
def test_cuda_memory_comes_back_on_del_without_a_collection(captured):
    """Four 64 MiB fp32 Linear layers with two adapters and their merged copies: after `del model` and
    `torch.cuda.empty_cache()` (no gc.collect()), the allocator holds what it held before the model was built."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        start = _allocated(dev)
        fdlora.set_merge_cache("auto")
        before = fdlora.merge_cache_bytes(dev)
        model = merged_steps_model(dev, captured)
        assert fdlora.merge_cache_bytes(dev) - before >= 4 * (64 << 20)  # a merged copy per layer
        del model
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = _allocated(dev) - start
        assert held < 16 << 20, f"{held / 2**20:.0f} MiB still allocated after del"
        assert fdlora.merge_cache_bytes(dev) == before
    finally:
        gc.enable()
        gc.collect()
