"""The path a layer takes depends on (shapes, dtype, GPU, mode) only: the same in a fresh process and after any other
sequence of calls. Each side runs in its own fresh Python process; the GPU is a fake profile (the dispatcher's
per-shape plans are pure host code), so the check runs on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# real layer shapes (rows, in, out): SDXL attention / feed-forward at 2x4096 and 2x1024 rows, Flux, Llama decode and
# prefill; banks of 4 slots at rank 64 (what from_peft makes for four r16 adapters) and 1 slot at rank 16
SHAPES = [(8192, 640, 640), (2048, 1280, 1280), (2048, 1280, 10240), (2048, 5120, 1280), (154, 2048, 640),
          (4608, 3072, 3072), (4608, 3072, 12288), (32, 4096, 4096), (32, 4096, 14336), (2048, 4096, 1024)]

PLANS = textwrap.dedent("""
    import json, sys, torch
    from fdlora.kernels.triton.forward import lora_linear_dispatch as D
    gpu, shapes, others = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    from fdlora.kernels import costmodel
    D.profile = lambda name=None, gpu=gpu: costmodel.profile(gpu)
    def plans(shapes):
        return [D.plan(D.Problem(M, K, N, S, R, torch.bfloat16, "cuda", 132, G)).path
                for M, K, N in shapes for S, R in ((4, 64), (1, 16)) for G in (1, 2)]
    for M, K, N in others:  # other cases first: other shapes, then the same shapes through the merged path's probe
        plans([(M, K, N)])
    print(json.dumps(plans(shapes)))
""")


def _plans(gpu: str, others: list) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PLANS, gpu, json.dumps(SHAPES), json.dumps(others)],
                         capture_output=True, text=True, timeout=300, env={"FDLORA_DISPATCH": "auto",
                                                                           **_clean_env()})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _clean_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("FDLORA_")}


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 5090"])
def test_plans_are_the_same_fresh_and_after_other_cases(gpu: str):
    fresh = _plans(gpu, [])
    after = _plans(gpu, [list(s) for s in reversed(SHAPES)] + [[77, 2048, 640], [64, 3072, 3072]])
    assert fresh == after


def test_an_uncalibrated_gpu_keeps_to_cublas_paths():
    from fdlora.kernels.triton.forward import lora_linear_dispatch as D

    assert set(_plans("NVIDIA H200", [])) <= set(D.CUBLAS_PATHS)
    assert D.profile("NVIDIA H200") == ("NVIDIA H200", False)
    assert D.profile("NVIDIA H100 80GB HBM3")[1]


BACKEND = textwrap.dedent("""
    import torch
    from fdlora.kernels import registry
    from fdlora.kernels.cuda import build
    built = []
    build.build = lambda *a, **k: built.append(1) or (_ for _ in ()).throw(RuntimeError("built"))
    build.status = lambda: build.Status(None, None)  # not built, but buildable here
    torch.cuda.is_available = lambda: True  # a GPU machine as far as the probes can tell
    first = registry.select(registry.Problem("cuda", torch.float16, "linear", 16, 4)).name
    conv = registry.select(registry.Problem("cuda", torch.float16, "conv2d", 16, 4)).name
    again = registry.select(registry.Problem("cuda", torch.float16, "linear", 16, 4)).name
    print(first, conv, again, len(built))
""")


def test_choosing_a_backend_never_builds_the_extension():
    """A conv layer under `auto` used to probe the cuda backend, whose import builds the extension: every later
    layer (and process) then got another backend. `auto` now passes over an unbuilt extension."""
    out = subprocess.run([sys.executable, "-c", BACKEND], capture_output=True, text=True, timeout=300,
                         env=_clean_env())
    assert out.returncode == 0, out.stderr[-2000:]
    first, conv, again, built = out.stdout.split()
    assert built == "0"
    assert first == again
    assert conv == "torch"


LAYERS = textwrap.dedent("""
    import json, sys, torch, fdlora
    from torch import nn
    from fdlora.hub.adapter import LoraAdapter, ModuleLora
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    fdlora.inject(model, ["0", "2"])
    for n in ("a", "b"):
        fdlora.add_adapter(model, LoraAdapter({p: ModuleLora(torch.randn(4, k) / 8, torch.randn(o, 4) / 8, 4.0)
                                               for p, k, o in (("0", 32, 48), ("2", 48, 16))}), n)
    x = torch.randn(6, 32)
    if sys.argv[1] == "after":  # other cases first: a blend, per-sample rows, the merged cache off and on
        fdlora.set_adapters(model, ["a", "b"], [0.5, 0.5]); model(x)
        with fdlora.per_sample(model, ["a", "b", None, "a", "b", "a"]):
            model(x)
        fdlora.set_merge_cache(0); model(x); fdlora.set_merge_cache("auto")
    fdlora.set_adapters(model, ["a"], [0.8])
    y = model(x)
    print(json.dumps([fdlora.dispatch_counts(model), y.sum().item()]))
""")


def test_a_tiny_models_paths_are_the_same_fresh_and_after_other_cases():
    got = {}
    for order in ("fresh", "after"):
        out = subprocess.run([sys.executable, "-c", LAYERS, order], capture_output=True, text=True, timeout=300,
                             env=_clean_env())
        assert out.returncode == 0, out.stderr[-2000:]
        got[order] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fresh"][0] == got["after"][0]
    assert sum(got["fresh"][0].values()) == 2 and "not called" not in json.dumps(got["fresh"][0])
    assert abs(got["fresh"][1] - got["after"][1]) <= 1e-5 * max(1.0, abs(got["fresh"][1]))
