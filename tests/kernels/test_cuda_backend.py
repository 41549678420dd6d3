"""The CUDA C++ backend (fdlora/kernels/cuda): every op against the float64 oracle on the Triton ops' case table,
opcheck, CUDA graph capture, fullgraph compile; and, without nvcc or a GPU, a clean "not built" and the fallback.

GPU cases build the extension on first use (about a minute) and are marked gpu."""

from __future__ import annotations

import pytest
import torch
from triton_cases import (
    CASES,
    REALISTIC,
    Case,
    eager_peft,
    make_inputs,
    mlp_oracle,
    mlp_with_adapters,
    tolerance,
    with_dtype,
)

from fdlora.kernels import ops as ref
from fdlora.kernels import registry
from fdlora.kernels.cuda import build
from fdlora.kernels.ops.lora_merge import lora_merge as ref_merge
from fdlora.kernels.ops.lora_merge import new_stamp

HAS_CUDA = torch.cuda.is_available()
ALL = [*CASES, *[with_dtype(c, "bf16") for c in CASES if c.dtype == "fp16"], *REALISTIC]


# --- without a GPU or nvcc ---------------------------------------------------------------------------------------
def test_status_without_nvcc_says_so_and_selection_falls_back(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("FDLORA_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_packaged", lambda: None)
    monkeypatch.setattr(build.Path, "is_file", lambda self: False)  # no /usr/local/cuda/bin/nvcc either
    st = build.status()
    assert not st.usable and str(st).startswith("not built: nvcc not found"), str(st)
    cuda = registry.backends()["cuda"]
    monkeypatch.setattr(cuda, "_probed", False)
    reason = cuda.unavailable()
    assert reason is not None and reason.startswith("not built: nvcc not found"), reason
    sel = registry.select(registry.Problem("cpu", torch.float32, "linear", 16, 2), prefer="auto")
    # the torch reference on the CPU (Triton's interpreter, under TRITON_INTERPRET=1)
    assert sel.name in ("torch", "triton") and any("not built: nvcc not found" in r for r in sel.reasons), sel
    with pytest.raises(Exception, match="nvcc not found"):
        registry.select(registry.Problem("cuda", torch.float16, "linear", 16, 2), prefer="cuda")
    with pytest.raises(Exception, match="cannot be built: nvcc not found"):
        build.build()
    monkeypatch.setattr(cuda, "_probed", False)


def test_env_command_reports_each_backend_and_why(monkeypatch, tmp_path, capsys) -> None:
    from fdlora.apps.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build, "_packaged", lambda: None)
    monkeypatch.setattr(build, "_cached", lambda: None)
    monkeypatch.setattr(build, "nvcc", lambda: None)
    cuda = registry.backends()["cuda"]
    monkeypatch.setattr(cuda, "_probed", False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch       {torch.__version__}" in out
    assert "cuda ext    not built: nvcc not found" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(lines) == set(registry.backends())
    assert lines["torch"].split(None, 1)[1] == "available"
    assert "not built: nvcc not found" in lines["cuda"]
    assert "prefetch    files read in fd-lora's reader process (FDLORA_PREFETCH_READER)" in out
    monkeypatch.setattr(cuda, "_probed", False)


def test_status_names_a_missing_ninja(monkeypatch, tmp_path) -> None:
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {torch.version.cuda or '13.0'}, V0'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setattr(build.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(build.torch.version, "cuda", torch.version.cuda or "13.0")
    assert build.build_problem() == "ninja not found; pip install ninja"


def _fake_cxx(path, libstdcxx: str) -> None:
    """A compiler whose `-print-file-name=libstdc++.so` answers `libstdcxx` (a bare name: only the static archive)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{libstdcxx}'\n")
    path.chmod(0o755)


def test_a_compiler_linking_libstdcxx_statically_is_passed_over_or_named(monkeypatch, tmp_path) -> None:
    shared = tmp_path / "lib" / "libstdc++.so"
    shared.parent.mkdir()
    shared.write_text("")
    _fake_cxx(tmp_path / "opt" / "g++", "libstdc++.so")  # the H100 host's /opt/gcc wrapper answers so
    _fake_cxx(tmp_path / "bin" / "g++", str(shared))
    monkeypatch.setenv("CXX", str(tmp_path / "opt" / "g++"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert build.compiler() == str(tmp_path / "bin" / "g++")
    monkeypatch.setenv("CXX", str(tmp_path / "bin" / "g++"))
    assert build.compiler() == str(tmp_path / "bin" / "g++")  # $CXX first when it links the shared library

    _fake_cxx(tmp_path / "bin" / "g++", "libstdc++.so")
    monkeypatch.setenv("CXX", str(tmp_path / "opt" / "g++"))
    monkeypatch.setattr(build, "nvcc", lambda: str(tmp_path / "nvcc"))
    monkeypatch.setattr(build, "_nvcc_version", lambda path: torch.version.cuda or "13.0")
    monkeypatch.setattr(build.torch.version, "cuda", torch.version.cuda or "13.0")
    monkeypatch.setattr(build.shutil, "which", lambda name, **k: str(tmp_path / "bin" / "g++")
                        if name in ("g++", "c++", "/usr/bin/g++") else name if name.startswith("/") else "/x/ninja")
    problem = build.build_problem()
    assert problem is not None and "links libstdc++ statically" in problem and "set CXX" in problem, problem
    with pytest.raises(Exception, match="cannot be built: the C\\+\\+ compiler"):
        build.build()


def test_every_cuda_source_is_in_the_digest() -> None:
    names = {p.name for p in build.CSRC.iterdir()}
    assert names == set(build.SOURCES) | set(build.HEADERS), names


# --- on the GPU --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cops():
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    if not build.status().usable:
        pytest.skip(f"the CUDA extension cannot be built here: {build.status()}")
    return registry.ops("cuda")


def _run(cops, case: Case, d: dict) -> None:
    if case.mode == "rows":
        cops.lora_delta_rows(d["y"], d["x"], d["A"], d["B"], d["scale"], d["row_slot"], d["ranks"])
    else:
        cops.lora_delta(d["y"], d["x"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_delta_matches_oracle(cops, case: Case) -> None:
    d = make_inputs(case, "cuda")
    before = d["y"].cpu().clone()
    _run(cops, case, d)
    out = d["y"].cpu()
    assert not out.isnan().any(), "NaN in the output: a kernel read a poisoned (skipped) element"
    tol = tolerance(case, eager_peft(d["clean"], case), d["oracle"])
    err = (out.double() - d["oracle"]).abs().max().item()
    assert err <= tol, f"{case.id}: max error {err:.3e} > {tol:.3e}"
    assert torch.equal(out[d["untouched"]], before[d["untouched"]]), "rows without an adapter changed"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in ALL if c.mode != "rows"], ids=lambda c: c.id)
def test_linear_matches_oracle(cops, case: Case) -> None:
    """lora_linear (merged + one GEMM, or GEMM + delta, per shape) = x W^T + b + delta."""
    d = make_inputs(case, "cuda")
    clean = d["clean"]
    g = torch.Generator().manual_seed(7)
    W = (torch.randn(case.N, case.K, generator=g) * case.K**-0.5).to(clean["x"].dtype)
    b = torch.randn(case.N, generator=g).to(clean["x"].dtype)
    x = clean["x"].cuda()
    y = cops.lora_linear(x, W.cuda(), b.cuda(), clean["A"].cuda(), clean["B"].cuda(), d["scale"], d["group_weight"],
                         d["ranks"])
    base = x.double() @ W.double().cuda().t() + b.double().cuda()
    expected = base.cpu() + d["oracle"] - clean["y"].double()
    eps = torch.finfo(x.dtype).eps
    tol = 8 * eps * expected.abs().max().item() + tolerance(case, eager_peft(clean, case), d["oracle"])
    err = (y.cpu().double() - expected).abs().max().item()
    assert err <= tol, f"{case.id}: max error {err:.3e} > {tol:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_merge_stamped_and_many(cops, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    S, R = 3, 32
    shapes = [(40, 24), (130, 17), (64, 128), (300, 520)]
    entries, exact = [], []
    for N, K in shapes:
        W, A, B = torch.randn(N, K, generator=g), torch.randn(S, R, K, generator=g) * 0.3, torch.randn(N, S, R,
                                                                                                        generator=g)
        scale = torch.tensor([0.5, 0.0, 1.5])
        A[1], B[:, 1] = float("nan"), float("nan")  # an inactive slot: never read
        A[2, 20:], B[:, 2, 20:] = 0, 0
        A[2, 32:] = float("nan")
        exact.append(W.double() + (B.double().nan_to_num() * scale.double()[None, :, None]).reshape(N, S * R)
                     @ A.double().nan_to_num().reshape(S * R, K))
        to = dict(device="cuda", dtype=dtype)
        entries.append((torch.full((N, K), float("nan"), **to), W.to(**to), A.to(**to), B.to(**to), scale.cuda(),
                        torch.tensor([32, 32, 20], dtype=torch.int32, device="cuda")))
    eps = torch.finfo(dtype).eps
    cops.lora_merge_many(entries, cops.merge_table())
    for (out, *_), ex in zip(entries, exact):
        assert (out.double().cpu() - ex).abs().max().item() <= 8 * eps * ex.abs().max().item() + 1e-5
    out, W, A, B, scale, ranks = entries[-1]
    stamp, version = new_stamp(S, "cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    fresh = torch.full_like(out, float("nan"))
    cops.lora_merge(fresh, W, A, B, scale, ranks, stamp, version)
    assert torch.equal(fresh, out)
    fresh.fill_(float("nan"))  # stamped and nothing changed: skipped on the device
    cops.lora_merge(fresh, W, A, B, scale, ranks, stamp, version)
    assert fresh.isnan().all()
    scale[0] = 0.25  # a weight changed: merged again
    cops.lora_merge(fresh, W, A, B, scale, ranks, stamp, version)
    expected = ref_merge(torch.empty_like(W, dtype=torch.float64), W.double(), A.double().nan_to_num(),
                         B.double().nan_to_num(), scale.double(), ranks)
    assert (fresh.double() - expected).abs().max().item() <= 8 * eps * expected.abs().max().item() + 1e-5
    version += 1  # the bank changed: merged again
    fresh.fill_(float("nan"))
    cops.lora_merge(fresh, W, A, B, scale, ranks, stamp, version)
    assert not fresh.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "unaligned", "row-padded"])
def test_merge_of_strided_and_unaligned_weights(cops, dtype, layout: str) -> None:
    """W and out that are not contiguous 16-byte aligned rows (a transposed view, a view one element past an aligned
    start, rows padded to an odd stride) take the kernels' element-wise reads and writes; the result is the same
    merge."""
    g = torch.Generator().manual_seed(2)
    S, R, N, K = 2, 16, 200, 264
    W0, A = torch.randn(N, K, generator=g), torch.randn(S, R, K, generator=g) * 0.3
    B = torch.randn(N, S, R, generator=g)
    scale = torch.tensor([0.75, -0.5])
    exact = W0.double() + (B.double() * scale.double()[None, :, None]).reshape(N, S * R) @ A.double().reshape(S * R, K)
    to = dict(device="cuda", dtype=dtype)

    def laid_out(t: torch.Tensor) -> torch.Tensor:
        if layout == "transposed":
            return t.to(**to).t().contiguous().t()
        if layout == "unaligned":
            return torch.empty(t.numel() + 1, **to)[1:].view(N, K).copy_(t)
        return torch.empty(N, K + 3, **to)[:, :K].copy_(t)

    W, out = laid_out(W0), laid_out(torch.full((N, K), float("nan")))
    cops.lora_merge(out, W, A.to(**to), B.to(**to), scale.cuda(), torch.full((S,), R, dtype=torch.int32,
                                                                               device="cuda"))
    eps = torch.finfo(dtype).eps
    assert (out.double().cpu() - exact).abs().max().item() <= 8 * eps * exact.abs().max().item() + 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [(1, 1), "same"], ids=["pad1", "same"])
def test_conv_delta_and_bias_match_reference(cops, padding) -> None:
    g = torch.Generator().manual_seed(1)
    S, R, C, N = 3, 16, 8, 12
    x = torch.randn(4, C, 9, 11, generator=g)
    A, B = torch.randn(S, R, C, 3, 3, generator=g) * 0.2, torch.randn(N, S, R, generator=g) * 0.2
    scale, gw = torch.tensor([1.0, 0.5, 0.0]), torch.rand(2, S, generator=g)
    y = torch.randn(4, N, 9, 11, generator=g)
    expected = y.double().clone()
    ref.lora_conv_delta(expected, x.double(), A.double(), B.double(), scale.double(), gw.double(), (1, 1), padding,
                        (1, 1))
    yc = y.cuda()
    cops.lora_conv_delta(yc, x.cuda(), A.cuda(), B.cuda(), scale.cuda(), gw.cuda(), (1, 1), padding, (1, 1))
    torch.testing.assert_close(yc.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    bias = torch.randn(S, N, generator=g)
    y2 = torch.randn(6, N, generator=g)
    for rows in (None, torch.tensor([0, -1, 2, 1, 1, 0], dtype=torch.int32)):
        w = ((rows.long()[:, None] == torch.arange(S)).double() * scale.double() if rows is not None
             else (gw.double() * scale.double()).repeat_interleave(3, 0))
        out = y2.cuda()
        cops.lora_bias_add(out, bias.cuda(), scale.cuda(), gw.cuda(), None if rows is None else rows.cuda())
        torch.testing.assert_close(out.double().cpu(), y2.double() + w @ bias.double(), rtol=1e-5, atol=1e-5)


def _clean(case: Case) -> dict:
    d = make_inputs(case, "cuda")
    c = {k: v.cuda() for k, v in d["clean"].items() if k != "w"}
    c.update({k: d[k] for k in ("scale", "ranks", "group_weight", "row_slot") if k in d})
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("M", [8, 96], ids=["small-M", "cublas"])
def test_an_operand_off_the_device_is_refused_before_any_launch(cops, M: int) -> None:
    """A host pointer handed to a kernel faults the whole CUDA context (an illegal address, reported at some later
    call); every op refuses it with an error that names the tensor's device, and the context stays usable."""
    c = _clean(Case("devices", "groups", M, 64, 40, 32, (32, 8, 16), (1.0, 0.0, 0.5), G=2, dtype="fp16"))
    W = torch.randn(40, 64, device="cuda", dtype=torch.float16) * 0.1
    y0 = c["y"].clone()
    calls = {
        "scale": lambda t: cops.lora_delta(c["y"], c["x"], c["A"], c["B"], t, c["group_weight"], c["ranks"]),
        "ranks": lambda t: cops.lora_delta(c["y"], c["x"], c["A"], c["B"], c["scale"], c["group_weight"], t),
        "A": lambda t: cops.lora_linear(c["x"], W, None, t, c["B"], c["scale"], c["group_weight"], c["ranks"]),
        "W": lambda t: cops.lora_linear(c["x"], t, None, c["A"], c["B"], c["scale"], c["group_weight"], c["ranks"]),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="every tensor must be on cuda"):
            call({"scale": c["scale"], "ranks": c["ranks"], "A": c["A"], "W": W}[name].cpu())
    torch.cuda.synchronize()  # no fault was queued
    assert torch.equal(c["y"], y0)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [8, 96], ids=["small-M", "cublas"])
def test_opcheck_every_op(cops, M: int) -> None:
    ops = torch.ops.fdlora_cuda
    c = _clean(Case("opcheck", "groups", M, 64, 40, 32, (32, 8, 16), (1.0, 0.0, 0.5), G=2, dtype="fp16"))
    r = _clean(Case("opcheck-rows", "rows", M, 64, 40, 32, (32, 8, 16), (1.0, 0.5, 0.5), dtype="fp16"))
    W = torch.randn(40, 64, device="cuda", dtype=torch.float16) * 0.1
    bias = torch.randn(40, device="cuda", dtype=torch.float16)
    blend = c["group_weight"][:1]
    h = ref.lora_shrink(c["x"], c["A"])
    torch.library.opcheck(ops.lora_delta.default, (c["y"], c["x"], c["A"], c["B"], c["scale"], c["group_weight"],
                                                   c["ranks"]))
    torch.library.opcheck(ops.lora_delta_rows.default, (r["y"], r["x"], r["A"], r["B"], r["scale"], r["row_slot"],
                                                        r["ranks"]))
    torch.library.opcheck(ops.lora_shrink.default, (c["x"], c["A"]))
    torch.library.opcheck(ops.lora_expand_add.default, (c["y"], h, c["B"], c["scale"], c["group_weight"]))
    for gw in (blend, c["group_weight"]):
        torch.library.opcheck(ops.lora_linear.default, (c["x"], W, bias, c["A"], c["B"], c["scale"], gw, c["ranks"]))
    out = torch.empty_like(W)
    stamp, version = new_stamp(3, "cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.library.opcheck(ops.lora_merge.default, (out, W, c["A"], c["B"], c["scale"], c["ranks"]))
    torch.library.opcheck(ops.lora_merge.default, (out, W, c["A"], c["B"], c["scale"], c["ranks"], stamp, version),
                          test_utils=("test_schema", "test_faketensor"))  # a stamped merge skips its re-run
    torch.library.opcheck(ops.lora_merge_many.default, ([out], [W], [c["A"]], [c["B"]], [c["scale"]]))
    torch.library.opcheck(ops.lora_bias_add.default, (c["y"], torch.randn(3, 40, device="cuda"), c["scale"],
                                                      c["group_weight"], None))


@pytest.mark.gpu
def test_cuda_graph_replays_in_place_switches(cops) -> None:
    c = _clean(Case("graph", "blend", 256, 320, 192, 64, (64, 16, 8), (1.0, 1.0, 1.0), dtype="fp16"))
    x, A, B, ranks, gw = c["x"], c["A"], c["B"], c["ranks"], c["group_weight"]
    W = torch.randn(192, 320, device="cuda", dtype=torch.float16) * 0.05
    y0, y = c["y"], c["y"].clone()
    scale = torch.tensor([1.0, 0.0, 0.0], device="cuda")
    row_slot = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    y_rows, y_small = y0.clone(), y0[:8].clone()
    out = {}

    def step():
        y.copy_(y0)
        cops.lora_delta(y, x, A, B, scale, gw, ranks)
        y_rows.copy_(y0)
        cops.lora_delta_rows(y_rows, x, A, B, scale, row_slot, ranks)
        y_small.copy_(y0[:8])
        cops.lora_delta_rows(y_small, x[:8], A, B, scale, row_slot[:8], ranks)
        out["linear"] = cops.lora_linear(x, W, None, A, B, scale, gw, ranks)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for weights in ([1.0, 0.0, 0.0], [0.0, 0.7, 0.0], [0.2, 0.5, 1.5], [0.0, 0.0, 0.0]):
        scale.copy_(torch.tensor(weights, device="cuda"))
        row_slot.copy_(torch.randint(-1, 3, (256,), device="cuda", generator=gen, dtype=torch.int32))
        graph.replay()
        expected, expected_rows = y0.clone(), y0.clone()
        ref.lora_delta(expected, x, A, B, scale, gw, ranks)
        ref.lora_delta_rows(expected_rows, x, A, B, scale, row_slot, ranks)
        torch.testing.assert_close(y, expected, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(y_rows, expected_rows, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(y_small, expected_rows[:8], rtol=2e-3, atol=2e-3)
        lin = torch.nn.functional.linear(x, W)
        ref.lora_delta(lin, x, A, B, scale, gw, ranks)
        torch.testing.assert_close(out["linear"], lin, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_compiled_model_on_the_cuda_backend_switches_without_recompiling(cops) -> None:
    import fdlora

    with fdlora.use_backend("cuda"):
        model, adapters = mlp_with_adapters({"a": 8, "b": 32, "c": 16})
        layers = fdlora.handle(model).layers
        assert all(layer.selection.name == "cuda" for layer in layers.values()), [str(l.selection) for l in
                                                                                   layers.values()]
        assert "backend=cuda [requested 'cuda'" in repr(model)
        x = torch.randn(4, 10, 64, device="cuda", dtype=torch.float16)

        def expected(active: dict[str, float]) -> torch.Tensor:
            return mlp_oracle(model, adapters, x, active)

        cases = ({"a": 1.0}, {"b": 0.5}, {"a": 0.3, "c": 0.7}, {"c": 0.0}, {"a": 1.0, "b": 1.0, "c": 1.0})
        with torch.no_grad():  # eager first
            for active in cases:
                fdlora.set_adapters(model, list(active), list(active.values()))
                torch.testing.assert_close(model(x).float(), expected(active), rtol=2e-2, atol=2e-2)
        fdlora.handle(model).freeze()
        import importlib.util

        # inductor generates Triton code on CUDA; without triton the graph still compiles whole (aot_eager)
        compiled = torch.compile(model, fullgraph=True,
                                 backend="inductor" if importlib.util.find_spec("triton") else "aot_eager")
        try:
            with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
                for active in cases:
                    fdlora.set_adapters(model, list(active), list(active.values()))
                    torch.testing.assert_close(compiled(x).float(), expected(active), rtol=2e-2, atol=2e-2)
        finally:
            torch._dynamo.reset()


@pytest.mark.gpu
def test_auto_takes_the_hybrid_once_built_and_every_mode_matches(cops, monkeypatch) -> None:
    """With the extension built and Triton present, auto picks "triton+cuda" for linear layers: the per-call GEMM ops
    are the extension's, merges and decode launches Triton's (fdlora.kernels.hybrid); cached, no-cache, per-sample
    and per-row calls all equal the float reference."""
    pytest.importorskip("triton")
    import fdlora
    from fdlora.kernels import hybrid

    hyb = registry.backends()["triton+cuda"]
    monkeypatch.setattr(hyb, "_probed", False)  # the extension was built by `cops` after an earlier probe
    assert hyb.unavailable() is None
    assert hybrid.lora_linear is registry.ops("cuda").lora_linear
    assert hybrid.lora_merge_many is registry.ops("triton").lora_merge_many
    with fdlora.use_backend("auto"):
        model, adapters = mlp_with_adapters({"a": 8, "b": 32})
        assert all(lay.selection.name == "triton+cuda" for lay in fdlora.handle(model).layers.values())

        def expected(x, per_sample: list[dict]) -> torch.Tensor:
            return torch.cat([mlp_oracle(model, adapters, x[i:i + 1], active) for i, active in enumerate(per_sample)])

        x = torch.randn(4, 80, 64, device="cuda", dtype=torch.float16)
        tol = dict(rtol=2e-2, atol=2e-2)
        with torch.no_grad():
            for cache in ("auto", 0):
                fdlora.set_merge_cache(cache)
                fdlora.set_adapters(model, ["a", "b"], [0.6, -0.4])
                torch.testing.assert_close(model(x).float(), expected(x, [{"a": 0.6, "b": -0.4}] * 4), **tol)
            fdlora.set_merge_cache("auto")
            specs = ["a", "b", None, "a"]
            with fdlora.per_sample(model, specs):
                want = expected(x, [{} if s is None else {s: 1.0} for s in specs])
                torch.testing.assert_close(model(x).float(), want, **tol)
            xr = torch.randn(4, 1, 64, device="cuda", dtype=torch.float16)  # decode rows
            with fdlora.per_row(model, specs):
                want = expected(xr, [{} if s is None else {s: 1.0} for s in specs])
                torch.testing.assert_close(model(xr).float(), want, **tol)
    monkeypatch.setattr(hyb, "_probed", False)


@pytest.mark.gpu
@pytest.mark.parametrize("banked", [True, False])  # every blend merged by one merge-kernel launch / cuBLASLt per blend
@pytest.mark.parametrize("ranks", [{"a": 8, "b": 32, "c": 4}, {"a": 4, "b": 6, "c": 2}])  # n x R: 96; 18, padded
def test_per_prompt_without_copies_is_one_bound_cuda_call(cops, monkeypatch, ranks, banked) -> None:
    """With the merged-weight cache off, an eager per-prompt call on the extension is one C++ call per layer, kept on
    the hot path: BoundSamples (every blend merged into scratch, by one launch of the merge kernel from the bank for
    weights up to SMALL_MERGE elements, else by cuBLASLt per blend with W read in place; the GEMMs as one
    strided-batched matmul over the copies for one sample per blend, else per run or per CFG position, W itself for
    samples with no adapter) where the scratch form costs less in bytes and launches, the extension's lora_linear
    otherwise (few rows). First call and repeats equal the float reference; samples never see each other's
    adapters."""
    pytest.importorskip("triton")
    import fdlora
    from fdlora.layers.fastpath import hot, percall

    monkeypatch.setenv("FDLORA_DISPATCH", "cublas")  # the cuBLAS forms on every GPU, calibrated or not
    if not banked:
        monkeypatch.setattr(percall, "SMALL_MERGE", 0)
    monkeypatch.setattr(registry.backends()["triton+cuda"], "_probed", False)
    with fdlora.use_backend("auto"):
        model, adapters = mlp_with_adapters(ranks)
        layers = list(fdlora.handle(model).layers.values())

        def check(x, per_sample: list[dict], path: str) -> None:
            want = torch.cat([mlp_oracle(model, adapters, x[i:i + 1], a) for i, a in enumerate(per_sample)])
            for _ in range(3):
                torch.testing.assert_close(model(x).float(), want, rtol=2e-2, atol=2e-2)
            assert {lay.dispatch_path().split(" [")[0] for lay in layers} == {path}
            if path == "bound per-sample scratch":
                assert {type(lay.merged.hot[hot.FN]).__name__ for lay in layers} == {"BoundSamples"}
                assert all(lay.merged.hot[hot.FN].planned for lay in layers)
                assert {lay.merged.hot[hot.FN].banked for lay in layers} == {banked}

        def spec(s):
            return {} if s is None else {s: 1.0} if isinstance(s, str) else s

        blend = {"a": 0.6, "c": -0.4}
        fdlora.set_merge_cache(0)
        try:
            with torch.no_grad():
                for specs in (["c", "a", "b"],  # one sample per blend: one batched GEMM over the copies
                              ["b", None],  # one sample on its copy, one on W: two GEMMs
                              ["a", "b", "a", "b"],  # CFG: one strided GEMM per position
                              ["a", None, "b", "b"],  # runs, W itself for the sample with no adapter
                              [blend, "b", None, blend]):
                    x = torch.randn(len(specs), 80, 64, device="cuda", dtype=torch.float16)
                    with fdlora.per_sample(model, specs):
                        check(x, [spec(s) for s in specs], "bound per-sample scratch")
                        x_mid = torch.randn(len(specs), 20, 64, device="cuda", dtype=torch.float16)  # the delta
                        # moves fewer bytes, but in five launches (percall.bound_scratch_wins)
                        check(x_mid, [spec(s) for s in specs], "bound per-sample scratch")
                        x_few = torch.randn(len(specs), 3, 64, device="cuda", dtype=torch.float16)
                        check(x_few, [spec(s) for s in specs], "bound per-sample delta")
        finally:
            fdlora.set_merge_cache("auto")
    monkeypatch.setattr(registry.backends()["triton+cuda"], "_probed", False)


@pytest.mark.gpu
def test_eager_layers_keep_one_bound_cuda_call_on_their_hot_path(cops, monkeypatch) -> None:
    """Under auto with the extension built, eager calls that repeat run one bound C++ call per layer from the hot
    path (fdlora.layers.fastpath.hot): decode rows (per-sample, per-row, a one-adapter blend without the cache:
    BoundRows), blends without the cache (BoundLinear), per-prompt groups on merged copies in the CFG and the runs
    layouts (BoundGroups); the first call (full decision) and the repeats (hot path) all equal the float reference,
    and a switch between them is picked up."""
    pytest.importorskip("triton")
    import fdlora
    from fdlora.layers.fastpath import hot

    monkeypatch.setattr(registry.backends()["triton+cuda"], "_probed", False)
    with fdlora.use_backend("auto"):
        model, adapters = mlp_with_adapters({"a": 8, "b": 32, "c": 4})
        layers = fdlora.handle(model).layers.values()

        def check(x, per_sample: list[dict], kind: str) -> None:
            want = torch.cat([mlp_oracle(model, adapters, x[i:i + 1], a) for i, a in enumerate(per_sample)])
            for _ in range(3):
                torch.testing.assert_close(model(x).float(), want, rtol=2e-2, atol=2e-2)
            assert {type(lay.merged.hot[hot.FN]).__name__ for lay in layers if lay.merged.hot} == {kind}
            if kind == "BoundGroups":  # each job one planned cuBLASLt matmul, the bias in its epilogue
                assert all(lay.merged.hot[hot.FN].planned for lay in layers if lay.merged.hot)

        def each(specs):
            return [{} if s is None else {s: 1.0} for s in specs]

        xr = torch.randn(4, 1, 64, device="cuda", dtype=torch.float16)
        x = torch.randn(4, 80, 64, device="cuda", dtype=torch.float16)
        try:
            with torch.no_grad():
                for specs in (["a", "b", None, "c"], ["c", "c", "a", None]):
                    for scope in (fdlora.per_sample, fdlora.per_row):
                        with scope(model, specs):
                            check(xr, each(specs), "BoundRows")
                fdlora.set_merge_cache(0)
                for w in (0.7, -0.2):  # a slider move between repeats
                    fdlora.set_adapters(model, ["b"], [w])
                    check(xr, [{"b": w}] * 4, "BoundRows")
                    check(x, [{"b": w}] * 4, "BoundLinear")
                fdlora.set_merge_cache(1 << 30)
                for specs in (["a", "b", "a", "b"], ["a", "a", "b", None]):
                    with fdlora.per_sample(model, specs):
                        check(x, each(specs), "BoundGroups")
        finally:
            fdlora.set_merge_cache("auto")
    monkeypatch.setattr(registry.backends()["triton+cuda"], "_probed", False)
