"""Trainable fd-lora adapters against PEFT on the same initial weights and batches (fp32, CPU).

Per module, the gradients of `fdlora.lora_parameters(model, name)[path]` equal PEFT's lora_A / lora_B gradients
within 1e-5 relative; 50 AdamW steps give PEFT's loss curve within 1e-4 relative; frozen parameters stay
bit-identical; `trainable_parameters` is exactly the adapter's A / B and its modules_to_save copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig

import fdlora
from fdlora.fixtures import tiny_tasks as tiny

from .helpers import pair, peft_lora_modules, rel

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "proj_in", "proj_out", "conv_shortcut"]
# (id, tiny model, LoraConfig kwargs)
CASES = [
    ("llama-all-linear-rslora-patterns-dropout", "tiny-llama",
     dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1, use_rslora=True,
          rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3})),
    ("vit-qkv-mlp-gaussian-exclude-saved-head", "tiny-vit",
     dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj", "o_proj", "fc1", "fc2"],
          exclude_modules=["layers.1.attention.o_proj"],
          init_lora_weights="gaussian", modules_to_save=["classifier"])),
    ("sd15-unet-attn-and-conv-locon", "tiny-sd15",
     dict(r=4, lora_alpha=4, target_modules=UNET_TARGETS, lora_dropout=0.2)),
]


def _task(name):
    return tiny.TASKS[name]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_equal_peft(case):
    _, name, kw = case
    pm, fm = pair(name, LoraConfig(**kw))
    task = _task(name)
    batch = tiny.synthetic_batch(task, fm, 3, step=0)
    losses = []
    for model in (pm, fm):
        model.train()
        torch.manual_seed(123)  # the same dropout masks: fd-lora draws them in PEFT's order
        loss = tiny.loss_of(task, model, batch)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    theirs = peft_lora_modules(pm)
    ours = fdlora.lora_parameters(fm, "default")
    kinds = {type(m.base).__name__ for m in fm.modules() if hasattr(m, "lora_A") and hasattr(m, "base")}
    if name == "tiny-sd15":
        assert "Conv2d" in kinds and "Linear" in kinds  # LoCon: convs train too
    for path, (A, B) in ours.items():
        assert A.grad is not None and B.grad is not None, path
        assert rel(A.grad, theirs[path].lora_A["default"].weight.grad) < 1e-5, path
        assert rel(B.grad, theirs[path].lora_B["default"].weight.grad) < 1e-5, path
        assert A.shape == theirs[path].lora_A["default"].weight.shape
        assert B.shape == theirs[path].lora_B["default"].weight.shape


def _frozen(model):
    keep = {id(p) for p in fdlora.trainable_parameters(model)}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in keep}


@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_50_adamw_steps_follow_peft_loss_curve(case):
    _, name, kw = case
    pm, fm = pair(name, LoraConfig(**kw), randomize_B=False)
    task = _task(name)
    expected = {id(p) for A, B in fdlora.lora_parameters(fm, "default").values() for p in (A, B)}
    expected |= {id(p) for m in fdlora.training.saved_modules(fm, "default").values() for p in m.parameters()}
    got = fdlora.trainable_parameters(fm)
    assert {id(p) for p in got} == expected and len(got) == len(expected)
    assert len(got) == sum(p.requires_grad for p in pm.parameters())
    before = _frozen(fm)
    curves = []
    for model in (pm, fm):
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        curve = []
        for step in range(50):
            torch.manual_seed(step)
            loss = tiny.loss_of(task, model, tiny.synthetic_batch(task, model, 4, step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(torch.tensor(curve, dtype=torch.float64))
    worst = ((curves[1] - curves[0]).abs() / curves[0].abs()).max().item()
    assert worst < 1e-4, f"loss curves differ by {worst:.2e} relative"
    assert curves[1][-5:].mean() < curves[1][:5].mean()  # it learns
    after = _frozen(fm)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_trained_on_top_of_a_loaded_adapter_equals_peft_two_adapters(tmp_path):
    """An inference adapter loaded with fd-lora stays active as a fixed blend under the new trainable one."""
    from peft import get_peft_model

    base = tiny.build("tiny-llama")
    cfg_f = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    frozen = get_peft_model(copy.deepcopy(base), cfg_f)
    with torch.no_grad():
        for m in peft_lora_modules(frozen).values():
            m.lora_B["default"].weight.normal_(0, 0.2)
    frozen.save_pretrained(tmp_path / "frozen")

    cfg_t = LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "k_proj", "down_proj"])
    from peft import PeftModel

    pm = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "frozen", adapter_name="frozen")
    pm.add_adapter("fresh", cfg_t)
    pm.base_model.set_adapter(["frozen", "fresh"])
    for n, p in pm.named_parameters():
        p.requires_grad_(".fresh." in n)
    fm = fdlora.load_fd_lora(copy.deepcopy(base), str(tmp_path / "frozen"), adapter_name="frozen")
    fdlora.add_trainable_adapter(fm, "fresh", cfg_t)
    ours, theirs = fdlora.lora_parameters(fm, "fresh"), peft_lora_modules(pm, "fresh")
    with torch.no_grad():
        for path, (A, B) in ours.items():
            theirs[path].lora_B["fresh"].weight.normal_(0, 0.1)
            A.copy_(theirs[path].lora_A["fresh"].weight)
            B.copy_(theirs[path].lora_B["fresh"].weight)
    batch = tiny.synthetic_batch("causal-lm", fm, 3, 0)
    outs = [tiny.loss_of("causal-lm", m, batch) for m in (pm, fm)]
    assert outs[0].item() == pytest.approx(outs[1].item(), rel=1e-6)
    for o in outs:
        o.backward()
    for path, (A, B) in ours.items():
        assert rel(A.grad, theirs[path].lora_A["fresh"].weight.grad) < 1e-5, path
        assert rel(B.grad, theirs[path].lora_B["fresh"].weight.grad) < 1e-5, path
    assert {id(p) for p in fdlora.trainable_parameters(fm)} == {id(p) for ab in ours.values() for p in ab}


def test_trainable_from_live_peft_model_keeps_values_and_trains_like_peft():
    from peft import get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"], modules_to_save=["classifier"])
    base = tiny.build("tiny-vit")
    pm = get_peft_model(copy.deepcopy(base), copy.deepcopy(cfg))
    with torch.no_grad():
        for m in peft_lora_modules(pm).values():
            m.lora_B["default"].weight.normal_(0, 0.1)
        pm.base_model.model.classifier.modules_to_save["default"].weight.add_(0.5)
    ref = copy.deepcopy(pm)
    fm = fdlora.from_peft(pm, trainable=True)  # fdlora.training.trainable_from_peft
    batch = tiny.synthetic_batch("image-classification", fm, 3, 0)
    losses = [tiny.loss_of("image-classification", m, batch) for m in (ref, fm)]
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-6)
    for loss in losses:
        loss.backward()
    theirs = peft_lora_modules(ref)
    for path, (A, B) in fdlora.lora_parameters(fm, "default").items():
        assert rel(A.grad, theirs[path].lora_A["default"].weight.grad) < 1e-5
        assert rel(B.grad, theirs[path].lora_B["default"].weight.grad) < 1e-5
    head = fdlora.training.saved_modules(fm, "default")["classifier"]
    assert rel(head.weight.grad, ref.base_model.model.classifier.modules_to_save["default"].weight.grad) < 1e-5



@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-sd15"])
def test_bf16_autocast_computes_in_bf16_like_peft(model_name, monkeypatch):
    """Under autocast a trainable layer computes in autocast's dtype, as the nn.Linear / nn.Conv2d it wraps and PEFT's
    lora_A do. Its ops are custom ops, which autocast does not cast, and a backward runs without autocast: the fp32
    output of an autocast norm layer used to reach the backward as fp32 (fp32 GEMMs on CUDA). Every layer's output
    has PEFT's dtype, its backward gets bf16 activations, and the gradients are no further from the fp32 step's
    than PEFT's bf16-autocast ones."""
    from fdlora.kernels.ops import lora_train

    seen = set()

    def spy(real):
        def run(*args):
            seen.add(args[1].dtype)  # u, the LoRA input the forward saved
            return real(*args)
        return run

    for name in ("lora_train_linear_backward", "lora_train_conv2d_backward"):  # what the eager backward runs on CPU
        monkeypatch.setattr(lora_train, name, spy(getattr(lora_train, name)))

    targets = "all-linear" if model_name == "tiny-llama" else ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]
    pm, fm = pair(model_name, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    exact = copy.deepcopy(pm)
    task = tiny.TASKS[model_name]
    paths = list(fdlora.lora_parameters(fm, "default"))
    dtypes = {}
    hooks = [m.register_forward_hook(lambda m, a, y, p=p, k=k: dtypes.setdefault((k, p), y.dtype) and None)
             for k, mods in (("peft", peft_lora_modules(pm)), ("fd", {p: fm.get_submodule(p) for p in paths}))
             for p, m in mods.items()]
    batch = tiny.synthetic_batch(task, fm, 2, 0)
    tiny.loss_of(task, exact, batch).backward()
    for m in (pm, fm):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tiny.loss_of(task, m, batch).backward()
    for h in hooks:
        h.remove()
    assert {dtypes["fd", p] for p in paths} == {torch.bfloat16} == {dtypes["peft", p] for p in paths}
    assert seen == {torch.bfloat16}, seen

    def worst(grads):
        ref = peft_lora_modules(exact)
        return max(max(rel(A, ref[p].lora_A["default"].weight.grad), rel(B, ref[p].lora_B["default"].weight.grad))
                   for p, (A, B) in grads.items())

    theirs = peft_lora_modules(pm)
    peft_err = worst({p: (m.lora_A["default"].weight.grad, m.lora_B["default"].weight.grad) for p, m in theirs.items()})
    fd_err = worst({p: (A.grad, B.grad) for p, (A, B) in fdlora.lora_parameters(fm, "default").items()})
    assert fd_err <= 1.5 * peft_err + 1e-3, (fd_err, peft_err)
