"""fdlora::lora_train_* ops: opcheck, gradcheck in float64, dtypes against a float64 oracle, torch.compile traces a
training step through them, and per-sample multi-adapter training equals training each adapter alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig

import fdlora
import fdlora.kernels.train_ops  # noqa: F401
from fdlora.fixtures import tiny_tasks as tiny
from fdlora.training import per_sample, set_active

from .helpers import rel

D = torch.float64


def _lin(M=5, K=7, N=6, r=3, dtype=D):
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g, dtype=D).to(dtype).requires_grad_(True)  # noqa: E731
    return t(M, K), t(M, K), t(M, N), torch.randn(N, K, generator=g, dtype=D).to(dtype), \
        torch.randn(N, generator=g, dtype=D).to(dtype), t(r, K), t(N, r)


# (id, uses dropout input u, base output y0 from outside, plain base weight W)
LINEAR = [("x-W", False, False, True), ("u-W", True, False, True), ("x-y0", False, True, False),
          ("u-y0", True, True, False)]


@pytest.mark.parametrize("case", LINEAR, ids=[c[0] for c in LINEAR])
def test_linear_gradcheck_and_opcheck(case):
    _, use_u, use_y0, use_W = case
    x, u, y0, W, b, A, B = _lin()
    s = torch.tensor(0.7, dtype=D)

    def f(x, u, y0, A, B):
        return torch.ops.fdlora.lora_train_linear(x, u if use_u else None, y0 if use_y0 else None,
                                                  W if use_W else None, b if use_W else None, A, B, s)[0]

    assert torch.autograd.gradcheck(f, (x, u, y0, A, B))
    torch.library.opcheck(torch.ops.fdlora.lora_train_linear.default,
                          (x, u if use_u else None, y0 if use_y0 else None, W if use_W else None, None, A, B, s))


def test_conv_gradcheck_and_opcheck():
    g = torch.Generator().manual_seed(1)
    t = lambda *s: torch.randn(*s, generator=g, dtype=D).requires_grad_(True)  # noqa: E731
    u, y0, A, B = t(1, 2, 5, 4), t(1, 3, 3, 2), t(2, 2, 3, 3), t(3, 2, 1, 1)
    s = torch.tensor(0.5, dtype=D)
    f = lambda u, y0, A, B: torch.ops.fdlora.lora_train_conv2d(u, y0, A, B, s, [2, 2], [1, 1])[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (u, y0, A, B))
    torch.library.opcheck(torch.ops.fdlora.lora_train_conv2d.default, (u, y0, A, B, s, [2, 2], [1, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_dtypes_against_float64(dtype):
    """Activations in fp16/bf16 (A/B fp32 as PEFT keeps them): within the dtype's own rounding of the oracle."""
    x, _, _, W, b, A, B = _lin(M=33, K=40, N=24, r=4)
    s = torch.tensor(0.5)
    outs = {}
    for d in (D, dtype):
        xs, As, Bs = (x.detach().to(d).requires_grad_(True), A.detach().float().requires_grad_(True),
                      B.detach().float().requires_grad_(True))
        if d == D:
            As, Bs = A.detach().clone().requires_grad_(True), B.detach().clone().requires_grad_(True)
        y, h = torch.ops.fdlora.lora_train_linear(xs, None, None, W.to(d), b.to(d), As, Bs, s.to(D if d == D else
                                                                                             torch.float32))
        assert y.dtype == d and h.dtype == (D if d == D else torch.float32)
        y.float().sum().backward() if d != D else y.sum().backward()
        outs[d] = (y.detach(), xs.grad, As.grad, Bs.grad)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    for a, ref in zip(outs[dtype], outs[D]):
        assert not torch.isnan(a).any() and rel(a, ref) < tol
    assert outs[dtype][2].dtype == torch.float32  # grads land in the parameters' dtype


def test_compile_traces_a_training_step():
    """torch.compile (aot_eager: the same tracing as inductor, no C++ build) traces the loss with fullgraph=True
    (no graph break) and its backward through the ops' autograd formula, giving eager's gradients."""
    import torch._dynamo

    model = tiny.build("tiny-llama")
    fdlora.add_trainable_adapter(model, "a", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    batch = tiny.synthetic_batch("causal-lm", model, 2, 0)
    with torch.no_grad():
        for _, B in fdlora.lora_parameters(model, "a").values():
            B.normal_()

    def step():
        loss = model(**batch).loss
        loss.backward()
        return loss

    step()
    want = [p.grad.clone() for p in fdlora.trainable_parameters(model)]
    model.zero_grad()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda: model(**batch).loss)()
    assert explained.graph_break_count == 0, explained.break_reasons
    # AOTAutograd traces the joint forward + backward graph: the backward op is in it
    compiled = torch.compile(lambda: model(**batch).loss, backend="aot_eager", fullgraph=True)
    compiled().backward()
    got = [p.grad for p in fdlora.trainable_parameters(model)]
    assert all(rel(g, w) < 1e-5 for g, w in zip(got, want))


def _per_sample_loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none") \
        .view(ids.shape[0], -1).mean(1)


def test_per_sample_multi_adapter_equals_each_alone():
    base = tiny.build("tiny-llama")
    cfgs = {"a": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
            "b": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"],
                            use_rslora=True)}
    model = copy.deepcopy(base)
    for n, c in cfgs.items():
        fdlora.add_trainable_adapter(model, n, c)
    torch.manual_seed(3)
    with torch.no_grad():
        for n in cfgs:
            for _, B in fdlora.lora_parameters(model, n).values():
                B.normal_(0, 0.1)
    assert len(fdlora.trainable_parameters(model)) == 2 * 14 + 2 * 8
    ids = tiny.synthetic_batch("causal-lm", model, 5, 0)["input_ids"]
    route = ["a", "b", None, "b", "a"]
    with per_sample(model, route):
        losses = _per_sample_loss(model, ids)
    losses.sum().backward()
    for name in cfgs:
        alone = copy.deepcopy(model)
        alone.zero_grad()
        set_active(alone, [name])
        rows = [i for i, r in enumerate(route) if r == name]
        lone = _per_sample_loss(alone, ids[rows])
        assert torch.allclose(lone, losses[rows].detach(), rtol=1e-6, atol=0)
        lone.sum().backward()
        for path, (A, B) in fdlora.lora_parameters(model, name).items():
            A1, B1 = fdlora.lora_parameters(alone, name)[path]
            assert rel(A.grad, A1.grad) < 1e-5 and rel(B.grad, B1.grad) < 1e-5, (name, path)
    set_active(model, [])
    with torch.no_grad():  # the routed-to-None sample is the base model's
        assert torch.allclose(losses[2], _per_sample_loss(model, ids[2:3])[0], rtol=1e-6)
