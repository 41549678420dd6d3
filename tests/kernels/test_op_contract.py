"""The op contract: every backend implements every op of fdlora.kernels.ops with the contract's parameters, or says
why not; the references run in float64 and agree with an independent float64 computation."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from fdlora.kernels import ops, registry

BACKEND_MODULES = {b.name: b.module for b in registry.backends().values()}


def _module_file(module: str) -> Path:
    return Path(importlib.util.find_spec(module).origin)


def _defined(module: str) -> tuple[dict[str, tuple[str, ...] | None], dict[str, str]]:
    """{name: parameters (None for a name bound by assignment or import)} and NOT_IMPLEMENTED of a backend module,
    read from its source (importing the CUDA backend would build the extension)."""
    tree = ast.parse(_module_file(module).read_text())
    names: dict[str, tuple[str, ...] | None] = {}
    missing: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = tuple(a.arg for a in node.args.args + node.args.kwonlyargs)
        elif isinstance(node, ast.ImportFrom):
            names.update({a.asname or a.name: None for a in node.names})
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = None
                    if t.id == "NOT_IMPLEMENTED":
                        missing = ast.literal_eval(node.value)
    return names, missing


def test_the_contract_lists_the_ops():
    assert sorted(ops.OPS) == ["lora_conv_delta", "lora_delta", "lora_delta_rows", "lora_expand_add", "lora_linear",
                               "lora_merge", "lora_shrink"]
    for name, spec in ops.OPS.items():
        assert spec.qualname == f"fdlora::{name}"
        assert getattr(ops, name) is spec.reference


@pytest.mark.parametrize("backend", sorted(BACKEND_MODULES))
def test_every_backend_implements_each_op_or_says_why_not(backend: str):
    module = BACKEND_MODULES[backend]
    if module == "fdlora.kernels.ops":
        return  # the references themselves
    names, missing = _defined(module)
    for name, spec in ops.OPS.items():
        if name in missing:
            assert missing[name].strip(), f"{backend} leaves {name} out without a reason"
            assert name not in names or names[name] is None, f"{backend} both defines and leaves out {name}"
            continue
        assert name in names, f"backend {backend} ({module}) neither implements {name} nor says why not"
        if names[name] is not None:
            assert names[name][:len(spec.params)] == spec.params[:len(names[name])], (backend, name, names[name])
    assert set(missing) <= set(ops.OPS), f"{backend} leaves out ops the contract does not have: {missing}"


@pytest.mark.triton
def test_triton_ops_take_the_contracts_parameters():
    pytest.importorskip("triton")
    import inspect

    from fdlora.kernels.triton import ops as tops

    for name, spec in ops.OPS.items():
        if name in tops.NOT_IMPLEMENTED:
            continue
        assert tuple(inspect.signature(getattr(tops, name)).parameters) == spec.params, name
        if name != "lora_merge":  # merges run eagerly or inside another op: no registration of their own
            assert hasattr(torch.ops.fdlora, name), name


def _case(dtype=torch.float64, M=6, K=10, N=7, S=3, R=4, G=2):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(x=r(M, K), A=r(S, R, K), B=r(N, S, R), W=r(N, K), scale=torch.rand(S, generator=g, dtype=dtype),
                gw=torch.rand(G, S, generator=g, dtype=dtype), row_slot=torch.tensor([0, 2, -1, 1, 2, 0]))


def test_references_compute_in_float64():
    c = _case()
    x, A, B, W, scale, gw = c["x"], c["A"], c["B"], c["W"], c["scale"], c["gw"]
    S, R, K = A.shape
    M, N = x.shape[0], B.shape[0]
    want = x @ W.t()
    w = (gw * scale).repeat_interleave(M // gw.shape[0], dim=0)
    for s in range(S):
        want = want + w[:, s:s + 1] * ((x @ A[s].t()) @ B[:, s, :].t())
    got = ops.lora_linear(x, W, None, A, B, scale, gw, torch.full((S,), R, dtype=torch.int32))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    y = torch.zeros(M, N, dtype=torch.float64)
    ops.lora_delta_rows(y, x, A, B, scale, c["row_slot"], torch.full((S,), R, dtype=torch.int32))
    for m, s in enumerate(c["row_slot"].tolist()):
        row = torch.zeros(N, dtype=torch.float64) if s < 0 else scale[s] * (x[m] @ A[s].t()) @ B[:, s, :].t()
        torch.testing.assert_close(y[m], row, rtol=1e-12, atol=1e-12)

    out = torch.empty_like(W)
    ops.lora_merge(out, W, A, B, scale, torch.full((S,), R, dtype=torch.int32))
    merged = W + sum(scale[s] * B[:, s, :] @ A[s] for s in range(S))
    torch.testing.assert_close(out, merged, rtol=1e-12, atol=1e-12)


def test_fakes_give_the_references_shapes_and_dtypes():
    c = _case(torch.float16)
    S, R = c["A"].shape[:2]
    ranks = torch.full((S,), R, dtype=torch.int32)
    for name, args in {"lora_shrink": (c["x"], c["A"]),
                       "lora_linear": (c["x"], c["W"], None, c["A"], c["B"], c["scale"].float(), c["gw"].float(),
                                       ranks)}.items():
        spec = ops.OPS[name]
        real, fake = spec.reference(*args), spec.fake(*args)
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype), name
