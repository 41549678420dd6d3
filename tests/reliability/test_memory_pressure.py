"""Out of memory where the budget saw room (fragmentation, another process): the merged-weight cache gives the
reservation back and the layer runs the per-call path, with one warning, instead of failing the step."""

from __future__ import annotations

import logging

import torch

import fdlora
from fdlora import LoraAdapter, ModuleLora
from fdlora.layers.fastpath import merged


def test_a_copy_that_cannot_be_allocated_falls_back_and_the_step_runs(monkeypatch, caplog):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    mods = {p: ModuleLora(torch.randn(4, k) * 0.3, torch.randn(n, 4) * 0.3) for p, k, n in (("0", 16, 32),
                                                                                             ("2", 32, 16))}
    fdlora.add_adapter(m, LoraAdapter(mods), "a")
    x = torch.randn(5, 16)
    fdlora.set_merge_cache(0)
    with torch.no_grad():
        want = m(x)  # the per-call path
    fdlora.set_merge_cache(1 << 30)
    real, refused = torch.empty_like, [m[2].base.weight]

    def refuse(t, *a, **k):
        if any(t is r for r in refused):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(t, *a, **k)

    monkeypatch.setattr(torch, "empty_like", refuse)
    try:
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fdlora"):
            got = m(x)
            again = m(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-6)
        assert m[0].merged.buf is not None and m[2].merged.buf is None  # one layer cached, the other per-call
        assert fdlora.merge_cache_bytes() == m[0].merged.buf.numel() * 4  # no bytes counted for the failed copy
        assert sum("out of device memory" in r.message for r in caplog.records) == 1
    finally:
        monkeypatch.setattr(torch, "empty_like", real)
        fdlora.set_merge_cache("auto")
        refused.clear()
        del m
    assert merged.BUDGET.used.get(torch.device("cpu"), 0) == 0


def test_out_of_memory_inside_a_step_leaves_every_adapter_usable(tmp_path):
    """An OutOfMemoryError raised by a layer in the middle of a per-prompt call, a request scope and a blend: the
    error reaches the caller, and afterwards every mode gives the same images as before the failure."""
    import pytest

    pytest.importorskip("diffusers")
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    pipe.set_progress_bar_config(disable=True)
    files = {seed: tiny.random_lora_files(pipe, seed=seed) for seed in (1, 2)}  # from the plain pipe
    for seed, lora in files.items():
        d = tmp_path / f"l{seed}"
        d.mkdir()
        for name, data in lora.items():
            (d / name).write_bytes(data)
        pipe.load_fd_lora(str(d), adapter_name=f"l{seed}")
    pipe.set_adapters(["l1", "l2"], [0.7, -0.5])
    kw = dict(num_inference_steps=2, height=32, width=32, output_type="pt")

    def calls():
        g = torch.Generator().manual_seed(0)
        out = {"blend": pipe(["a cat"], generator=g, **kw).images,
               "per_prompt": pipe(["a cat", "a dog"], fd_lora_adapters=["l1", None], generator=g, **kw).images}
        with fdlora.adapters(pipe, {"l2": 1.0}):
            out["scope"] = pipe(["a cat"], generator=g, **kw).images
        return out

    want = calls()
    from fdlora.kernels import ops as reference

    armed = [False]
    real = {n: getattr(reference, n) for n in ("lora_delta", "lora_linear", "lora_delta_rows")}

    def failing(fn):
        def op(*a, **k):
            if armed[0]:
                armed[0] = False
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return fn(*a, **k)
        return op

    fdlora.set_merge_cache(0)  # every layer runs the per-call op: the failure lands mid-step
    try:
        for n, fn in real.items():
            setattr(reference, n, failing(fn))
        for name, fn in (("per_prompt", lambda: pipe(["a cat", "a dog"], fd_lora_adapters=["l1", None], **kw)),
                         ("blend", lambda: pipe(["a cat"], **kw))):
            armed[0] = True
            with pytest.raises(torch.OutOfMemoryError):
                fn()
            assert pipe.get_active_adapters() == ["l1", "l2"], name
        armed[0] = True
        with pytest.raises(torch.OutOfMemoryError), fdlora.adapters(pipe, {"l2": 1.0}):
            pipe(["a cat"], **kw)
        assert pipe.get_active_adapters() == ["l1", "l2"]
    finally:
        for n, fn in real.items():
            setattr(reference, n, fn)
        fdlora.set_merge_cache("auto")
    got = calls()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def test_bench_pressure_smoke(tmp_path):
    """benchmarks/bench_pressure.py (the GPU run of "wherever diffusers+PEFT runs a step, fd-lora runs it too") on
    toy widths: both sides run every step and the rows land in the JSON under the device name."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "reliability.json"
    out.write_text(json.dumps({"soak_cycles": 7}))  # figures already there stay
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_pressure.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = data["gpu"]["cpu (smoke)"]["pressure"]
    assert data["soak_cycles"] == 7
    assert {(row["side"], row["step"]) for row in rows} == {
        ("diffusers+peft", s) for s in ("one", "switch", "blend")} | {
        ("fd-lora", s) for s in ("one", "switch", "blend", "per_prompt")}
    assert all(row["outcome"] == "ok" for row in rows)
