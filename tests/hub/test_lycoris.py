"""LyCORIS LoHa / LoKr / LoCon-Tucker / full diffs and DoRA: exact, against three oracles.

Each case builds the adapter with the real thing (lycoris-lora's own modules, PEFT's LoHa / LoKr / DoRA
tuners), randomises every adapter weight, and checks fd-lora's output against (1) that library's module on the
same weights and (2) a float64 model whose weights are W + ΔW with ΔW written out from the format's definition
(LyCORIS for LoHa / LoKr / diff, PEFT for DoRA). Bounds: fp32 against fp64 with O(1) activations, 2e-5 relative.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fdlora
from fdlora.errors import PartialLoadWarning, UnsupportedFeatureError
from fdlora.hub import load_adapters

os.environ.setdefault("LYCORIS_KERNEL_BACKEND", "torch")  # the plain-torch oracle: no inductor compiles on CPU
lycoris = pytest.importorskip("lycoris")
logging.getLogger("LyCORIS").setLevel(logging.ERROR)
TOL = 2e-5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(12, 16)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Linear(16, 20)])

    def forward(self, x, y):
        return self.blocks[0](self.fc(x)), self.conv(y)


PATHS = ["fc", "conv", "blocks.0"]
X = (torch.randn(3, 12, generator=torch.Generator().manual_seed(1)),
     torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(2)))


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def run(model, x=X):
    with torch.no_grad():
        return model(*x)


def randomise(params, seed: int = 0, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * std)


# --- the definitions, written out (float64) -----------------------------------------------------------------
def tucker(t, wa, wb):
    return torch.einsum("ijhw,ip,jr->prhw", t, wa, wb)


def definition(parts: dict, shape: tuple, peft_scale: float | None = None) -> torch.Tensor:
    """ΔW of one LyCORIS module from its tensors (LyCORIS' definition; PEFT's scale where given)."""
    p = {k: v.double() for k, v in parts.items()}
    alpha = float(p["alpha"]) if "alpha" in p else None
    if "diff" in p:
        return p["diff"]
    if "hada_w1_a" in p:
        if "hada_t1" in p:
            w = tucker(p["hada_t1"], p["hada_w1_a"], p["hada_w1_b"]) * tucker(p["hada_t2"], p["hada_w2_a"],
                                                                              p["hada_w2_b"])
        else:
            w = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])
        dim = p["hada_w1_b"].shape[0]
    elif any(k.startswith("lokr") for k in p):
        w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
        if "lokr_w2" in p:
            w2 = p["lokr_w2"]
        elif "lokr_t2" in p:
            w2 = tucker(p["lokr_t2"], p["lokr_w2_a"], p["lokr_w2_b"])
        else:
            w2 = (p["lokr_w2_a"] @ p["lokr_w2_b"])
            if len(shape) == 4:
                w2 = w2.reshape(w2.shape[0], -1, *shape[2:])
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        w = torch.kron(w1, w2)
        dim = next((p[k].shape[0] for k in ("lokr_w1_b", "lokr_w2_b") if k in p), None)
        if dim is None:
            alpha = None  # LyCORIS: both halves full -> scale 1
    else:  # LoCon
        up, down = p["lora_up.weight"], p["lora_down.weight"]
        if "lora_mid.weight" in p:
            w = tucker(p["lora_mid.weight"], up.flatten(1).t(), down.flatten(1))
        else:
            w = (up.flatten(1) @ down.flatten(1))
        dim = down.shape[0]
    scale = peft_scale if peft_scale is not None else (alpha / dim if alpha and dim else 1.0)
    return w.reshape(shape) * scale


def reference(base: nn.Module, sd: dict, prefix: str = "lycoris_", peft: dict | None = None,
              dora_eps: bool = True) -> nn.Module:
    """A float64 copy of `base` with W + ΔW (and DoRA's m / ‖W + ΔW‖_row, bias deltas) in each module."""
    ref = copy.deepcopy(base).double()
    groups: dict[str, dict] = {}
    for k, v in sd.items():
        name, _, part = k.partition(".")
        groups.setdefault(name, {})[part.removesuffix(".default")] = v
    for path in PATHS:
        parts = groups.get(prefix + path.replace(".", "_")) if peft is None else _peft_parts(sd, path)
        if not parts:
            continue
        layer = ref.get_submodule(path)
        W = layer.weight
        mag = parts.pop("dora_scale", None)
        mag = parts.pop("lora_magnitude_vector", mag)
        if "lora_A.weight" in parts:  # PEFT LoRA (DoRA)
            parts = {"lora_down.weight": parts["lora_A.weight"], "lora_up.weight": parts["lora_B.weight"]}
        scale = None if peft is None else peft["scale"]
        new = W + definition(parts, tuple(W.shape), scale)
        if mag is not None:
            norm = new.flatten(1).norm(dim=1) + (torch.finfo(mag.dtype).eps if dora_eps else 0.0)
            new = new * (mag.double().flatten() / norm).reshape(-1, *[1] * (W.dim() - 1))
        with torch.no_grad():
            W.copy_(new)
            if "diff_b" in parts:
                layer.bias += parts["diff_b"].double()
    return ref


def _peft_parts(sd: dict, path: str) -> dict:
    pre = f"base_model.model.{path}."
    return {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}


def fd_model(base: nn.Module, adapters: dict, name: str = "a", **kw) -> nn.Module:
    model = copy.deepcopy(base)
    h = fdlora.inject(model, PATHS, max_rank=16)
    for a in adapters.values():
        h.add_adapter(a, name, **kw)
    return model


# --- LyCORIS naming: lycoris-lora's own network on a tiny model --------------------------------------------
LYCO = {  # id -> create_lycoris keywords
    "loha": dict(algo="loha"),
    "loha-tucker": dict(algo="loha", use_tucker=True),
    "lokr-full": dict(algo="lokr", factor=2),
    "lokr-w1-factored": dict(algo="lokr", factor=4, decompose_both=True),
    "lokr-tucker": dict(algo="lokr", factor=2, use_tucker=True),
    "lokr-dense-fallback": dict(algo="lokr", factor=-1, linear_dim=8),
    "full-diff": dict(algo="full"),
    "locon-tucker": dict(algo="lora", use_tucker=True),
    "locon-dora": dict(algo="lora", dora_wd=True),
    "loha-dora": dict(algo="loha", dora_wd=True),
    "lokr-dora": dict(algo="lokr", factor=2, decompose_both=True, dora_wd=True),
}


def lycoris_network(base: nn.Module, kw: dict, seed: int = 0):
    """(the model with LyCORIS applied, its state dict): every adapter weight random."""
    kw = dict(kw)
    dim = kw.pop("linear_dim", 2)
    model = copy.deepcopy(base)
    net = lycoris.create_lycoris(model, 1.0, linear_dim=dim, linear_alpha=3, conv_dim=2, conv_alpha=1.5,
                                 preset="full", **kw)
    net.apply_to()
    randomise([p for n, p in net.named_parameters() if "scalar" not in n], seed)
    return model, {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("case", list(LYCO))
def test_lycoris_naming_equals_lycoris_and_definition(case):
    base = Tiny()
    oracle, sd = lycoris_network(base, LYCO[case])
    adapters, report = load_adapters(sd, cache=None)
    assert report.format.startswith("lycoris") and not report.keys_dropped and not report.keys_unused
    assert report.keys_matched == len(sd)
    got, want, ref = run(fd_model(base, adapters)), run(oracle), run(reference(base, sd), tuple(x.double() for x in X))
    for g, w, r in zip(got, want, ref):
        assert torch.isfinite(g).all()
        assert rel(g, r) < TOL and rel(w, r) < TOL, (rel(g, r), rel(w, r))
        assert rel(g, run(base)[0] if g.dim() == 2 else run(base)[1]) > 1e-2  # the adapter does something


def test_factor_ranks_are_exact_products():
    """LoHa: rank r1*r2 (its exact product); LoKr with a full w1 [a, b]: min(a, b) * r; a module whose factor rank
    would reach min(N, K) is stored as its dense ΔW (rank min(N, K))."""
    base = Tiny()
    _, sd = lycoris_network(base, LYCO["loha"])
    mods = load_adapters(sd, cache=None)[0]["model"].modules
    assert {p.split(":")[-1]: m.rank for p, m in mods.items()} == {"fc": 4, "conv": 4, "blocks_0": 4}
    _, sd = lycoris_network(base, LYCO["lokr-dense-fallback"])
    mods = load_adapters(sd, cache=None)[0]["model"].modules
    assert {p.split(":")[-1]: m.rank for p, m in mods.items()} == {"fc": 12, "conv": 8, "blocks_0": 16}


# --- PEFT naming: PEFT's own LoHa / LoKr / DoRA tuners ---------------------------------------------------
def peft_cases():
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    t = ["fc", "conv", "blocks.0"]
    return {
        "peft-loha": LoHaConfig(r=2, alpha=3, target_modules=t),
        "peft-loha-tucker": LoHaConfig(r=2, alpha=3, target_modules=t, use_effective_conv2d=True),
        "peft-lokr": LoKrConfig(r=2, alpha=3, target_modules=t),
        "peft-lokr-decomposed": LoKrConfig(r=1, alpha=3, target_modules=t, decompose_both=True, decompose_factor=4),
        "peft-lokr-tucker": LoKrConfig(r=1, alpha=3, target_modules=t, use_effective_conv2d=True,
                                       decompose_factor=2),
        "peft-dora": LoraConfig(r=2, lora_alpha=3, target_modules=t, use_dora=True),
    }


@pytest.mark.parametrize("case", ["peft-loha", "peft-loha-tucker", "peft-lokr", "peft-lokr-decomposed",
                                  "peft-lokr-tucker", "peft-dora"])
def test_peft_naming_equals_peft_and_definition(case, tmp_path):
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict

    base, cfg = Tiny(), peft_cases()[case]
    pm = get_peft_model(copy.deepcopy(base), cfg)
    randomise([p for n, p in pm.named_parameters() if any(s in n for s in ("hada_", "lokr_", "lora_"))], seed=3)
    pm.save_pretrained(tmp_path)
    adapters, report = load_adapters(tmp_path, cache=None)
    assert report.format.startswith("peft") and not report.keys_dropped and not report.keys_unused
    sd = get_peft_model_state_dict(pm)
    scale = (cfg.lora_alpha if case == "peft-dora" else cfg.alpha) / cfg.r
    ref = reference(base, sd, peft={"scale": scale}, dora_eps=False)
    got, want, r64 = run(fd_model(base, adapters)), run(pm), run(ref, tuple(x.double() for x in X))
    for g, w, r in zip(got, want, r64):
        assert rel(g, r) < TOL and rel(w, r) < TOL, (rel(g, r), rel(w, r))


# --- kohya naming on a tiny SDXL pipeline -------------------------------------------------------------------
@pytest.fixture(scope="module")
def sdxl():
    from fdlora.fixtures.tiny_pipeline import sdxl as build
    from fdlora.integrations.diffusers.pipeline import enable_fd_lora

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = build()
    return pipe, enable_fd_lora


def unet_inputs(unet):
    from support import tiny

    kw = tiny.unet_inputs(unet, batch=1)
    kw["sample"] = kw["sample"][..., :8, :8]  # (small latents: the UNet's cost, not the adapter's, dominates)
    return kw


def kohya_network(unet, kw: dict, names: tuple[str, ...], seed: int, tmp, prefix: str = "lora_unet_"):
    """lycoris-lora on the UNet modules whose names end with `names`, saved with kohya's lora_unet_ prefix."""
    cls = lycoris.LycorisNetwork
    saved = {k: getattr(cls, k) for k in ("TARGET_REPLACE_MODULE", "TARGET_REPLACE_NAME", "ENABLE_CONV")}
    preset = tmp / "preset.toml"
    patterns = ", ".join(f'"^(.*[.])?{n.replace(".", "[.]")}$"' for n in names)
    preset.write_text(f"target_module = []\nenable_conv = true\ntarget_name = [{patterns}]\n")
    try:
        net = lycoris.create_lycoris(unet, 1.0, linear_dim=2, linear_alpha=3, conv_dim=2, conv_alpha=1.5,
                                     preset=str(preset), **kw)
    finally:  # (presets are class state in lycoris)
        for k, v in saved.items():
            setattr(cls, k, v)
    net.apply_to()
    randomise([p for n, p in net.named_parameters() if "scalar" not in n], seed, std=0.2)
    return {prefix + k.removeprefix("lycoris_"): v.detach().clone() for k, v in net.state_dict().items()}


KOHYA = {  # (plain LoHa, LoKr with a full w1, DoRA and full diffs in kohya naming: the mixed file below)
    "kohya-loha-tucker": dict(algo="loha", use_tucker=True),
    "kohya-lokr-decomposed": dict(algo="lokr", factor=4, decompose_both=True),
}
ATTN_CONV = ("attn1.to_q", "attn2.to_v", "ff.net.2", "resnets.0.conv1", "proj_in")


def unet_out(unet, kw):
    with torch.no_grad():
        return unet(**kw).sample


@pytest.mark.parametrize("case", list(KOHYA) + ["kohya-sgm-loha", "lycoris-names-on-unet"])
def test_kohya_sdxl_naming_equals_lycoris(case, sdxl, tmp_path):
    pipe0, enable = sdxl
    oracle = copy.deepcopy(pipe0.unet)
    if case == "kohya-sgm-loha":  # original SD block names, as kohya's SDXL trainers write them
        sd = kohya_network(oracle, dict(algo="loha"), ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
                                                       "down_blocks.1.attentions.1.proj_out"), seed=6, tmp=tmp_path)
        sd = {k.replace("down_blocks_1_attentions_0", "input_blocks_4_1")
              .replace("down_blocks_1_attentions_1", "input_blocks_5_1"): v for k, v in sd.items()}
        assert all("input_blocks_" in k for k in sd)
    elif case == "lycoris-names-on-unet":  # create_lycoris's own lycoris_ prefix on a diffusers UNet
        sd = kohya_network(oracle, dict(algo="lokr", factor=2), ATTN_CONV[:2], seed=7, tmp=tmp_path,
                           prefix="lycoris_")
    else:
        sd = kohya_network(oracle, KOHYA[case], ATTN_CONV, seed=5, tmp=tmp_path)
    pipe = enable(copy.deepcopy(pipe0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        report = pipe.load_fd_lora(dict(sd), adapter_name="x")
    assert report.format.startswith("kohya") and not report.keys_dropped and not report.keys_unused
    assert report.keys_matched == len(sd)
    kw = unet_inputs(pipe.unet)
    got, want, base = unet_out(pipe.unet, kw), unet_out(oracle, kw), unet_out(pipe0.unet, kw)
    assert rel(got, want) < 1e-4 and rel(want, base) > 1e-3, (rel(got, want), rel(want, base))


def test_mixed_kohya_file_loads_whole_and_fuses_exactly(sdxl, tmp_path, capsys):
    """LoRA + LoHa + LoKr + DoRA + full diff modules in one kohya file: nothing dropped or warned, output equal to
    LyCORIS's; fuse then unfuse gives back the exact bits (weights and biases); `fdlora inspect` names the kinds."""
    pipe0, enable = sdxl
    oracle = copy.deepcopy(pipe0.unet)
    sd = {}
    for i, (kw, names) in enumerate([(dict(algo="lora"), ("attn1.to_k", "resnets.1.conv2")),
                                     (dict(algo="loha"), ("attn1.to_q", "proj_out")),
                                     (dict(algo="lokr", factor=4), ("attn2.to_v",)),
                                     (dict(algo="lora", dora_wd=True), ("ff.net.2",)),
                                     (dict(algo="full"), ("resnets.0.conv1",))]):
        sd.update(kohya_network(oracle, kw, names, seed=10 + i, tmp=tmp_path))
    path = tmp_path / "mixed.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    pipe = enable(copy.deepcopy(pipe0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        report = pipe.load_fd_lora(str(path), adapter_name="mixed")
    assert not report.keys_dropped and not report.keys_unused and report.keys_matched == len(sd)
    kw = unet_inputs(pipe.unet)
    dynamic, want = unet_out(pipe.unet, kw), unet_out(oracle, kw)
    assert rel(dynamic, want) < 1e-4
    before = {k: v.clone() for k, v in pipe0.unet.state_dict().items()}
    pipe.fuse_lora()
    assert rel(unet_out(pipe.unet, kw), dynamic) < 1e-4
    pipe.unfuse_lora()
    after = {k.replace(".base.", "."): v for k, v in pipe.unet.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    from argparse import Namespace

    from fdlora.apps import inspect

    inspect.run(Namespace(source=str(path), revision=None, weight_name=None, subfolder=None, allow_pickle=False,
                          local_files_only=False, strict=False))
    out = capsys.readouterr().out
    assert "format    kohya (" in out and all(k in out for k in ("LoRA", "LoHa", "LoKr", "DoRA", "full diff"))
    inspect.run(Namespace(source=str(path), revision=None, weight_name=None, subfolder=None, allow_pickle=False,
                          local_files_only=False, strict=False, lora_conversion="svd:1"))
    out = capsys.readouterr().out
    assert "lora_conversion svd:1: " in out and "modules turned into plain LoRA; relative error of ΔW" in out


def test_diffusers_naming_dora_equals_load_lora_weights(sdxl, tmp_path):
    """PEFT DoRA saved by diffusers' save_lora_weights (unet.…lora_magnitude_vector): equal to diffusers+PEFT."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe0, enable = sdxl
    src = copy.deepcopy(pipe0)
    src.unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "conv1"], use_dora=True,
                                    init_lora_weights=False), adapter_name="src")
    randomise([p for n, p in src.unet.named_parameters() if "lora_B" in n], seed=8, std=0.1)
    with torch.no_grad():
        for n, p in src.unet.named_parameters():
            if "lora_magnitude" in n:
                p.mul_(1.3)
    type(pipe0).save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(src.unet, adapter_name="src"))
    ref = copy.deepcopy(pipe0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.load_lora_weights(tmp_path, adapter_name="x")
    pipe = enable(copy.deepcopy(pipe0))
    report = pipe.load_fd_lora(str(tmp_path), adapter_name="x")
    assert "DoRA" in report.format and not report.keys_dropped and not report.keys_unused
    kw = unet_inputs(pipe.unet)
    got, want = unet_out(pipe.unet, kw), unet_out(ref.unet, kw)
    assert rel(got, want) < 1e-4 and rel(want, unet_out(pipe0.unet, kw)) > 1e-2


# --- DoRA: blends and per-sample batches follow PEFT ----------------------------------------------------------
def peft_dora_pair():
    from peft import LoraConfig, get_peft_model

    base = Tiny()
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=4, target_modules=PATHS, use_dora=True),
                        adapter_name="d1")
    pm.add_adapter("d2", LoraConfig(r=3, lora_alpha=3, target_modules=PATHS, use_dora=True))
    pm.add_adapter("plain", LoraConfig(r=2, lora_alpha=2, target_modules=PATHS))
    randomise([p for n, p in pm.named_parameters() if "lora_" in n], seed=7)
    model = copy.deepcopy(base)
    h = fdlora.inject(model, PATHS, max_rank=16)
    from peft.utils import get_peft_model_state_dict

    for name in ("d1", "d2", "plain"):
        sd = get_peft_model_state_dict(pm, adapter_name=name)
        cfg = pm.peft_config[name].to_dict()
        h.add_adapter(load_adapters(sd, config=cfg, cache=None)[0]["model"], name)
    return pm, model, h


def peft_blend(pm, weights: dict[str, float]):
    """PEFT with these adapters active at these weights (diffusers' set_adapters: layer.set_scale)."""
    from peft.tuners.lora import LoraLayer

    pm.base_model.set_adapter(list(weights))
    for m in pm.modules():
        if isinstance(m, LoraLayer):
            for n in m.lora_A:
                m.set_scale(n, weights.get(n, 1.0))
    return pm


@pytest.mark.parametrize("weights", [{"d1": 1.0}, {"d1": 0.7, "d2": 1.3}, {"d1": 0.5, "plain": 0.8, "d2": -0.4}],
                         ids=["one", "two-dora", "dora-and-plain"])
def test_dora_blends_follow_peft(weights):
    pm, model, h = peft_dora_pair()
    h.set_adapters(list(weights), list(weights.values()))
    for g, w in zip(run(model), run(peft_blend(pm, weights))):
        assert rel(g, w) < TOL


def test_dora_per_sample_is_each_sample_alone():
    """PEFT refuses adapter_names with DoRA; fd-lora gives each sample what its adapters give it as a blend."""
    pm, model, h = peft_dora_pair()
    specs = ["d1", {"d2": 0.5, "plain": 1.0}, None]
    x = (X[0], torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(9)))
    with h.per_sample(specs):
        got = run(model, x)
    for i, spec in enumerate(specs):
        xi = tuple(t[i:i + 1] for t in x)
        if spec is None:
            with pm.disable_adapter():
                want = run(pm, xi)
        else:
            want = run(peft_blend(pm, {spec: 1.0} if isinstance(spec, str) else spec), xi)
        for g, w in zip(got, want):
            assert rel(g[i:i + 1], w) < TOL


def test_dora_per_row_and_fuse():
    pm, model, h = peft_dora_pair()
    def linear(m, x):
        with torch.no_grad():
            return m.blocks[0](m.fc(x))

    with h.per_row(["d2", None, "d1"]):
        got = linear(model, X[0])
    for i, name in enumerate(["d2", None, "d1"]):
        if name is None:
            with pm.disable_adapter():
                want = linear(pm.base_model.model, X[0][i:i + 1])
        else:
            want = linear(peft_blend(pm, {name: 1.0}).base_model.model, X[0][i:i + 1])
        assert rel(got[i:i + 1], want) < TOL
    from fdlora.integrations import fuse

    h.set_adapters(["d1", "plain"], [0.6, 1.2])
    dynamic = run(model)
    w = torch.zeros(h.state.slots.capacity)
    for n, x in h.state.active.items():
        w[h.state.slots.by_name[n]] = x
    originals = {p: fuse.fuse_layer(lay, w * h.state.table.scaling[lay.index], False) for p, lay in h.layers.items()}
    h.disable()
    assert all(rel(a, b) < TOL for a, b in zip(run(model), dynamic))
    for p, o in originals.items():
        fuse.unfuse_layer(h.layers[p], o)
    assert all(torch.equal(model.get_submodule(p).base.weight, Tiny().get_submodule(p).weight) for p in PATHS)


# --- refusals, the svd conversion --------------------------------------------------------------------------
def test_per_input_dora_is_refused_naming_it():
    base = Tiny()
    _, sd = lycoris_network(base, LYCO["locon-dora"])
    sd["lycoris_fc.dora_scale"] = torch.ones(1, 12)
    with pytest.raises(UnsupportedFeatureError, match="per-input-channel"):
        load_adapters(sd, cache=None)


def test_svd_conversion_reports_its_error():
    base = Tiny()
    _, sd = lycoris_network(base, LYCO["loha"])
    exact = run(fd_model(base, load_adapters(sd, cache=None)[0]))
    adapters, report = load_adapters(sd, cache=None, lora_conversion="svd:2")
    assert all(m.rank == 2 and m.origin == "lora" for m in adapters["model"].modules.values())
    assert any(n.startswith("lora_conversion svd:2: 3 modules") for n in report.notes)
    for path, err in report.configs["model"]["svd_errors"].items():
        p = {k.partition(".")[2]: v for k, v in sd.items() if k.startswith(f"lycoris_{path}.")}
        s = torch.linalg.svdvals(definition(p, (p["hada_w1_a"].shape[0], -1)))
        assert abs(err - float(s[2:].square().sum().sqrt() / s.square().sum().sqrt())) < 1e-6
    approx = run(fd_model(base, adapters))
    assert rel(approx[0], exact[0]) > 1e-6  # rank 2 of a rank-4 LoHa: an approximation, and said so
    full, report = load_adapters(sd, cache=None, lora_conversion="svd:64")
    assert all(rel(a, b) < 1e-5 for a, b in zip(run(fd_model(base, full)), exact))
    with pytest.raises(fdlora.errors.FormatError, match="svd:RANK"):
        load_adapters(sd, cache=None, lora_conversion="pca")


def test_other_lycoris_algorithms_are_dropped_loudly():
    """A kohya file with a LoHa module and an OFT module: the LoHa loads, the OFT keys are dropped with their reason,
    and the load warns (every time), naming how many."""
    g = torch.Generator().manual_seed(4)
    name = "lora_unet_down_blocks_1_attentions_0_proj_in"
    sd = {f"{name}.hada_w1_a": torch.randn(8, 2, generator=g), f"{name}.hada_w1_b": torch.randn(2, 8, generator=g),
          f"{name}.hada_w2_a": torch.randn(8, 2, generator=g), f"{name}.hada_w2_b": torch.randn(2, 8, generator=g),
          f"{name}.alpha": torch.tensor(2.0),
          "lora_unet_down_blocks_1_attentions_0_proj_out.oft_blocks": torch.randn(4, 2, 2, generator=g)}
    for _ in range(2):
        with pytest.warns(PartialLoadWarning, match="1 of 6 keys were not loaded"):
            adapters, report = load_adapters(dict(sd), cache=None)
    assert list(adapters["unet"].modules) == ["down_blocks.1.attentions.0.proj_in"]
    assert "OFT" in report.keys_dropped["lora_unet_down_blocks_1_attentions_0_proj_out.oft_blocks"]
