"""The CPU oracle tests' GPU half: trainable layers on CUDA (Triton backward) against PEFT on CUDA, fp32 and bf16
autocast, on top of a loaded inference adapter (its Triton forward kernels), QLoRA nf4, and an inductor-compiled
step. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import fdlora
from fdlora.fixtures import tiny_tasks as tiny

from .helpers import pair, peft_lora_modules, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CFG = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


def _grads(pm, fm, batch, task, autocast=None, name="default"):
    for m in (pm, fm):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            tiny.loss_of(task, m, batch).backward()
    theirs = peft_lora_modules(pm, name)
    return max(max(rel(A.grad, theirs[p].lora_A[name].weight.grad), rel(B.grad, theirs[p].lora_B[name].weight.grad))
               for p, (A, B) in fdlora.lora_parameters(fm, name).items())


@pytest.mark.parametrize("dtype,tol", [(None, 1e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16-autocast"])
def test_llama_grads_equal_peft_on_cuda(dtype, tol):
    pm, fm = pair("tiny-llama", LoraConfig(**CFG))
    pm, fm = pm.cuda(), fm.cuda()
    batch = {k: v.cuda() for k, v in tiny.synthetic_batch("causal-lm", fm, 4, 0).items()}
    assert _grads(pm, fm, batch, "causal-lm", dtype) < tol


def test_on_top_of_loaded_adapter_on_cuda(tmp_path):
    base = tiny.build("tiny-llama")
    frozen = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for m in peft_lora_modules(frozen).values():
            m.lora_B["default"].weight.normal_(0, 0.2)
    frozen.save_pretrained(tmp_path / "f")
    cfg = LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "k_proj"])
    pm = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "f", adapter_name="frozen")
    pm.add_adapter("fresh", cfg)
    pm.base_model.set_adapter(["frozen", "fresh"])
    for n, p in pm.named_parameters():
        p.requires_grad_(".fresh." in n)
    fm = fdlora.load_fd_lora(copy.deepcopy(base).cuda(), str(tmp_path / "f"), adapter_name="frozen")
    fdlora.add_trainable_adapter(fm, "fresh", cfg)
    pm = pm.cuda()
    theirs = peft_lora_modules(pm, "fresh")
    with torch.no_grad():
        for path, (A, B) in fdlora.lora_parameters(fm, "fresh").items():
            theirs[path].lora_B["fresh"].weight.normal_(0, 0.1)
            A.copy_(theirs[path].lora_A["fresh"].weight)
            B.copy_(theirs[path].lora_B["fresh"].weight)
    batch = {k: v.cuda() for k, v in tiny.synthetic_batch("causal-lm", fm, 3, 0).items()}
    assert _grads(pm, fm, batch, "causal-lm", name="fresh") < 1e-4  # v_proj: grad_x through the inference kernels


@pytest.mark.parametrize("compute,autocast,tol", [("float32", None, 1e-4), ("bfloat16", torch.bfloat16, 5e-2)],
                         ids=["fp32", "bf16-autocast"])
def test_qlora_nf4_on_cuda(compute, autocast, tol):
    """bf16-autocast: the 4-bit base runs inside the op's half-precision pair (its grad_x from the dequantized weight),
    q and v share one cast of their input."""
    pytest.importorskip("bitsandbytes")
    from fdlora.training.quant import QuantSpec, quantize_manual

    def q():
        m = tiny.build("tiny-vit")
        quantize_manual(m, QuantSpec("nf4", compute, True, ["classifier"]), "cuda")
        return m.cuda()

    lc = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1", "fc2"])
    pm = get_peft_model(q(), LoraConfig(**lc))
    fm = fdlora.add_trainable_adapter(q(), "default", LoraConfig(**lc))
    theirs = peft_lora_modules(pm)
    with torch.no_grad():
        for path, (A, B) in fdlora.lora_parameters(fm, "default").items():
            theirs[path].lora_B["default"].weight.normal_(0, 0.1)
            A.copy_(theirs[path].lora_A["default"].weight)
            B.copy_(theirs[path].lora_B["default"].weight)
    batch = {k: v.cuda() for k, v in tiny.synthetic_batch("image-classification", fm, 4, 0).items()}
    assert _grads(pm, fm, batch, "image-classification", autocast) < tol


def test_inductor_compiled_step_matches_eager():
    pytest.importorskip("triton")  # inductor generates Triton for CUDA
    _, fm = pair("tiny-llama", LoraConfig(**CFG))
    fm = fm.cuda()
    batch = {k: v.cuda() for k, v in tiny.synthetic_batch("causal-lm", fm, 4, 0).items()}
    fm(**batch).loss.backward()
    want = [p.grad.clone() for p in fdlora.trainable_parameters(fm)]
    fm.zero_grad()
    torch.compile(lambda: fm(**batch).loss, fullgraph=True)().backward()
    assert all(rel(p.grad, w) < 1e-4 for p, w in zip(fdlora.trainable_parameters(fm), want))


@pytest.mark.parametrize("with_W", [True, False], ids=["plain-base", "outside-base"])
def test_eager_function_matches_the_registered_op(with_W):
    """Eager steps run fdlora.kernels.train_ops' autograd Function (half precision: h, A and s B kept cast), compiled
    ones the registered op: same outputs and gradients on CUDA bf16, up to the op's fp32 weight-gradient output."""
    from fdlora.kernels import train_ops

    g = torch.Generator("cuda").manual_seed(0)
    M, K, N, r = 300, 256, 384, 16
    x0 = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    W = (torch.randn(N, K, device="cuda", generator=g) / 16).bfloat16() if with_W else None
    y0 = None if with_W else torch.randn(M, N, device="cuda", generator=g).bfloat16()
    A0, B0 = torch.randn(r, K, device="cuda", generator=g) / 16, torch.randn(N, r, device="cuda", generator=g)
    gy, scale = torch.randn(M, N, device="cuda", generator=g).bfloat16(), torch.tensor(0.5, device="cuda")
    out = []
    for fn in (train_ops.train_linear, lambda *a: torch.ops.fdlora.lora_train_linear(*a)[0]):
        x, A, B = x0.clone().requires_grad_(), A0.clone().requires_grad_(), B0.clone().requires_grad_()
        y = fn(x, None, y0, W, None, A, B, scale)
        y.backward(gy)
        out.append((y, x.grad, A.grad, B.grad))
    for name, a, b in zip(("y", "grad_x", "grad_A", "grad_B"), *out):
        assert a.dtype == b.dtype, name
        assert rel(a, b) < 2e-2, (name, rel(a, b))
