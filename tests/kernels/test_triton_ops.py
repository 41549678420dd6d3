"""Triton LoRA ops against a float64 oracle, on CPU (interpreter) and on CUDA.

CPU cases run only in a process started with TRITON_INTERPRET=1 (test_triton_interpret.py starts
one); elsewhere they skip. CUDA cases are marked `gpu` and skip without a device.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from triton_cases import (
    CASES,
    DEVICES,
    DTYPES,
    REALISTIC,
    Case,
    eager_peft,
    make_inputs,
    mlp_oracle,
    mlp_with_adapters,
    skip_unless,
    tolerance,
    with_dtype,
)

from fdlora.kernels import ops as ref
from fdlora.kernels import registry
from fdlora.testing import poisoned_empty

pytestmark = pytest.mark.triton  # the Triton backend, as auto picks it (even under FDLORA_BACKEND=cuda)

GPU_ONLY = [
    *[with_dtype(c, "bf16") for c in CASES if c.dtype == "fp16"],
    *REALISTIC,
]


@pytest.fixture
def tops(request, monkeypatch):
    """The Triton op namespace, with one config per kernel (tests check numbers, not speed; fewer compiles)."""
    params = getattr(request.node, "callspec", None)
    skip_unless(params.params.get("device", "cuda") if params else "cuda")
    from fdlora.kernels.triton import config

    monkeypatch.setattr(config, "AUTOTUNE", False)
    return registry.ops("triton")


@contextlib.contextmanager
def _forced_split(enabled: bool | None):
    """Run lora_delta on the split path (shrink + expand-add) or the fused kernel, whatever the shape
    (None: the path dispatch.py picks)."""
    from fdlora.kernels.triton.forward import lora_delta as mod

    if enabled is None:
        yield
        return
    original = mod.delta_plan
    mod.delta_plan = lambda *a: "split" if enabled else "fused"
    try:
        yield
    finally:
        mod.delta_plan = original


def _run(tops, case: Case, d: dict) -> None:
    if case.mode == "rows":
        tops.lora_delta_rows(d["y"], d["x"], d["A"], d["B"], d["scale"], d["row_slot"], d["ranks"])
    else:
        with _forced_split(case.split):
            tops.lora_delta(d["y"], d["x"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"])


def _check(case: Case, d: dict, y_before: torch.Tensor) -> None:
    out = d["y"].cpu()
    assert not out.isnan().any(), "NaN in the output: a kernel read a poisoned (skipped) element"
    eager = eager_peft(d["clean"], case)
    tol = tolerance(case, eager, d["oracle"])
    err = (out.double() - d["oracle"]).abs().max().item()
    assert err <= tol, f"{case.id}: max error {err:.3e} > {tol:.3e} (eager's own error x2 + ulps)"
    untouched = d["untouched"]
    assert torch.equal(out[untouched], y_before[untouched]), "rows without an adapter changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_delta_matches_oracle(tops, case: Case, device: str) -> None:
    skip_unless(device)
    d = make_inputs(case, device)
    y_before = d["y"].cpu().clone()
    _run(tops, case, d)
    _check(case, d, y_before)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_ONLY, ids=lambda c: c.id)
def test_delta_matches_oracle_gpu_only(tops, case: Case) -> None:
    skip_unless("cuda")
    d = make_inputs(case, "cuda")
    y_before = d["y"].cpu().clone()
    _run(tops, case, d)
    _check(case, d, y_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["blend", "rows"])
def test_explicit_config_launch_matches_oracle(tops, mode: str, device: str) -> None:
    """A given config (config.launch(config=...), what benchmarks/probes/sweep_delta.py times) runs and computes the
    same delta; one with a block under 16 is refused before anything runs, y untouched."""
    from fdlora.errors import FdLoraError
    from fdlora.kernels.triton import config as C
    from fdlora.kernels.triton.forward import lora_delta, lora_delta_rows

    skip_unless(device)
    case = Case(f"explicit-{mode}", mode, 37, 48, 40, 32, (32, 16), (0.5, 1.0))
    d = make_inputs(case, device)
    y_before = d["y"].cpu().clone()

    def launch(config):
        if mode == "rows":
            lora_delta_rows.launch_rows(d["y"], d["x"], d["A"], d["B"], d["scale"], d["row_slot"], d["ranks"],
                                        config=config)
        else:
            lora_delta.launch_fused(d["y"], d["x"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"],
                                    config=config)

    with pytest.raises(FdLoraError, match="BK=8"):
        launch(C.cfg(4, 1, BM=16, BN=16, BK=8, PREFETCH=False, NSPLIT=1))
    assert torch.equal(d["y"].cpu(), y_before)
    # PREFETCH 2 (first y and B tiles loaded before the shrink): one N tile per program, and two (B prefetched);
    # WRAP: the N split's two programs walk K's three tiles from different starts
    for prefetch, nsplit, extra in ((True, 2, {}), (2, 2, {}), (2, 1, {}), (2, 2, {"WRAP": True})):
        d["y"].copy_(y_before)
        launch(C.cfg(4, 2, BM=32, BN=32, BK=16, PREFETCH=prefetch, NSPLIT=nsplit, **extra))
        _check(case, d, y_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fused", "split", "rows"])
def test_eager_relaunch_skips_the_autotuner_and_keeps_the_result(tops, monkeypatch, mode: str, device: str) -> None:
    """A second eager launch of a tuned shape goes straight to the chosen config, and (on the GPU) a third one with
    the same specialization straight to the compiled kernel: same output, no autotuner or binder call."""
    skip_unless(device)
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from fdlora.kernels.triton import config

    monkeypatch.setattr(config, "_CHOSEN", {})
    monkeypatch.setattr(config, "_COMPILED", {})
    calls, jit_calls = [], []
    run, jit_run = Autotuner.run, JITFunction.run
    monkeypatch.setattr(Autotuner, "run", lambda self, *a, **k: calls.append(self) or run(self, *a, **k))
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: jit_calls.append(self) or jit_run(self, *a, **k))
    case = Case(f"relaunch-{mode}", "rows" if mode == "rows" else "blend", 20, 40, 36, 32, (16, 8),
                (1.0, 0.5), split=None if mode == "rows" else mode == "split")
    outs, tuner_calls, jitted = [], [], []
    for _ in range(3):
        d = make_inputs(case, device)
        y_before = d["y"].cpu().clone()
        _run(tops, case, d)
        _check(case, d, y_before)
        outs.append(d["y"].cpu())
        tuner_calls.append(len(calls))
        jitted.append(len(jit_calls))
    kernels = 2 if mode == "split" else 1  # split: shrink, then expand-add
    assert tuner_calls == [kernels] * 3, "only the first launch of each kernel goes through the autotuner"
    assert len(config._CHOSEN) == kernels
    if device == "cuda":
        assert len(config._COMPILED) == kernels
        assert jitted[2] == jitted[1], "the third launch goes to the compiled kernel directly"
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("device", DEVICES)
def test_prepared_rows_launch_replays_on_new_tensors(tops, monkeypatch, device: str) -> None:
    """prepare_delta_rows: the launch kept ready (GPU; None under the interpreter) replays on new y, x, scale and
    row_slot with the regular op's exact result, and refuses (launching nothing) a y of another alignment."""
    skip_unless(device)
    from fdlora.kernels.triton import config

    monkeypatch.setattr(config, "_CHOSEN", {})
    monkeypatch.setattr(config, "_COMPILED", {})
    case = Case("prepared-rows", "rows", 20, 40, 36, 32, (16, 8), (1.0, 0.5))
    d = make_inputs(case, device)
    args = (d["A"], d["B"], d["scale"], d["row_slot"], d["ranks"])
    readies = [tops.prepare_delta_rows(d["y"], d["x"], *args) for _ in range(2)]  # 1st: through the autotuner
    if device == "cpu":
        assert readies == [None, None]
        return
    ready = readies[1]
    assert ready is not None
    for seed in (1, 2):
        e = make_inputs(case, device, seed=seed)
        y_regular = e["y"].clone()
        tops.lora_delta_rows(y_regular, e["x"], d["A"], d["B"], e["scale"], e["row_slot"], d["ranks"])  # same bank
        assert ready(e["y"], e["x"], e["scale"], e["row_slot"]) is True
        assert torch.equal(e["y"], y_regular)
    odd = torch.zeros(e["y"].numel() + 1, device=device, dtype=e["y"].dtype)[1:].view_as(e["y"])
    assert ready(odd, e["x"], e["scale"], e["row_slot"]) is False
    assert not odd.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_shrink_and_expand_add_match_reference(tops, device: str, dtype: str) -> None:
    skip_unless(device)
    case = Case(f"split-{dtype}", "groups", 26, 72, 34, 32, (32, 7, 16), (1.0, 0.0, 0.5), G=2, dtype=dtype)
    d = make_inputs(case, device)
    clean = d["clean"]
    x, A, B = clean["x"].to(device), clean["A"].to(device), clean["B"].to(device)
    prev = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty -> NaN: unwritten h fails
    try:
        h = tops.lora_shrink(x, A)
    finally:
        torch.use_deterministic_algorithms(prev[0])
        torch.utils.deterministic.fill_uninitialized_memory = prev[1]
    h_ref = ref.lora_shrink(x.double(), A.double())
    assert h.dtype == torch.float32 and h.shape == h_ref.shape and not h.isnan().any()
    eps = torch.finfo(x.dtype).eps
    assert (h.double() - h_ref).abs().max().item() <= 4 * eps * h_ref.abs().max().item()

    y = clean["y"].to(device)
    y_ref = y.double().clone()
    tops.lora_expand_add(y, h_ref.float(), B, d["scale"], d["group_weight"])
    ref.lora_expand_add(y_ref, h_ref, B.double(), d["scale"].double(), d["group_weight"].double())
    err = (y.double() - y_ref).abs().max().item()
    assert err <= 2 * eps * y_ref.abs().max().item() + 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_shrink_split_partials_feed_expand_add(tops, device: str, dtype: str) -> None:
    """lora_shrink_split's K-split partial sums [P, M, S*R] add up to h, and lora_expand_add takes them as they are,
    sliced to one member's columns as fdlora.layers.modules.shared_shrink does, matching the reference on the summed h."""
    skip_unless(device)
    case = Case(f"split-partials-{dtype}", "groups", 26, 160, 34, 32, (32, 7, 16), (1.0, 0.0, 0.5), G=2, dtype=dtype)
    d = make_inputs(case, device)
    clean = d["clean"]
    x, A, B = clean["x"].to(device), clean["A"].to(device), clean["B"].to(device)
    parts = tops.lora_shrink_split(x, A)
    S, R = A.shape[:2]
    h_ref = ref.lora_shrink(x.double(), A.double())
    assert parts.dim() == 3 and parts.shape[1:] == h_ref.shape and not parts.isnan().any()
    if device == "cpu":  # the interpreter splits K whenever K > 64: the partial path is the one under test
        assert parts.shape[0] > 1
    eps = torch.finfo(x.dtype).eps
    # exact products of the inputs, summed in fp32 over K: a bound of fp32 summation's own error
    bound = 2 * torch.finfo(torch.float32).eps * x.shape[1] ** 0.5 * h_ref.abs().max().item()
    assert (parts.sum(0).double() - h_ref).abs().max().item() <= bound
    wide = torch.cat([parts, torch.full_like(parts[..., :5], float("nan"))], -1)[..., :S * R]  # a strided slice
    y = clean["y"].to(device)
    y_ref = y.double().clone()
    tops.lora_expand_add(y, wide, B, d["scale"], d["group_weight"])
    ref.lora_expand_add(y_ref, h_ref, B.double(), d["scale"].double(), d["group_weight"].double())
    assert (y.double() - y_ref).abs().max().item() <= 4 * eps * y_ref.abs().max().item() + 1e-6


# members n, rank R, slots S, rows M, K: the slot-major stack is [S, n*R, K] (n*R = 48: one rank chunk; 80: two)
BY_ROW = [
    pytest.param(3, 16, 3, 37, 80, "fp32", id="n3-r16-S3-M37-K80-fp32"),
    pytest.param(5, 16, 4, 40, 96, "bf16", id="n5-r16-S4-M40-K96-bf16"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,R,S,M,K,dtype", BY_ROW)
def test_shrink_by_row_computes_each_rows_own_slot_only(tops, device: str, n, R, S, M, K, dtype) -> None:
    """lora_shrink_split with a row_slot over a slot-major stack (fdlora.layers.modules.shared_shrink, per-row mode): each row's own
    slot's columns equal the float64 shrink, nothing else is written (torch.empty is NaN-poisoned), and each member's
    strided [P, M, S, R] view of it through lora_expand_add gives lora_delta_rows' reference."""
    skip_unless(device)
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    W, N = n * R, 24
    x = torch.randn(M, K, generator=g).to(device, dt)
    A = (torch.randn(S, W, K, generator=g) * K ** -0.5).to(device, dt)  # slot s: member 0's A_s, member 1's, ...
    B = [(torch.randn(N, S, R, generator=g) * R ** -0.5).to(device, dt) for _ in range(n)]
    row_slot = torch.randint(-1, S, (M,), generator=g, dtype=torch.int32)
    row_slot[16:32][row_slot[16:32] == S - 1] = -1  # a row block without the last slot: that program exits at once
    row_slot = row_slot.to(device)
    scale = torch.linspace(0.5, 2.0, S, device=device)
    with poisoned_empty():
        h = tops.lora_shrink_split(x, A, row_slot)  # [P, M, S*W]
    if device == "cpu":  # the interpreter splits K whenever K > 64: the partials are under test too
        assert h.shape[0] > 1
    assert h.shape[1:] == (M, S * W)
    own = (row_slot.long()[:, None] == torch.arange(S, device=device)).cpu()  # [M, S]
    got = h.sum(0).view(M, S, W).cpu().double()
    want = ref.lora_shrink(x.double(), A.double()).view(M, S, W).cpu()
    eps = torch.finfo(dt).eps
    assert (got[own] - want[own]).abs().max().item() <= 4 * eps * want.abs().max().item()
    assert got[~own].isnan().all(), "the shrink wrote columns of a slot that is not the row's own"
    y0 = torch.randn(M, N, generator=g).to(device, dt)
    gw = own.float().to(device)  # G = M: per-row weights, as ShrinkGroup passes them
    ranks = torch.full((S,), R, dtype=torch.int32, device=device)
    for i in range(n):
        y, y_ref = y0.clone(), y0.double().clone()
        tops.lora_expand_add(y, h.unflatten(-1, (S, W))[..., i * R:(i + 1) * R], B[i], scale, gw)
        ref.lora_delta_rows(y_ref, x.double(), A[:, i * R:(i + 1) * R].double(), B[i].double(), scale.double(),
                            row_slot, ranks)
        assert not y.isnan().any(), "an unwritten (NaN) h element reached y"
        assert (y.double() - y_ref).abs().max().item() <= 4 * eps * y_ref.abs().max().item() + 1e-6
        assert torch.equal(y[row_slot < 0], y0[row_slot < 0]), "rows without a slot changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("P", [1, 2], ids=["3d", "4d-partials"])
def test_expand_add_strided_slot_view_never_reads_zero_weight_h(tops, device: str, dtype: str, P: int) -> None:
    """h as [M, S, R] / [P, M, S, R] with arbitrary strides (member 1's columns of a slot-major [.., S, 3R] h), NaN
    wherever a row's weight is 0 (its other slots, rows without a slot, a slot at scale 0): y equals the float64
    reference and no NaN reaches it."""
    skip_unless(device)
    g = torch.Generator().manual_seed(1)
    dt = DTYPES[dtype]
    M, N, S, R, n = 37, 40, 3, 16, 3
    h = torch.randn(M, S, R, generator=g, dtype=torch.float64)
    row_slot = torch.randint(-1, S, (M,), generator=g)
    own = row_slot[:, None] == torch.arange(S)  # [M, S]
    big = torch.full((P, M, S, n * R), float("nan"))
    for p in range(P):  # P partial sums of h on the rows' own slots only
        big[p, :, :, R:2 * R][own] = (h / P)[own].float()
    hv = big.to(device)[..., R:2 * R]
    hv = hv if P > 1 else hv[0]
    B = (torch.randn(N, S, R, generator=g) * R ** -0.5).to(device, dt)
    scale = torch.tensor([0.5, 2.0, 0.0], device=device)
    gw = own.float().to(device)
    y = torch.randn(M, N, generator=g).to(device, dt)
    y0 = y.clone()
    hw = (h * (own * scale.cpu().double())[..., None]).reshape(M, S * R).to(device)  # zero where the weight is
    y_ref = y.double() + hw @ B.double().reshape(N, S * R).t()
    tops.lora_expand_add(y, hv, B, scale, gw)
    assert not y.isnan().any(), "an h element at weight 0 was read"
    eps = torch.finfo(dt).eps
    assert (y.double() - y_ref).abs().max().item() <= 4 * eps * y_ref.abs().max().item() + 1e-6
    idle = ((row_slot < 0) | (row_slot == 2)).to(device)  # no slot, or the slot at scale 0
    assert torch.equal(y[idle], y0[idle])


@pytest.mark.parametrize("device", DEVICES)
def test_switching_scale_in_place_needs_no_new_shapes(tops, device: str) -> None:
    """One set of buffers, several active sets and weights written in place (what CUDA graphs replay)."""
    skip_unless(device)
    case = Case("switch", "blend", 24, 40, 32, 32, (16, 32, 8), (1.0, 1.0, 1.0))
    d = make_inputs(case, device)
    x, A, B = (d["clean"][k].to(device) for k in ("x", "A", "B"))
    y0 = d["clean"]["y"].to(device)
    gw = torch.ones(1, 3, device=device)
    scale = torch.zeros(3, device=device)
    for weights in ([1.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.3, 0.3, 0.4], [0.0, 0.0, 0.0]):
        scale.copy_(torch.tensor(weights))
        y, y_ref = y0.clone(), y0.clone()
        tops.lora_delta(y, x, A, B, scale, gw, d["ranks"])
        ref.lora_delta(y_ref, x, A, B, scale, gw, d["ranks"])
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_operands_raise_with_the_fix(tops, device: str) -> None:
    skip_unless(device)
    from fdlora.errors import FdLoraError

    y = torch.zeros(4, 8, device=device)
    x = torch.zeros(4, 16, device=device, dtype=torch.float16)
    A = torch.zeros(2, 16, 16, device=device)
    B = torch.zeros(8, 2, 16, device=device)
    with pytest.raises(FdLoraError, match="cast x to A's dtype"):
        tops.lora_delta(y, x, A, B, torch.ones(2, device=device), torch.ones(1, 2, device=device),
                        torch.full((2,), 16, dtype=torch.int32, device=device))
    with pytest.raises(FdLoraError, match="G dividing M"):
        tops.lora_delta(y, x.float(), A, B, torch.ones(2, device=device), torch.ones(3, 2, device=device),
                        torch.full((2,), 16, dtype=torch.int32, device=device))
    with pytest.raises(FdLoraError, match=r"\[M, S, R\]"):  # h neither [.., M, S*R] nor [.., M, S, R]
        tops.lora_expand_add(y, torch.zeros(4, 2, 32, device=device), B, torch.ones(2, device=device),
                             torch.ones(1, 2, device=device))
    with pytest.raises(FdLoraError, match="row_slot"):
        tops.lora_shrink_split(x.float(), A, torch.zeros(3, dtype=torch.int32, device=device))


def test_ops_mirror_the_reference_signatures() -> None:
    import inspect

    try:
        from fdlora.kernels.triton import ops
    except ImportError as e:  # triton missing
        pytest.skip(f"triton not importable: {e}")
    for name in ("lora_shrink", "lora_expand_add", "lora_delta", "lora_delta_rows"):
        assert inspect.signature(getattr(ops, name)) == inspect.signature(getattr(ref, name)), name


@pytest.mark.parametrize("device", DEVICES)
def test_fused_linear_selects_triton_and_matches_torch(device: str) -> None:
    """A tiny model injected with fd-lora: auto picks triton on this device and agrees with torch."""
    skip_unless(device)
    import fdlora
    from fdlora import LoraAdapter, ModuleLora

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 24)).to(device)
    fdlora.inject(model, ["0", "2"], max_slots=3, max_rank=32)
    for name, r in (("a", 8), ("b", 32)):
        mods = {p: ModuleLora(torch.randn(r, k) * 0.1, torch.randn(n, r) * 0.1, alpha=2.0 * r)
                for p, k, n in (("0", 32, 48), ("2", 48, 24))}
        fdlora.add_adapter(model, LoraAdapter(mods, name=name).to(device=device))
    layers = fdlora.handle(model).layers
    assert all(layer.selection.name == "triton" for layer in layers.values()), [str(l.selection) for l in
                                                                                 layers.values()]
    x = torch.randn(2, 7, 32, device=device)
    fdlora.set_adapters(model, ["a", "b"], [0.6, 0.4])
    with torch.no_grad():
        out = model(x)
        with fdlora.use_backend("torch"):
            expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    with fdlora.per_row(model, ["a", None, "b", "a", None, "b", "b"] * 2), torch.no_grad():
        out = model(x)
        with fdlora.use_backend("torch"):
            expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def _clean_cuda(case: Case) -> dict:
    d = make_inputs(case, "cuda")
    c = {k: v.cuda() for k, v in d["clean"].items() if k != "w"}
    c.update({k: d[k] for k in ("scale", "ranks", "group_weight", "row_slot") if k in d})
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_opcheck_every_op(tops, split: bool) -> None:
    skip_unless("cuda")
    c = _clean_cuda(Case("opcheck", "groups", 48, 64, 40, 32, (32, 8, 16), (1.0, 0.0, 0.5), G=2, dtype="fp16"))
    r = _clean_cuda(Case("opcheck-rows", "rows", 33, 64, 40, 32, (32, 8, 16), (1.0, 0.5, 0.5), dtype="fp16"))
    h = ref.lora_shrink(c["x"], c["A"])
    with _forced_split(split):
        torch.library.opcheck(torch.ops.fdlora.lora_delta.default,
                              (c["y"], c["x"], c["A"], c["B"], c["scale"], c["group_weight"], c["ranks"]))
    if split:
        return
    torch.library.opcheck(torch.ops.fdlora.lora_delta_rows.default,
                          (r["y"], r["x"], r["A"], r["B"], r["scale"], r["row_slot"], r["ranks"]))
    torch.library.opcheck(torch.ops.fdlora.lora_shrink.default, (c["x"], c["A"]))
    torch.library.opcheck(torch.ops.fdlora.lora_expand_add.default, (c["y"], h, c["B"], c["scale"], c["group_weight"]))


@pytest.mark.gpu
def test_cuda_graph_replays_in_place_switches(tops) -> None:
    """Capture once; switch adapters and weights by writing scale / row_slot in place; replay; compare."""
    skip_unless("cuda")
    c = _clean_cuda(Case("graph", "blend", 256, 320, 192, 64, (64, 16, 8), (1.0, 1.0, 1.0), dtype="fp16"))
    x, A, B, ranks, gw = c["x"], c["A"], c["B"], c["ranks"], c["group_weight"]
    y0, y = c["y"], c["y"].clone()
    scale = torch.tensor([1.0, 0.0, 0.0], device="cuda")
    row_slot = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    y_rows = y0.clone()

    def step():
        y.copy_(y0)
        tops.lora_delta(y, x, A, B, scale, gw, ranks)
        y_rows.copy_(y0)
        tops.lora_delta_rows(y_rows, x, A, B, scale, row_slot, ranks)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
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


@pytest.mark.gpu
def test_compiled_model_switches_adapters_without_recompiling() -> None:
    """fullgraph torch.compile of an injected model; set_adapters (names and weights) never recompiles."""
    skip_unless("cuda")
    import fdlora

    model, adapters = mlp_with_adapters({"a": 8, "b": 32, "c": 16})
    layers = fdlora.handle(model).layers
    assert all(layer.selection.name == "triton" for layer in layers.values())
    fdlora.handle(model).freeze()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 10, 64, device="cuda", dtype=torch.float16)

    def expected(active: dict[str, float]) -> torch.Tensor:
        return mlp_oracle(model, adapters, x, active)

    try:
        with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
            for active in ({"a": 1.0}, {"b": 0.5}, {"a": 0.3, "c": 0.7}, {"c": 0.0}, {"a": 1.0, "b": 1.0, "c": 1.0}):
                fdlora.set_adapters(model, list(active), list(active.values()))
                out = compiled(x)
                torch.testing.assert_close(out.float(), expected(active), rtol=2e-2, atol=2e-2)
    finally:
        torch._dynamo.reset()
