"""lora_linear (base GEMM + LoRA delta in one op) against a float64 oracle, on CPU and on CUDA.

CPU cases run only in a process started with TRITON_INTERPRET=1 (test_lora_linear_interpret.py
starts one, the same way test_triton_interpret.py does for the delta ops); elsewhere they skip.
CUDA cases are marked `gpu` and skip without a device. Inputs come from triton_cases.make_inputs:
A/B past each slot's live rank and every weight of an inactive slot are NaN, so a kernel that
reads what it must skip fails; x is clean here (the base GEMM reads every row). Outputs are
allocated with torch.empty under fill_uninitialized_memory, so an unwritten element is NaN.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton_cases import DEVICES, DTYPES, HAS_CUDA, Case, _c, _place, eager_peft, make_inputs, skip_unless, tolerance

from fdlora.kernels import ops as ref
from fdlora.testing import EPS

pytestmark = pytest.mark.triton  # the Triton backend, as auto picks it (even under FDLORA_BACKEND=cuda)


@dataclass(frozen=True)
class Lin:
    case: Case
    path: str = "fused"  # lora_linear_dispatch.PATHS, or "op" (the registered op and its dispatch)
    bias: bool = False
    config: str | None = None  # "persistent": launch with the persistent config instead of the default

    @property
    def id(self) -> str:
        extra = ("-bias" if self.bias else "") + (f"-{self.config}" if self.config else "")
        return f"{self.case.id}-{self.path}{extra}"


CPU_CASES = [
    Lin(_c("blend-r16-M37-K80-N48-fp32", "blend", 37, 80, 48, 16, [16], [0.5]), bias=True),
    Lin(_c("blend-r16-M37-K80-N48-fp16", "blend", 37, 80, 48, 16, [16], [0.5], dtype="fp16"), "fused_pre"),
    Lin(_c("blend-r1-M5-K33-N17-fp16", "blend", 5, 33, 17, 16, [1], [2.0], dtype="fp16"), bias=True),
    Lin(_c("blend-S3-r32x3-extra-pass-fp32", "blend", 40, 64, 40, 32, [32, 32, 20], [0.5, 1.0, 2.0])),
    Lin(_c("blend-S3-r32x3-extra-pass-fp32", "blend", 40, 64, 40, 32, [32, 32, 20], [0.5, 1.0, 2.0]), "fused_pre"),
    Lin(_c("blend-S4-ranks3.16.40.64-zero-slot-fp16", "blend", 33, 40, 36, 64, [3, 16, 40, 64],
           [0.7, 0.0, 1.3, 0.4], dtype="fp16"), bias=True),
    Lin(_c("blend-all-inactive-fp32", "blend", 17, 32, 16, 16, [16, 4], [0.0, 0.0])),
    Lin(_c("groups-G3-M39-straddling-S3-fp32", "groups", 39, 24, 40, 32, [16, 32, 9], [1.0, 0.5, 2.0], G=3),
        bias=True),
    Lin(_c("groups-G4-M44-base-sample-fp16", "groups", 44, 48, 20, 16, [16, 12, 16], [0.5, 1.0, 1.5], G=4,
           dtype="fp16"), "fused_pre"),
    Lin(_c("groups-G5-M35-bf16", "groups", 35, 32, 24, 16, [16, 7], [1.0, 0.5], G=5, dtype="bf16")),
    Lin(_c("blend-S2-strided-fp16", "blend", 29, 40, 33, 32, [8, 32], [1.0, 0.5], dtype="fp16", strided=True),
        "fused_pre", bias=True),
    Lin(_c("blend-r16-M37-K80-N48-fp32", "blend", 37, 80, 48, 16, [16], [0.5]), config="persistent"),
    Lin(_c("groups-G3-M39-S3-fp16", "groups", 39, 64, 40, 16, [16, 8, 16], [1.0, 0.5, 2.0], G=3, dtype="fp16"),
        "op", bias=True),
    Lin(_c("blend-S2-r16-fp16", "blend", 24, 48, 32, 16, [16, 5], [1.0, 0.5], dtype="fp16"), "cublas_delta"),
    Lin(_c("blend-S4-ranks3.16.40.64-zero-slot-fp16", "blend", 33, 40, 36, 64, [3, 16, 40, 64],
           [0.7, 0.0, 1.3, 0.4], dtype="fp16"), "merged", bias=True),
    Lin(_c("groups-G4-M44-base-sample-fp16", "groups", 44, 48, 20, 16, [16, 12, 16], [0.5, 1.0, 1.5], G=4,
           dtype="fp16"), "merged", bias=True),
]

GPU_CASES = [
    Lin(_c("sdxl-1024x1280-r16-bf16", "blend", 1024, 1280, 1280, 16, [16], [0.5], dtype="bf16"), bias=True),
    Lin(_c("sdxl-1024x1280-r16-bf16", "blend", 1024, 1280, 1280, 16, [16], [0.5], dtype="bf16"), "fused_pre",
        bias=True),
    Lin(_c("odd-1000x1000x1000-r1.7.16.3-fp16", "blend", 1000, 1000, 1000, 16, [1, 7, 16, 3], [0.5, 1.0, 0.0, 2.0],
           dtype="fp16"), bias=True),
    Lin(_c("odd-1000x1000x1000-r1.7.16.3-fp16", "blend", 1000, 1000, 1000, 16, [1, 7, 16, 3], [0.5, 1.0, 0.0, 2.0],
           dtype="fp16"), "fused_pre", bias=True),
    Lin(_c("r128.100-777x640x520-bf16", "blend", 777, 640, 520, 128, [128, 100], [0.25, 0.5], dtype="bf16")),
    Lin(_c("r128.100-777x640x520-bf16", "blend", 777, 640, 520, 128, [128, 100], [0.25, 0.5], dtype="bf16"),
        "fused_pre"),
    Lin(_c("flux-blend4x16-2048x3072-bf16", "blend", 2048, 3072, 3072, 16, [16] * 4, [0.3, 0.3, 0.2, 0.2],
           dtype="bf16"), bias=True),
    Lin(_c("groups-G3-M999-unaligned-S3-fp16", "groups", 999, 640, 640, 32, [32, 9, 16], [1.0, 0.5, 2.0], G=3,
           dtype="fp16")),
    Lin(_c("groups-G2-4096x1280-bf16", "groups", 4096, 1280, 1280, 16, [16, 16], [1.0, 0.7], G=2, dtype="bf16"),
        "fused_pre", bias=True),
    Lin(_c("groups-G8-M8-decode-4096-bf16", "groups", 8, 4096, 4096, 16, [16, 16], [1.0, 0.7], G=8, dtype="bf16")),
    Lin(_c("sdxl-1024x1280-r16-bf16", "blend", 1024, 1280, 1280, 16, [16], [0.5], dtype="bf16"), "cublas_delta",
        bias=True),
    Lin(_c("sdxl-1024x1280-r16-bf16", "blend", 1024, 1280, 1280, 16, [16], [0.5], dtype="bf16"), "reference",
        bias=True),
    Lin(_c("flux-blend4x16-2048x3072-bf16", "blend", 2048, 3072, 3072, 16, [16] * 4, [0.3, 0.3, 0.2, 0.2],
           dtype="bf16"), "op", bias=True),
    Lin(_c("sdxl-1024x1280-r16-bf16", "blend", 1024, 1280, 1280, 16, [16], [0.5], dtype="bf16"), "merged",
        bias=True),
    Lin(_c("odd-1000x1000x1000-r1.7.16.3-fp16", "blend", 1000, 1000, 1000, 16, [1, 7, 16, 3], [0.5, 1.0, 0.0, 2.0],
           dtype="fp16"), "merged", bias=True),
    Lin(_c("r128.100-777x640x520-bf16", "blend", 777, 640, 520, 128, [128, 100], [0.25, 0.5], dtype="bf16"),
        "merged"),
    Lin(_c("groups-G3-M999-unaligned-S3-fp16", "groups", 999, 640, 640, 32, [32, 9, 16], [1.0, 0.5, 2.0], G=3,
           dtype="fp16"), "merged", bias=True),
    Lin(_c("groups-G8-M8-decode-4096-bf16", "groups", 8, 4096, 4096, 16, [16, 16], [1.0, 0.7], G=8, dtype="bf16"),
        "op"),
]

@pytest.fixture
def L(monkeypatch):
    """The lora_linear module, with one config per kernel (tests check numbers, not speed; fewer compiles)."""
    from fdlora.kernels.triton import config
    from fdlora.kernels.triton.forward import lora_linear

    monkeypatch.setattr(config, "AUTOTUNE", False)
    return lora_linear


@contextlib.contextmanager
def nan_empty():
    """torch.empty returns NaN-filled memory inside, so an output element nothing wrote fails the check."""
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def linear_inputs(lin: Lin, device: str, seed: int = 0) -> dict:
    """make_inputs plus a base weight and bias; oracle = x W^T + bias + delta in float64."""
    case = lin.case
    d = make_inputs(case, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    dt = DTYPES[case.dtype]
    W = (torch.randn(case.N, case.K, generator=g) * case.K**-0.5).to(dt)
    bias = torch.randn(case.N, generator=g).to(dt) if lin.bias else None
    clean = d["clean"]
    base64 = clean["x"].double() @ W.double().t() + (bias.double() if bias is not None else 0.0)
    d["oracle"] = base64 + (d["oracle"] - clean["y"].double())
    eager_dev = "cuda" if device == "cuda" else "cpu"
    ce = {k: (v.to(eager_dev) if k != "w" else v) for k, v in clean.items()}
    ce["y"] = F.linear(ce["x"], W.to(eager_dev), bias.to(eager_dev) if bias is not None else None)
    d["eager"] = eager_peft({**ce, "w": clean["w"].to(eager_dev)}, case).cpu()
    d["x"] = _place(clean["x"], device, case.strided)
    d["W"] = W.to(device)
    d["bias"] = bias.to(device) if bias is not None else None
    return d


def run(L, lin: Lin, d: dict) -> torch.Tensor:
    args = (d["x"], d["W"], d["bias"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"])
    with nan_empty():
        if lin.path == "op":
            return torch.ops.fdlora.lora_linear(*args)
        if lin.config == "persistent":
            cfg = L._cfg(4, 1, 16, 32, 32, group=2, persistent=1)
            return L.launch_lora_linear(*args, config=cfg)
        return L.run_path(lin.path, *args)


def check(lin: Lin, d: dict, y: torch.Tensor) -> None:
    case = lin.case
    assert y.shape == (case.M, case.N) and y.dtype == DTYPES[case.dtype]
    out = y.cpu()
    assert not out.isnan().any(), "NaN in the output: an element was not written or a skipped weight was read"
    tol = tolerance(case, d["eager"], d["oracle"])
    err = (out.double() - d["oracle"]).abs().max().item()
    assert err <= tol, f"{lin.id}: max error {err:.3e} > {tol:.3e} (eager's own error x2 + 1 ulp)"


@pytest.mark.parametrize("lin", CPU_CASES, ids=lambda c: c.id)
def test_lora_linear_matches_oracle_interpreted(L, lin: Lin) -> None:
    skip_unless("cpu")
    d = linear_inputs(lin, "cpu")
    check(lin, d, run(L, lin, d))


@pytest.mark.gpu
@pytest.mark.parametrize("lin", GPU_CASES, ids=lambda c: c.id)
def test_lora_linear_matches_oracle_gpu(L, lin: Lin) -> None:
    skip_unless("cuda")
    d = linear_inputs(lin, "cuda")
    check(lin, d, run(L, lin, d))


@pytest.mark.parametrize("device", DEVICES)
def test_reference_lora_linear_matches_oracle(device: str) -> None:
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA device")
    lin = Lin(_c("ref-groups-G3-fp32", "groups", 39, 24, 40, 32, [16, 32, 9], [1.0, 0.5, 2.0], G=3), bias=True)
    d = linear_inputs(lin, device)
    clean = d["clean"]
    y = ref.lora_linear(clean["x"].to(device), d["W"], d["bias"], clean["A"].to(device), clean["B"].to(device),
                        d["scale"], d["group_weight"], d["ranks"])
    check(lin, d, y)


@pytest.mark.parametrize("device", DEVICES)
def test_switching_weights_in_place_keeps_one_launch_shape(L, device: str) -> None:
    """One set of buffers, several active sets written in place (what compiled graphs and CUDA graphs replay)."""
    skip_unless(device)
    dtype = "fp32" if device == "cpu" else "fp16"  # fp32 on CUDA: IEEE dots on CUDA cores, slow to build and run
    lin = Lin(_c(f"switch-{dtype}", "blend", 24, 48, 32, 32, [16, 32, 8], [1.0, 1.0, 1.0], dtype=dtype), bias=True)
    d = linear_inputs(lin, device)
    x, A, B = (d["clean"][k].to(device) for k in ("x", "A", "B"))
    scale = torch.zeros(3, device=device)
    for weights in ([1.0, 0.0, 0.0], [0.3, 0.0, 0.7]):
        scale.copy_(torch.tensor(weights))
        args = (x, d["W"], d["bias"], A, B, scale, d["group_weight"], d["ranks"])
        for path in ("fused", "fused_pre", "merged"):
            tol = 1e-5 if dtype == "fp32" else 2e-2
            torch.testing.assert_close(L.run_path(path, *args), ref.lora_linear(*args), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(L, device: str) -> None:
    skip_unless(device)
    dtype = "fp32" if device == "cpu" else "bf16"
    lin = Lin(_c(f"opcheck-{dtype}", "groups", 32, 32, 32, 16, [16, 4], [1.0, 0.5], G=2, dtype=dtype), bias=True)
    d = linear_inputs(lin, device)
    x, A, B = (d["clean"][k].to(device) for k in ("x", "A", "B"))
    args = (x, d["W"], d["bias"], A, B, d["scale"], d["group_weight"], d["ranks"])
    # The interpreter runs kernels even under FakeTensorMode (wrap_triton does not intercept its
    # InterpretedFunction), so on CPU only the checks that need no fake tracing apply. Shapes are
    # static by design (autotune keys and the dispatch plan are per concrete shape): no dynamic check.
    utils = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        utils += ["test_faketensor", "test_aot_dispatch_static"]
    kw = {"test_utils": tuple(utils)}
    torch.library.opcheck(torch.ops.fdlora.lora_linear.default, args, **kw)
    torch.library.opcheck(torch.ops.fdlora.lora_linear.default, (*args[:2], None, *args[3:]), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_operands_raise_with_the_fix(L, device: str) -> None:
    skip_unless(device)
    from fdlora.errors import FdLoraError

    x = torch.zeros(4, 16, device=device)
    W = torch.zeros(8, 16, device=device)
    A = torch.zeros(2, 16, 16, device=device)
    B = torch.zeros(8, 2, 16, device=device)
    sc, gw, rk = (torch.ones(2, device=device), torch.ones(1, 2, device=device),
                  torch.full((2,), 16, dtype=torch.int32, device=device))
    with pytest.raises(FdLoraError, match="nn.Linear weight"):
        L.lora_linear(x, W[:, :8], None, A, B, sc, gw, rk)
    with pytest.raises(FdLoraError, match="share one dtype"):
        L.lora_linear(x, W.half(), None, A, B, sc, gw, rk)
    with pytest.raises(FdLoraError, match="G dividing M"):
        L.lora_linear(x, W, None, A, B, sc, torch.ones(3, 2, device=device), rk)


def test_reference_and_triton_signatures_agree() -> None:
    import inspect

    try:
        from fdlora.kernels.triton.forward import lora_linear
    except ImportError as e:  # triton missing
        pytest.skip(f"triton not importable: {e}")
    params = lambda f: [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert params(lora_linear.launch_lora_linear)[:8] == params(ref.lora_linear)


@pytest.mark.gpu
def test_compiled_and_cuda_graph_replay_follow_in_place_switches(L) -> None:
    skip_unless("cuda")
    import torch._dynamo

    lin = Lin(_c("graph-bf16", "groups", 512, 256, 384, 16, [16, 8, 16], [1.0, 0.5, 2.0], G=2, dtype="bf16"),
              bias=True)
    d = linear_inputs(lin, "cuda")
    x, A, B = (d["clean"][k].to("cuda") for k in ("x", "A", "B"))
    scale, gw = d["scale"].clone(), d["group_weight"].clone()
    args = (x, d["W"], d["bias"], A, B, scale, gw, d["ranks"])
    fn = torch.compile(lambda *a: torch.ops.fdlora.lora_linear(*a), fullgraph=True)
    torch._dynamo.reset()
    prev = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        static = torch.ops.fdlora.lora_linear(*args)  # warm (autotune) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = torch.ops.fdlora.lora_linear(*args)
        for weights, rows in (([1.0, 0.0, 0.0], [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
                              ([0.3, 0.3, 0.4], [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])):
            scale.copy_(torch.tensor(weights))
            gw.copy_(torch.tensor(rows))
            expected = ref.lora_linear(*args)
            torch.testing.assert_close(fn(*args), expected, rtol=2e-2, atol=2e-2)
            graph.replay()
            torch.testing.assert_close(static, expected, rtol=2e-2, atol=2e-2)
    finally:
        torch._dynamo.config.error_on_recompile = prev


@pytest.mark.parametrize(
    "M,K,N,S,R,G,expected",
    [
        pytest.param(8192, 1280, 1280, 1, 16, 1, "merged", id="sdxl-8192x1280-r16"),
        pytest.param(16384, 640, 640, 4, 16, 1, "merged", id="sdxl-16384x640-blend4x16"),
        pytest.param(4608, 3072, 3072, 1, 64, 1, "merged", id="flux-4608x3072-r64"),
        pytest.param(4608, 12288, 3072, 1, 64, 1, "merged", id="flux-4608x12288-r64"),  # 1.202 vs 1.240 interleaved
        pytest.param(32, 4096, 4096, 1, 16, 1, "cublas_delta", id="decode-32x4096-r16"),
    ],
)
def test_dispatch_model_picks_what_the_h100_measured(M, K, N, S, R, G, expected, monkeypatch) -> None:
    """The cost model's choices at benchmarked H100 shapes (interleaved timing of merged vs cublas_delta), on the
    H100 whatever GPU (or none) runs the test."""
    try:
        from fdlora.kernels.triton.forward import lora_linear_dispatch as D
    except ImportError as e:
        pytest.skip(f"triton not importable: {e}")
    monkeypatch.setattr(D, "profile", lambda name=None: ("NVIDIA H100 80GB HBM3", True))
    if not D.delta_available():
        pytest.skip("the Triton lora_delta op is not importable here")
    p = D.Problem(M, K, N, S, R, torch.bfloat16, "cuda", 132, G)
    D.clear()
    assert D.plan(p).path == expected, str(D.plan(p))
    assert D.plan(p) is D.plan(p)  # decided once, cached
    assert D.record(p, {"fused": 1.0, "merged": 2.0}).path == "fused" and D.plan(p).path == "fused"
    D.clear()
    fp32 = D.Problem(M, K, N, S, R, torch.float32, "cuda", 132, G)
    assert D.plan(fp32).path not in ("fused", "fused_pre")  # IEEE fp32 Triton dots are never the fast path
    D.clear()


def test_dispatch_measures_close_candidates_once(monkeypatch) -> None:
    """FDLORA_DISPATCH=measure: the first plan of a shape whose modelled paths are close times exactly those,
    keeps the fastest by the timer, and is cached; clear-cut shapes, the default mode, calls without a runner
    and a failing timer all leave the choice to the model."""
    try:
        from fdlora.kernels.triton.forward import lora_linear_dispatch as D
    except ImportError as e:
        pytest.skip(f"triton not importable: {e}")
    if not D.delta_available():
        pytest.skip("the Triton lora_delta op is not importable here")
    close = D.Problem(4608, 12288, 3072, 1, 64, torch.bfloat16, "cuda", 132, 1)  # merged vs cublas_delta
    clear = D.Problem(8192, 1280, 1280, 1, 16, torch.bfloat16, "cuda", 132, 1)  # merged by far
    us = D.estimate(close)
    near = [k for k in sorted(us, key=us.get) if us[k] <= min(us.values()) * (1 + D.AMBIGUOUS)]
    assert len(near) >= 2, us
    ran, timed = [], []

    def run(path):
        ran.append(path)

    def timer(fn):  # the model's last close candidate is the fastest "on the GPU"
        fn()
        timed.append(ran[-1])
        return 1.0 if ran[-1] == near[-1] else 2.0

    D.clear()
    try:
        assert D.plan(close, run, timer).path == near[0] and not ran  # default: the model alone
        D.clear()
        monkeypatch.setenv("FDLORA_DISPATCH", "measure")
        got = D.plan(close, run, timer)
        assert got.path == near[-1] and sorted(timed) == sorted(near) and "measured" in got.reasons[0]
        assert D.plan(close, run, timer) is got and len(timed) == len(near)  # cached: measured once
        assert D.plan(clear, run, timer).path == "merged" and len(timed) == len(near)  # not ambiguous
        D.clear()
        assert D.plan(close).path == near[0]  # no runner (compiling, capturing): the model

        def broken(fn):
            raise RuntimeError("capture refused")

        D.clear()
        got = D.plan(close, run, broken)
        assert got.path == near[0] and "measuring failed" in got.reasons[-1]
    finally:
        D.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_measured_dispatch_times_on_the_gpu_and_matches_the_oracle(L, monkeypatch) -> None:
    """FDLORA_DISPATCH=measure on a real ambiguous shape: the first call times the close paths with CUDA
    graphs, the result equals the reference, and the plan says it was measured."""
    from fdlora.kernels.triton.forward import lora_linear_dispatch as D

    monkeypatch.setenv("FDLORA_DISPATCH", "measure")
    g = torch.Generator(device="cuda").manual_seed(0)
    M, K, N, R = 4608, 12288, 3072, 64
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    W = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    A = (torch.randn(1, R, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    B = (torch.randn(N, 1, R, device="cuda", generator=g) * 0.05).bfloat16()
    scale, gw = torch.ones(1, device="cuda"), torch.ones(1, 1, device="cuda")
    ranks = torch.full((1,), R, dtype=torch.int32, device="cuda")
    D.clear()
    try:
        with torch.inference_mode():
            y = L.lora_linear(x, W, None, A, B, scale, gw, ranks)
            want = ref.lora_linear(x, W, None, A, B, scale, gw, ranks)
        plan = D.plan(D.Problem(M, K, N, 1, R, torch.bfloat16, "cuda", D_sms(), 1))
        assert "measured" in plan.reasons[0], str(plan)
        torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    finally:
        D.clear()


def D_sms() -> int:
    from fdlora.kernels.triton import config

    return config.sm_count(torch.cuda.current_device())


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d-views"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_merge_into_buffer_matches_oracle(L, device: str, backend: str, transposed: bool) -> None:
    """ops.lora_merge(out, W, A, B, scale, ranks): the merged-weight cache's refresh, written in place
    (for a transformers Conv1D, whose weight is [K, N], into transposed views of W and the buffer)."""
    if backend == "triton":
        skip_unless(device)
    elif device == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA device")
    from fdlora.kernels import registry

    dtype = "fp32" if device == "cpu" else "fp16"
    lin = Lin(_c(f"merge-{dtype}", "blend", 8, 40, 36, 64, [3, 16, 40, 64], [0.7, 0.0, 1.3, 0.4], dtype=dtype))
    d = linear_inputs(lin, device)
    A, B = (d["clean"][k].to(device, DTYPES[dtype]) for k in ("A", "B"))
    W = d["W"]
    oracle = W.double().cpu() + torch.einsum("s,nsr,srk->nk", d["scale"].double().cpu(), B.double().cpu(),
                                             A.double().cpu())
    out = torch.full_like(W, float("nan"))
    ops = registry.ops(backend)
    if transposed:  # the same numbers, stored [K, N] as Conv1D stores them
        Wt, buf = W.t().contiguous(), torch.full_like(W.t().contiguous(), float("nan"))
        ops.lora_merge(buf.t(), Wt.t(), A, B, d["scale"], d["ranks"])
        out = buf.t()
    else:
        assert ops.lora_merge(out, W, A, B, d["scale"], d["ranks"]) is out
    one_rounding = EPS[DTYPES[dtype]] * float(oracle.abs().max())
    sum_err = 64 * 4 * torch.finfo(torch.float32).eps * float(oracle.abs().max())
    assert float((out.double().cpu() - oracle).abs().max()) <= one_rounding + sum_err


@pytest.mark.parametrize("device", DEVICES)
def test_stamped_merge_runs_only_when_the_weights_or_the_bank_changed(L, device: str) -> None:
    """lora_merge with a stamp (the device-side merged-weight cache): the first launch merges; a launch with the
    same weights and bank version leaves the buffer alone (poisoned here to prove it); a changed weight, slot
    or version merges again, and every merge leaves the stamp matching and its program counter at zero."""
    skip_unless(device)
    from fdlora.kernels.triton.merge.lora_merge import launch_merge, new_stamp

    dtype = "fp32" if device == "cpu" else "fp16"
    lin = Lin(_c(f"stamp-{dtype}", "blend", 8, 40, 36, 16, [3, 16, 8], [0.7, 0.0, 1.3], dtype=dtype))
    d = linear_inputs(lin, device)
    A, B = (d["clean"][k].to(device, DTYPES[dtype]) for k in ("A", "B"))
    W, ranks, S = d["W"], d["ranks"], A.shape[0]
    ones = torch.ones(1, S, device=device)
    version = torch.zeros(1, dtype=torch.int32, device=device)
    stamp, out = new_stamp(S, device), torch.full_like(W, float("nan"))[None]

    def oracle(scale):
        return W.double().cpu() + torch.einsum("s,nsr,srk->nk", scale.double().cpu(), B.double().cpu(),
                                               A.double().cpu())

    def merge(scale):
        launch_merge(W, A, B, scale, ones, ranks, out=out, stamp=stamp, version=version, blocks=dict(
            BN=16, BK=16, num_warps=4, num_stages=1))  # 3 x 3 programs: the counter must see all of them

    def merged_to(scale):
        err = float((out[0].double().cpu() - oracle(scale)).abs().max())
        assert err <= 64 * EPS[DTYPES[dtype]] * float(oracle(scale).abs().max()), err
        assert stamp[S + 1].item() == 0 and stamp[S].item() == version.item()
        assert torch.equal(stamp[:S].cpu(), (scale.float() * ones[0]).cpu().view(torch.int32))

    scale = d["scale"].clone()
    merge(scale)
    merged_to(scale)
    out.fill_(float("nan"))
    merge(scale.clone())  # same values in another tensor: still fresh
    assert out.isnan().all(), "a fresh stamp must skip the merge"
    for change in (lambda: scale.__setitem__(1, 0.25),  # a weight of an inactive slot becomes live
                   lambda: scale.__setitem__(0, -0.7),
                   lambda: version.add_(1)):  # a bank write (load, delete)
        change()
        out.fill_(float("nan"))
        merge(scale)
        merged_to(scale)
    with pytest.raises(Exception, match="new_stamp"):
        launch_merge(W, A, B, scale, ones.repeat(2, 1), ranks, stamp=stamp, version=version)
