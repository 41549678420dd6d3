"""What a load into an already-wrapped pipeline does under its lock (a prefetch's publication): no walk of the module
tree beyond one name-free scan per component, and still every check the walks stood for.

Oracles: the same adapter loaded by `load_fd_lora` into a copy (banks and outputs bit-identical); the pipe's state
before a refused load (bit-identical after it); `fdlora.layers.quant.quantized.kind` for the note's fast path.
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch
from torch import nn

from fdlora import errors
from fdlora.layers.quant import quantized
from fdlora.runtime.scope import lock_of

from .test_prefetch import WAIT, assert_same, gen, snapshot


@pytest.fixture(scope="module")
def sd15():
    from .conftest import Pair

    return Pair("sd15")


def test_a_publication_into_wrapped_layers_walks_no_module_tree(sd15, monkeypatch):
    """Every path of the adapter is wrapped already: no walk of a component's module tree runs to its end during the
    prefetch (the first parameter, which tells a component's device, is no walk), and the result equals
    load_fd_lora's."""
    fetched, loaded = copy.deepcopy(sd15.fd), copy.deepcopy(sd15.fd)
    components = {id(m) for m in fetched.components.values() if isinstance(m, nn.Module)}
    walks = []
    real = nn.Module.named_modules

    def counted(self, *a, **kw):  # (modules() and parameters() walk through named_modules)
        yield from real(self, *a, **kw)
        if id(self) in components:
            walks.append(type(self).__name__)

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    fetched.prefetch_fd_lora(sd15.dirs["style_a"], adapter_name="again").result(WAIT)
    assert walks == []
    monkeypatch.undo()
    fetched.delete_adapters("again")
    fetched.prefetch_fd_lora(sd15.dirs["style_a"], adapter_name="again").result(WAIT)  # (a reused slot too)
    loaded.load_fd_lora(sd15.dirs["style_a"], "again")
    for pipe in (fetched, loaded):
        pipe.set_adapters(["again", "locon_b"], [0.8, 0.3])
    assert_same(snapshot(fetched), snapshot(loaded))
    assert torch.equal(gen(sd15, fetched), gen(sd15, loaded))


@pytest.mark.parametrize("how", ["load", "prefetch"])
def test_peft_layers_added_after_the_first_load_are_still_refused(sd15, how):
    """A PEFT LoRA layer put into a module fd-lora did not wrap, after fd-lora's first load: a later load (or a
    prefetch's publication) refuses the component, naming the fix, and changes nothing."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLinear

    pipe = copy.deepcopy(sd15.fd)
    emb = pipe.unet.time_embedding
    emb.linear_1 = PeftLinear(emb.linear_1, "peft", LoraConfig(r=2, lora_alpha=2), r=2, lora_alpha=2)
    before = snapshot(pipe)
    with pytest.raises(errors.FdLoraError, match="already holds LoRA layers .*unload_lora_weights"):
        if how == "load":
            pipe.load_fd_lora(sd15.dirs["style_a"], "again")
        else:
            pipe.prefetch_fd_lora(sd15.dirs["style_a"], adapter_name="again").result(WAIT)
    assert_same(snapshot(pipe), before)


def test_a_load_after_fuse_qkv_projections_into_a_wrapped_pipe_moves_qkv(sd15):
    """The scan sees fused attention that appeared after the first load: q/k/v LoRA goes onto the fused projections
    (as fused_qkv.retarget on the unwrapped pipe), so the output equals the unfused pipe's with the same adapters."""
    fused, plain = copy.deepcopy(sd15.fd), copy.deepcopy(sd15.fd)
    fused.fuse_qkv_projections()
    for pipe in (fused, plain):
        pipe.load_fd_lora(sd15.dirs["style_a"], "again")
        pipe.set_adapters(["again"], [0.9])
    h = fused.fd_lora_handles()["unet"]
    assert any(p.endswith("to_qkv") for p in h.layers) and any(
        h.layers[p].bank.used[h.state.slots.by_name["again"]] for p in h.layers if p.endswith("to_qkv"))
    want, got = gen(sd15, plain), gen(sd15, fused)
    assert not torch.isnan(got).any() and torch.allclose(got, want, atol=1e-4, rtol=1e-4)


class _WithHook(nn.Linear):
    pass


class _WeightProperty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight.to(torch.int8)


def _bases() -> dict[str, nn.Module]:
    f8 = getattr(torch, "float8_e4m3fn", None)
    out = {"fp32": nn.Linear(4, 4), "fp16": nn.Linear(4, 4).half(), "bf16": nn.Linear(4, 4).to(torch.bfloat16),
           "conv": nn.Conv2d(2, 3, 3), "no-weight": nn.Identity(), "property": _WeightProperty()}
    int_w = nn.Linear(4, 4)
    int_w.weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    out["int8"] = int_w
    if f8 is not None:
        out["float8"] = nn.Linear(4, 4).to(f8)
    hooked = _WithHook(4, 4)

    class Hook:
        storage_dtype, compute_dtype = torch.float16, torch.float32

    hooked._diffusers_hook = type("Registry", (), {"hooks": {"cast": Hook()}})()
    out["layerwise-casting"] = hooked
    return out


@pytest.mark.parametrize("name", list(_bases()))
def test_the_quantized_notes_fast_path_agrees_with_quantized_kind(name):
    """quantized.kind's fast path (`_plain_float`) says True only where its full answer (`_stored`) is None."""
    base = _bases()[name]
    if quantized._plain_float(base):
        assert quantized._stored(base) is None
    assert quantized._plain_float(base) == (name in ("fp32", "fp16", "bf16", "conv"))
    assert (quantized.kind(base) is None) == (name in ("fp32", "fp16", "bf16", "conv", "no-weight"))


@pytest.fixture
def pauses(monkeypatch):
    """One piece per hold of the lock (fdlora.runtime.background._publish), and `pauses["hook"](i)` run by another
    thread at the i-th pause between two holds (counted in `pauses["n"]`), where it may take the pipeline's lock as a
    step or a call would."""
    from fdlora.runtime import background

    state = {"hook": None, "n": 0}
    real = background.time.sleep

    def pause(s):
        if threading.current_thread().name.startswith("fdlora-prefetch-") and state["hook"] is not None:
            state["n"] += 1
            t = threading.Thread(target=state["hook"], args=(state["n"],))
            t.start()
            t.join(WAIT)
        real(s)

    monkeypatch.setattr(background, "SLICE_S", 0.0)
    monkeypatch.setattr(background.time, "sleep", pause)
    return state


def test_a_publication_lets_calls_run_between_its_pieces_and_shows_nothing_before_its_end(sd15, pauses):
    """Between two pieces of a publication another thread takes the pipeline's lock (as the next step does) and sees
    the pipe as it was: the name unknown, banks and tables untouched. The adapter then equals load_fd_lora's."""
    pipe, ref = copy.deepcopy(sd15.fd), copy.deepcopy(sd15.fd)
    before, seen = snapshot(pipe), []

    def step(i):
        with lock_of(pipe):
            seen.append(i)
            assert_same(snapshot(pipe), before)

    pauses["hook"] = step
    job = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="fresh")
    job.result(WAIT)
    assert len(seen) >= 3 and len(job.slices) == len(seen) + 1  # materialize, checks, writes' tables: then commit
    ref.load_fd_lora(sd15.dirs["locon_b"], "fresh")
    for p in (pipe, ref):
        p.set_adapters(["style_a", "fresh"], [0.5, 0.8])
    assert_same(snapshot(pipe), snapshot(ref))
    assert torch.equal(gen(sd15, pipe), gen(sd15, ref))


@pytest.mark.parametrize("change", ["load", "delete", "cancel"])
def test_a_change_between_pieces_makes_the_publication_start_over_or_stop(sd15, pauses, change):
    """A load or a delete at each pause between two pieces (before the checks, amid them, before the writes'
    tables, before the commit): the publication checks and writes again at once, and ends as load_fd_lora after
    that change would (the same slots, banks and tables; outputs too at the last pause). A cancel at any pause:
    nothing published, the pipe bit-identical."""
    ref_job = copy.deepcopy(sd15.fd).prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="fresh")
    ref_job.result(WAIT)
    n = len(ref_job.slices) - 1
    assert n >= 3

    def act(p):
        if change == "load":
            p.load_fd_lora(sd15.dirs["style_a"], "other")
        elif change == "delete":
            p.delete_adapters("style_a")

    for at in range(1, n + 1):
        pipe, ref = copy.deepcopy(sd15.fd), copy.deepcopy(sd15.fd)
        before, jobs = snapshot(pipe), []

        def hook(i, pipe=pipe, at=at, jobs=jobs):
            if i == at:
                end = time.monotonic() + WAIT
                while not jobs and time.monotonic() < end:  # the job reaches the list once prefetch_fd_lora returns,
                    time.sleep(0.001)  # which the first pause may come before
                with lock_of(pipe):
                    if change == "cancel":
                        assert jobs[0].cancel()
                    else:
                        act(pipe)

        pauses.update(hook=hook, n=0)
        jobs.append(pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="fresh"))
        if change == "cancel":
            with pytest.raises(CancelledError):
                jobs[0].result(WAIT)
            assert_same(snapshot(pipe), before)
            continue
        jobs[0].result(WAIT)
        act(ref)
        ref.load_fd_lora(sd15.dirs["locon_b"], "fresh")
        active = ["fresh"] + (["other"] if change == "load" else [])
        for p in (pipe, ref):
            p.set_adapters(active, [0.8, 0.4][:len(active)])
        assert_same(snapshot(pipe), snapshot(ref))
    if change != "cancel":
        assert torch.equal(gen(sd15, pipe), gen(sd15, ref))
