"""The eager form of the trainable linear op (fdlora.kernels.train_ops.train_linear outside torch.compile): gradcheck
in float64, against the float64 oracle in fp32 and bf16 activations, leading dimensions folded inside (one graph node
per call, an output that model code may modify in place), and the same values as the registered op."""

from __future__ import annotations

import pytest
import torch

from fdlora.kernels import train_ops

from .helpers import count_nodes, peft_lora_modules, rel

D = torch.float64


def _tensors(lead, K=7, N=6, r=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=D)  # noqa: E731
    return t(*lead, K), t(*lead, K), t(*lead, N), t(N, K), t(N), t(r, K), t(N, r)


# (id, uses dropout input u, base output y0 from outside, plain base weight W, leading dims of x)
CASES = [("x-W-2d", False, False, True, (5,)), ("x-W-3d", False, False, True, (2, 3)),
         ("u-W-3d", True, False, True, (2, 3)), ("x-y0-3d", False, True, False, (3, 1)),
         ("u-y0-2d", True, True, False, (5,)), ("x-W-y0-1d", False, True, True, ()),
         ("x-lora-only-3d", False, False, False, (2, 2))]


def _args(case, x, u, y0, W, b):
    _, use_u, use_y0, use_W, _ = case
    return x, u if use_u else None, y0 if use_y0 else None, W if use_W else None, b if use_W else None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradcheck_float64(case):
    x, u, y0, W, b, A, B = (t.requires_grad_(i not in (3, 4)) for i, t in enumerate(_tensors(case[4])))
    s = torch.tensor(0.7)

    def f(x, u, y0, A, B):
        xx, uu, yy, WW, bb = _args(case, x, u, y0, W, b)
        return train_ops.train_linear(xx, uu, yy, WW, bb, A, B, s)

    assert torch.autograd.gradcheck(f, (x, u, y0, A, B))


# (id, activations' dtype, run the half-precision pair CUDA runs: forced on here, where it is otherwise off)
DTYPES = [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False), ("bf16-half-pair", torch.bfloat16, True),
          ("fp16-half-pair", torch.float16, True)]


@pytest.mark.parametrize("dt_case", DTYPES, ids=[c[0] for c in DTYPES])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_float64_and_the_registered_op(case, dt_case, monkeypatch):
    """Activations (x, u, y0, W) in `dtype`, A/B fp32 as PEFT keeps them: y, grad_x, grad_u, grad_y0, grad_A and
    grad_B within the dtype's own rounding of the float64 oracle, in the inputs' dtypes; the registered op (on the
    folded 2-D form) gives the same."""
    _, dtype, half_pair = dt_case
    if half_pair:
        monkeypatch.setattr(train_ops, "_half_pair", lambda u: u.dtype in (torch.float16, torch.bfloat16))
    lead = case[4]
    ts = _tensors(lead, K=24, N=20, r=4, seed=len(lead))
    gy0 = torch.randn(*lead, 20, generator=torch.Generator().manual_seed(9), dtype=D)

    def run(fn, act, par):
        x, u, y0, W, b, A, B = ts
        x, u, y0 = (t.detach().to(act).requires_grad_(True) for t in (x, u, y0))
        A, B = (t.detach().to(par).requires_grad_(True) for t in (A, B))
        y = fn(*_args(case, x, u, y0, W.to(act), b.to(act)), A, B, torch.tensor(0.5, dtype=par))
        y.backward(gy0.to(y.dtype))
        _, use_u, use_y0, use_W, _ = case
        used = [t for t, on in zip((x, u, y0), (use_W or not use_u, use_u, use_y0)) if on]  # what y depends on
        return [y.detach()] + [t.grad for t in used + [A, B]]

    def op(x, u, y0, W, b, A, B, s):
        K, N = x.shape[-1], B.shape[0]
        fold = lambda t, n: None if t is None else t.reshape(-1, n)  # noqa: E731
        y, _ = torch.ops.fdlora.lora_train_linear(fold(x, K), fold(u, K), fold(y0, N), W, b, A, B, s)
        return y.view(*x.shape[:-1], N)

    want = run(train_ops.train_linear, D, D)
    got = run(train_ops.train_linear, dtype, torch.float32)
    via_op = run(op, dtype, torch.float32)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    for i, (a, o, w) in enumerate(zip(got, via_op, want)):
        assert not torch.isnan(a).any() and a.shape == w.shape, i
        assert rel(a, w) < tol, (i, rel(a, w))
        assert a.dtype == o.dtype and rel(a, o) < tol, (i, rel(a, o))
    assert got[0].dtype == dtype and got[-1].dtype == got[-2].dtype == torch.float32


def test_leading_dims_fold_inside_one_node():
    """x [B, T, K] goes in whole: the output's node leads straight to x's (no reshape nodes to run in the backward),
    and the output is no view, so model code may modify it in place (autograd forbids that on a view made inside a
    Function)."""
    x, _, _, W, b, A, B = (t.float() for t in _tensors((2, 3)))
    x, A, B = (t.requires_grad_(True) for t in (x, A, B))
    s = torch.tensor(0.5)
    y = train_ops.train_linear(x, None, None, W, b, A, B, s)
    assert y.shape == (2, 3, 6) and not y._is_view()
    assert y.grad_fn.next_functions[0][0].variable is x
    y.mul_(3).sum().backward()
    want_x = 3 * (torch.ones(2, 3, 6) @ (W + s * B @ A))
    assert torch.allclose(x.grad, want_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt_case", DTYPES, ids=[c[0] for c in DTYPES])
@pytest.mark.parametrize("use_u", [False, True], ids=["x", "u"])
def test_input_without_grad(dt_case, use_u, monkeypatch):
    """An input that requires no grad (a cross-attention's text states): no grad_x is computed, and A / B get the
    gradients they get when it does."""
    _, dtype, half_pair = dt_case
    if half_pair:
        monkeypatch.setattr(train_ops, "_half_pair", lambda u: u.dtype in (torch.float16, torch.bfloat16))
    x, u, _, W, b, A, B = _tensors((2, 5), K=16, N=12, r=4, seed=3)
    gy = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(4)).to(dtype)
    grads = []
    for x_grad in (True, False):
        xs, us = x.to(dtype).requires_grad_(x_grad), u.to(dtype).requires_grad_(x_grad) if use_u else None
        As, Bs = A.float().requires_grad_(True), B.float().requires_grad_(True)
        train_ops.train_linear(xs, us, None, W.to(dtype), b.to(dtype), As, Bs, torch.tensor(0.5)).backward(gy)
        assert (xs.grad is not None) == x_grad
        grads.append((As.grad, Bs.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


class _Base(torch.nn.Module):
    """A frozen base with a known input gradient gy W (a stand-in for a 4-bit bitsandbytes layer)."""

    def __init__(self, W, b):
        super().__init__()
        self.W, self.b, self.calls = W, b, 0

    def forward(self, x):
        self.calls += 1
        return torch.nn.functional.linear(x, self.W.to(x.dtype), self.b.to(x.dtype))


class _Run:
    """How train_linear_over runs _Base inside the op (fdlora.layers.trainable.frozen_4bit's protocol); `rebuilt` records the
    dtypes W is rebuilt in."""

    def __init__(self, base):
        self.base, self.rebuilt = base, []

    def forward(self, x):
        return self.base(x), self.base.W

    def weight(self, W, dtype):
        self.rebuilt.append(dtype)
        return W.to(dtype)


# (id, LoRA input u = dropout(x) rather than x, leading dims)
OVER_CASES = [("x-3d", False, (2, 3)), ("u-2d", True, (5,)), ("x-1d", False, ())]


@pytest.mark.parametrize("dt_case", DTYPES, ids=[c[0] for c in DTYPES])
@pytest.mark.parametrize("case", OVER_CASES, ids=[c[0] for c in OVER_CASES])
def test_base_run_inside_equals_base_outside(case, dt_case, monkeypatch):
    """train_linear_over (a frozen base run inside the Function, its grad_x rebuilt as gy W): the same y and
    gradients as the base run outside through its own autograd (train_linear with y0 = base(x)), the base called
    once, and one graph node (none of the base's)."""
    _, use_u, lead = case
    _, dtype, half_pair = dt_case
    if half_pair:
        monkeypatch.setattr(train_ops, "_half_pair", lambda u: u.dtype in (torch.float16, torch.bfloat16))
    x0, u0, _, W, b, A0, B0 = _tensors(lead, K=24, N=20, r=4, seed=5)
    gy = torch.randn(*lead, 20, generator=torch.Generator().manual_seed(6), dtype=D).to(dtype)
    s = torch.tensor(0.5)
    base = _Base(W.float(), b.float())
    out = []
    for inside in (True, False):
        x, u = x0.to(dtype).requires_grad_(True), u0.to(dtype).requires_grad_(True) if use_u else None
        A, B = A0.float().requires_grad_(True), B0.float().requires_grad_(True)
        calls = base.calls
        if inside:
            y = train_ops.train_linear_over(base, _Run(base), x, u, A, B, s)
            assert y.grad_fn.next_functions[0][0].variable is x and not y._is_view()
        else:
            y = train_ops.train_linear(x, u, base(x), None, None, A, B, s)
        assert base.calls == calls + 1
        y.backward(gy)
        out.append([y.detach(), x.grad, A.grad, B.grad] + ([u.grad] if use_u else []))
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for i, (a, w) in enumerate(zip(*out)):
        assert a.dtype == w.dtype and not torch.isnan(a).any(), i
        assert rel(a, w) < tol, (i, rel(a, w))


def test_base_run_inside_x_without_grad():
    """No input gradient is asked for: the base's weight is never rebuilt."""
    x, _, _, W, b, A, B = (t.float() for t in _tensors((3,)))
    A, B = A.requires_grad_(True), B.requires_grad_(True)
    base = _Base(W, b)
    run = _Run(base)
    y = train_ops.train_linear_over(base, run, x, None, A, B, torch.tensor(0.5))
    y.sum().backward()
    assert not run.rebuilt and A.grad is not None and x.grad is None


class _QKV(torch.nn.Module):
    def __init__(self, K=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(K)
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(K, K) for _ in range(3))

    def forward(self, x, bump=False):
        n = self.norm(x)
        q = self.q_proj(n)
        if bump:
            n.add_(1.0)  # changed in place: the next layer must cast it anew
        return q + self.k_proj(n) * self.v_proj(n)


@pytest.mark.parametrize("bump", [False, True], ids=["shared", "changed-in-place"])
def test_autocast_casts_a_shared_input_once(bump):
    """Under autocast, layers that read one fp32 tensor in turn (q, k, v of a norm output) share one cast of it (one
    cast node in the graph) unless it changed in between; gradients as PEFT's, which casts it per layer."""
    import copy

    from peft import LoraConfig, get_peft_model

    import fdlora

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])
    base = _QKV().requires_grad_(False)
    pm, fm = get_peft_model(copy.deepcopy(base), copy.deepcopy(cfg)), fdlora.add_trainable_adapter(base, "a", cfg)
    theirs = peft_lora_modules(pm)
    with torch.no_grad():
        for path, (A, B) in fdlora.lora_parameters(fm, "a").items():
            B.normal_(0, 0.1)
            theirs[path].lora_A["default"].weight.copy_(A)
            theirs[path].lora_B["default"].weight.copy_(B)
    x = torch.randn(2, 5, 16)
    for m in (pm, fm):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x.clone().requires_grad_(True), bump=bump)
        if m is fm:
            assert count_nodes(y, "ToCopyBackward") == (2 if bump else 1)
        y.float().sum().backward()
    for path, (A, B) in fdlora.lora_parameters(fm, "a").items():
        assert rel(A.grad, theirs[path].lora_A["default"].weight.grad) < 3e-2, path
        assert rel(B.grad, theirs[path].lora_B["default"].weight.grad) < 3e-2, path
