"""Loads under memory pressure: adapter banks take the rank of what is loaded (not a default capacity up front), and
banks that do not fit raise DeviceMemoryError naming the memory needed and the fix, with the model (and pipeline)
exactly as before the failed load. On CPU the device's memory is a cap on the bytes the banks allocate (torch.zeros /
Tensor.new_zeros past the cap raise torch.OutOfMemoryError, as the CUDA allocator does)."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import weakref

import pytest
import torch

import fdlora
from fdlora.errors import DeviceMemoryError


@contextlib.contextmanager
def memory_cap(nbytes: int):
    """The banks' allocations (zeroed tensors made in fdlora.layers.storage.bank) fail once the ones made inside the
    block and still alive would exceed `nbytes` (a freed bank gives its bytes back, as in the CUDA allocator)."""
    used = [0]
    zeros, new_zeros = torch.zeros, torch.Tensor.new_zeros

    def give_back(n: int) -> None:
        used[0] -= n

    def take(t):
        if not sys._getframe(2).f_code.co_filename.endswith(os.path.join("storage", "bank.py")):
            return t
        n = t.numel() * t.element_size()
        if used[0] + n > nbytes:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated cap of {nbytes} bytes)")
        used[0] += n
        weakref.finalize(t, give_back, n)
        return t

    def capped_zeros(*a, **k):
        return take(zeros(*a, **k))

    def capped_new_zeros(self, *a, **k):
        return take(new_zeros(self, *a, **k))

    torch.zeros, torch.Tensor.new_zeros = capped_zeros, capped_new_zeros
    try:
        yield used
    finally:
        torch.zeros, torch.Tensor.new_zeros = zeros, new_zeros


def _adapter_dict(_, seed: int, rank: int):
    """A random adapter for the tiny SD1.5's UNet and text encoder (made on a plain copy of the pipeline)."""
    from peft import LoraConfig, inject_adapter_in_model

    from fdlora.fixtures import tiny_pipeline as tiny
    from fdlora.integrations.transformers import adapter_from_peft

    pipe = tiny.sd15()
    comps = {}
    for comp, targets in (("unet", ["to_q", "to_k", "to_v", "to_out.0"]), ("text_encoder", ["q_proj", "v_proj"])):
        m = copy.deepcopy(getattr(pipe, comp))
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False),
                                m, "x")
        comps[comp] = adapter_from_peft(m, "x")
    return comps


def _snapshot(pipe) -> dict:
    """Everything a load could change: module objects, handles and their banks' shapes, adapters, outputs."""
    from support.tiny import unet_inputs

    out = {"modules": {c: [(n, id(m)) for n, m in getattr(pipe, c).named_modules()] for c in ("unet", "text_encoder")}}
    for c in ("unet", "text_encoder"):
        h = fdlora.layers.registry_of_models.get(getattr(pipe, c))
        out[c] = None if h is None else (h.max_rank, h.state.slots.capacity, dict(h.state.active), h.list_adapters(),
                                         tuple(h.state.table.shape),
                                         {p: (tuple(la.bank.A.shape), tuple(la.bank.B.shape)) for p, la in
                                          h.layers.items()})
    with torch.no_grad():
        out["unet_out"] = pipe.unet(**unet_inputs(pipe.unet)).sample
        out["te_out"] = pipe.text_encoder(torch.arange(7)[None])[0]
    return out


def _same(a: dict, b: dict) -> None:
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture
def sd15():
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from fdlora.fixtures import tiny_pipeline as tiny

    return tiny.sd15()


def test_banks_hold_what_is_loaded_and_grow_with_it(sd15):
    """A first r4 load allocates one slot at rank 16 (the padded rank), not the default 4 slots x rank 64; each
    later load adds its slot (an r32 one the rank) up to the capacity, after which the pool evicts; freeze()
    allocates the capacity (4 slots x rank 64), and loads into a frozen model keep the shapes."""
    from support.tiny import unet_inputs

    sd15.load_fd_lora(_adapter_dict(sd15, 1, 4), "small")
    h = fdlora.handle(sd15.unet)

    def shapes():
        return {(la.bank.slots, la.bank.rank_capacity) for la in h.layers.values()}

    assert shapes() == {(1, 16)} and h.slot_limit == 4
    sd15.load_fd_lora(_adapter_dict(sd15, 2, 32), "big")
    assert shapes() == {(2, 32)} and h.max_rank == 32
    for i in range(3):
        sd15.load_fd_lora(_adapter_dict(sd15, 3 + i, 4), f"more{i}")
    assert shapes() == {(4, 32)} and len(h.list_adapters()) == 4  # the fifth load evicted the least recent
    sd15.set_adapters(["big", "more2"], [0.5, 0.8])
    x = unet_inputs(sd15.unet)
    with torch.no_grad():
        want = sd15.unet(**x).sample
    fresh = tiny_sd15()
    fresh.load_fd_lora(_adapter_dict(sd15, 2, 32), "big")
    fdlora.handle(fresh.unet).freeze()
    frozen = fdlora.handle(fresh.unet)
    assert {(la.bank.slots, la.bank.rank_capacity) for la in frozen.layers.values()} == {(4, 64)}  # the capacity
    fresh.load_fd_lora(_adapter_dict(sd15, 5, 4), "more2")
    fresh.load_fd_lora(_adapter_dict(sd15, 6, 48), "wide")  # fits the frozen banks: no reshape
    assert {(la.bank.slots, la.bank.rank_capacity) for la in frozen.layers.values()} == {(4, 64)}
    fresh.set_adapters(["big", "more2"], [0.5, 0.8])
    with torch.no_grad():
        torch.testing.assert_close(fresh.unet(**x).sample, want, rtol=1e-5, atol=1e-5)


def tiny_sd15():
    from fdlora.fixtures import tiny_pipeline as tiny

    return tiny.sd15()


def test_a_first_load_out_of_memory_names_the_need_and_leaves_the_pipeline_plain(sd15):
    before = _snapshot(sd15)
    with memory_cap(4096), pytest.raises(DeviceMemoryError, match=r"GiB more.*max_slots=N, max_rank=R"):
        sd15.load_fd_lora(_adapter_dict(sd15, 1, 8), "a")
    _same(before, _snapshot(sd15))
    assert fdlora.layers.registry_of_models.get(sd15.unet) is None
    sd15.load_fd_lora(_adapter_dict(sd15, 1, 8), "a")  # with memory, the same load works
    assert fdlora.handle(sd15.unet).list_adapters() == ["a"]


def test_a_load_that_must_grow_the_banks_out_of_memory_changes_nothing(sd15):
    sd15.load_fd_lora(_adapter_dict(sd15, 1, 4), "small")
    sd15.set_adapters(["small"], [0.7])
    before = _snapshot(sd15)
    big = _adapter_dict(sd15, 2, 40)
    with memory_cap(0), pytest.raises(DeviceMemoryError, match="rank 48") as err:
        sd15.load_fd_lora(big, "big")
    assert "The model is as it was" in str(err.value)
    _same(before, _snapshot(sd15))
    sd15.load_fd_lora(big, "big")
    assert fdlora.handle(sd15.unet).list_adapters() == ["small", "big"]


def test_a_load_that_needs_another_slot_out_of_memory_changes_nothing(sd15):
    sd15.load_fd_lora(_adapter_dict(sd15, 1, 4), "first")
    before = _snapshot(sd15)
    second = _adapter_dict(sd15, 2, 4)
    with memory_cap(0), pytest.raises(DeviceMemoryError, match="2 slots x rank 16"):
        sd15.load_fd_lora(second, "second")
    _same(before, _snapshot(sd15))
    sd15.load_fd_lora(second, "second")
    assert fdlora.handle(sd15.unet).list_adapters() == ["first", "second"]


def test_grow_out_of_memory_on_the_handle_puts_every_bank_back():
    from support import tiny

    model = tiny.clip_te(seed=3)
    h = fdlora.inject(model, ["q_proj", "k_proj", "v_proj"], max_slots=2, max_rank=16)
    g = torch.Generator().manual_seed(0)
    h.add_adapter(fdlora.LoraAdapter({p: fdlora.ModuleLora(torch.randn(4, 32, generator=g), torch.randn(32, 4,
                                                                                                       generator=g))
                                      for p in h.layers}), "a")
    shapes = {p: (la.bank.A.shape, la.bank.B.shape) for p, la in h.layers.items()}
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        want = model(x).last_hidden_state
    bank = next(iter(h.layers.values())).bank
    room = 2 * bank.nbytes_at(4, 64) + 3 * bank.nbytes_at(2, 16)  # two banks grown, and room to put them back
    with memory_cap(room), pytest.raises(DeviceMemoryError, match="4 slots x rank 64"):
        h.grow(max_slots=4, max_rank=64)  # the first banks grow, a later one does not fit
    assert {p: (la.bank.A.shape, la.bank.B.shape) for p, la in h.layers.items()} == shapes
    assert h.state.slots.capacity == 2 and h.max_rank == 16 and tuple(h.state.table.shape) == (len(h.layers), 2)
    with torch.no_grad():
        assert torch.equal(model(x).last_hidden_state, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_banks_that_do_not_fit_raise_and_change_nothing():
    """Four 64 MiB fp32 Linear layers under a per-process memory cap a little above what they hold: growing the
    banks past it raises DeviceMemoryError (not torch.OutOfMemoryError), every bank is as before, and the outputs
    are the same; with the cap lifted the same grow works."""
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)]).to(dev)
    paths = [str(i) for i in range(4)]
    h = fdlora.inject(model, paths, max_slots=2, max_rank=16)
    g = torch.Generator().manual_seed(0)
    h.add_adapter(fdlora.LoraAdapter({p: fdlora.ModuleLora(torch.randn(8, 4096, generator=g) / 64,
                                                           torch.randn(4096, 8, generator=g) / 64) for p in paths}),
                  "a")
    x = torch.randn(8, 4096, device=dev)
    with torch.no_grad():
        want = model(x)
    shapes = {p: (la.bank.A.shape, la.bank.B.shape) for p, la in h.layers.items()}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = torch.cuda.memory_reserved(dev) + (48 << 20)  # room for less than one bank at 8 slots x rank 256 (64 MiB)
    torch.cuda.set_per_process_memory_fraction(cap / total, torch.cuda.current_device())
    try:
        with pytest.raises(DeviceMemoryError, match="8 slots x rank 256"):
            h.grow(max_slots=8, max_rank=256)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    assert {p: (la.bank.A.shape, la.bank.B.shape) for p, la in h.layers.items()} == shapes
    assert h.state.slots.capacity == 2 and h.max_rank == 16
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    h.grow(max_slots=8, max_rank=256)
    assert h.state.slots.capacity == 8 and h.max_rank == 256


def _sdxl_r32_files(unet, tmp_path, n: int) -> list:
    """`n` r32 adapters on every SDXL target of `unet`, as PEFT-format safetensors files (keys under `unet.`, B scaled
    as a trained B is), the way a user downloads them."""
    from safetensors.torch import save_file

    from fdlora.fixtures import fullsize
    from fdlora.layers.model.targets import match_targets

    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        sd = {}
        for name in match_targets(unet, fullsize.SDXL_TARGETS):
            w = unet.get_submodule(name).weight
            sd[f"unet.{name}.lora_A.weight"] = (torch.randn(32, w.shape[1], generator=g) / w.shape[1] ** 0.5).half()
            sd[f"unet.{name}.lora_B.weight"] = (torch.randn(w.shape[0], 32, generator=g) * 0.02).half()
        paths.append(tmp_path / f"r32_{i}.safetensors")
        save_file(sd, paths[-1])
    return paths


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_three_r32_sdxl_adapters_load_with_1_5_gib_free_as_in_diffusers(tmp_path):
    """Full-size SDXL UNet (fp16, random weights): with 1.5 GiB free once the model is on the GPU, diffusers + PEFT
    loads three r32 adapters, and so does fd-lora (banks sized to what is loaded); a three-adapter blend then runs
    under the same pressure and matches diffusers + PEFT on the same weights."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    import gc

    from fdlora.fixtures import fullsize

    def fill(free_gib: float):
        gc.collect()
        torch.cuda.empty_cache()
        take = int(torch.cuda.mem_get_info()[0] - free_gib * (1 << 30))
        return torch.empty(max(take, 0), dtype=torch.uint8, device="cuda")

    unet = fullsize.sdxl_unet("cuda", torch.float16)
    files = _sdxl_r32_files(unet, tmp_path, 3)
    x = fullsize.sdxl_inputs(unet, 2)
    names, weights = ["a0", "a1", "a2"], [0.8, 0.6, 0.5]
    peft_unet = copy.deepcopy(unet)
    with torch.inference_mode():
        base = unet(**x).sample.float()
    filler = fill(1.5)
    for f, n in zip(files, names):
        peft_unet.load_lora_adapter(str(f), adapter_name=n, prefix="unet")
    del filler
    peft_unet.set_adapters(names, weights)
    with torch.inference_mode():
        want = peft_unet(**x).sample.float()
    del peft_unet

    filler = fill(1.5)
    for f, n in zip(files, names):
        fdlora.load_fd_lora(unet, str(f), n)
    fdlora.set_adapters(unet, names, weights)
    with torch.inference_mode():
        got = unet(**x).sample.float()
    del filler
    scale = float(want.abs().max())
    err, effect = float((got - want).abs().max()), float((want - base).abs().max())
    assert torch.isfinite(got).all() and err <= 3e-2 * scale and err <= 0.2 * effect, (err, effect, scale)
