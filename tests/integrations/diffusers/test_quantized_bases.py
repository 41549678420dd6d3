"""LoRA over quantized denoisers: torchao weight-only (int8, float8; int4 where it runs), GGUF (Q8_0, Q4_0, built
in-process with the gguf package's own quantizer, as diffusers' GGUF tests do) and diffusers' layerwise float8
casting, on tiny Flux / SD3.5 transformers. The denoiser's output equals diffusers' `load_lora_weights` on the same
quantized model (fp32 compute, 1e-5 relative), with the merged-weight cache turned on: no quantized layer holds a
merged (dequantized) copy, `merge_cache_bytes()` counts only float layers, the load report names the quantized
layers, and `fuse_lora` refuses them naming the cost.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
from torch import nn

import fdlora
from fdlora.errors import FdLoraError
from fdlora.layers import registry_of_models
from fdlora.layers.modules.fused import _FusedLora
from fdlora.layers.quant import quantized

from . import families as F

warnings.filterwarnings("ignore")

REL = 1e-5
FP8 = torch.float8_e4m3fn


def _has(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


needs_torchao = pytest.mark.skipif(not _has("torchao"), reason="torchao not installed (pip install 'fd-lora[quant]')")
needs_gguf = pytest.mark.skipif(not _has("gguf"), reason="gguf not installed (pip install 'fd-lora[quant]')")


def torchao_config(name: str):
    from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig

    return {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig,
            "int4": lambda: Int4WeightOnlyConfig(group_size=32)}[name]()


def int4_runs() -> str | None:
    """None if torchao's int4 weight-only runs on this machine, else why not."""
    if not _has("torchao"):
        return "torchao not installed"
    from torchao.quantization import quantize_

    try:
        m = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
        quantize_(m, torchao_config("int4"))
        m(torch.randn(2, 64, dtype=torch.bfloat16))
    except Exception as e:  # torchao 0.18: its int4 layouts need CUDA or the mslk kernels
        return f"torchao int4 weight-only does not run here: {type(e).__name__}: {str(e)[:120]}"
    return None


def gguf_quantize(model: nn.Module, qtype: str) -> nn.Module:
    """Every nn.Linear whose rows fit GGUF blocks becomes diffusers' GGUFLinear holding a GGUFParameter quantized by
    gguf.quants.quantize (what diffusers' from_single_file + GGUFQuantizationConfig builds from a .gguf file)."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear

    qt = getattr(gguf.GGMLQuantizationType, qtype)
    block = gguf.GGML_QUANT_SIZES[qt][0]
    floats = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % block == 0}
    sd = {n + ".weight": GGUFParameter(torch.from_numpy(gguf.quants.quantize(m.weight.detach().numpy(), qt)),
                                       quant_type=qt) for n, m in floats.items()}
    bias = {n: m.bias for n, m in floats.items()}
    _replace_with_gguf_linear(model, torch.float32, sd)
    for n in floats:
        m = model.get_submodule(n)
        m.weight = sd[n + ".weight"]
        m.bias = None if bias[n] is None else nn.Parameter(bias[n].detach().clone(), requires_grad=False)
    return model


def quantize(pipe, how: str):
    """`pipe` with its transformer quantized in place by `how` ("torchao-int8", "gguf-Q8_0", "layerwise-fp8")."""
    lib, _, what = how.partition("-")
    m = pipe.transformer
    if lib == "torchao":
        from torchao.quantization import quantize_

        quantize_(m, torchao_config(what))
    elif lib == "gguf":
        gguf_quantize(m, what)
    else:
        m.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    return pipe


@pytest.fixture
def merge_cache_on():
    """The merged-weight cache on for CPU (off there by default), so a layer that wrongly counted as plain would
    take a merged copy."""
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def layers(model: nn.Module) -> list[_FusedLora]:
    return [m for m in model.modules() if isinstance(m, _FusedLora)]


def check_no_dequantized_copy(model: nn.Module, *others: nn.Module) -> int:
    """Every quantized layer of `model` runs base + delta and holds no merged copy, and the cache's byte count is
    only float layers' copies (of `model` and `others`, the live fd-lora models); returns how many are quantized."""
    quant = [lay for lay in layers(model) if quantized.kind(lay.base)]
    for lay in quant:
        assert not lay._plain and not lay._whole, lay.path
        assert lay.merged.buf is None and not lay.merged.groups, lay.path
    held = sum(lay.merged.buf.numel() * lay.merged.buf.element_size() for m in (model, *others) for lay in layers(m)
               if lay.merged.buf is not None)
    assert fdlora.merge_cache_bytes() == held
    return len(quant)


def case(family: str, how: str, fd_order: str = "quantize-then-load", ref_order: str | None = None) -> dict:
    """Base (quantized), one LoRA saved with the pipeline's save_lora_weights, loaded by diffusers and by fd-lora.
    "load-then-quantize": the LoRA is loaded first, then the model quantized (diffusers' documented order for
    layerwise casting; torchao's quantize_ after load_fd_lora). The reference takes `ref_order` (default fd's)."""
    base = F.build(family)
    sd, meta = F.peft_lora(base.transformer, seed=1)
    d = F.save(type(base), sd, meta)
    qbase = quantize(copy.deepcopy(base), how)
    out = {"x": F.SPECS[family].inputs(2), "base": qbase, "float": base}
    for who, order in (("ref", ref_order or fd_order), ("fd", fd_order)):
        pipe = copy.deepcopy(base)
        if order == "quantize-then-load":
            quantize(pipe, how)
        if who == "ref":
            pipe.load_lora_weights(d, adapter_name="a")
        else:
            out["report"] = pipe.load_fd_lora(d, adapter_name="a")
        if order != "quantize-then-load":
            quantize(pipe, how)
        out[who] = pipe
    return out


CASES = [
    pytest.param("flux", "torchao-int8", id="flux-torchao-int8", marks=needs_torchao),
    pytest.param("sd35", "torchao-int8", id="sd35-torchao-int8", marks=needs_torchao),
    pytest.param("flux", "torchao-float8", id="flux-torchao-float8", marks=needs_torchao),
    pytest.param("flux", "gguf-Q8_0", id="flux-gguf-Q8_0", marks=needs_gguf),
    pytest.param("sd35", "gguf-Q8_0", id="sd35-gguf-Q8_0", marks=needs_gguf),
    pytest.param("flux", "gguf-Q4_0", id="flux-gguf-Q4_0", marks=needs_gguf),
]


@pytest.mark.parametrize("family,how", CASES)
def test_quantized_base_equals_load_lora_weights(family, how, merge_cache_on):
    c = case(family, how)
    x = c["x"]
    base, want = F.run(c["base"].transformer, x), F.run(c["ref"].transformer, x)
    got = F.run(c["fd"].transformer, x)
    assert F.close(want, base) > 1e-3, "the LoRA must visibly change the output"
    assert F.close(got, want) < REL, (family, how, F.close(got, want))
    n = check_no_dequantized_copy(c["fd"].transformer)
    assert n == len(layers(c["fd"].transformer)), "every LoRA layer of these tiny models is quantized"
    assert fdlora.merge_cache_bytes() == 0
    kind = "torchao" if how.startswith("torchao") else "gguf"
    assert any(f"{n} of {n} LoRA layers have quantized bases ({kind}" in note for note in c["report"].notes), \
        c["report"].notes
    # per-prompt batch: prompt 0 with the adapter, prompt 1 without (diffusers: the base output)
    h = registry_of_models[c["fd"].transformer]
    with h.per_sample({2: ["a", None]}):
        per = F.run(c["fd"].transformer, x)
    assert F.close(per[:1], want[:1]) < REL and F.close(per[1:], base[1:]) < REL
    with pytest.raises(FdLoraError, match="cannot fuse into .*quantiz|cannot fuse into .*gguf|bytes for this layer"):
        c["fd"].fuse_lora()
    assert F.close(F.run(c["fd"].transformer, x), want) < REL  # a refused fuse leaves the model as it was


@needs_torchao
def test_torchao_quantize_after_load_is_seen(merge_cache_on):
    """torchao's quantize_ run on a model fd-lora already wrapped (and whose float layers already hold merged
    copies) swaps the weights under the layers: they stop being plain, drop their copies, and still equal diffusers'
    load_lora_weights on the same quantized model (quantized before the load: quantize_ after load_lora_weights
    would quantize PEFT's lora_A / lora_B Linears too; fd-lora's banks are not Linears, so they stay float)."""
    c = case("flux", "torchao-int8", fd_order="load-then-quantize", ref_order="quantize-then-load")
    fd = c["fd"].transformer
    assert all(type(lay.base) is nn.Linear for lay in layers(fd))
    got = F.run(fd, c["x"])
    want = F.run(c["ref"].transformer, c["x"])
    assert F.close(got, want) < REL
    assert check_no_dequantized_copy(fd) == len(layers(fd)) and fdlora.merge_cache_bytes() == 0


def test_layerwise_fp8_casting(merge_cache_on):
    """diffusers' order (load the LoRA, then enable_layerwise_casting) on fd-lora layers whose float weights already
    hold merged copies: the layers see their weights turn float8, drop the copies, run the base through its casting
    hooks, and equal diffusers+PEFT; the layers diffusers leaves in float (norms' linears) keep their copies."""
    c = case("flux", "layerwise-fp8", fd_order="load-then-quantize")
    fd = c["fd"].transformer
    pre = copy.deepcopy(c["float"])
    pre.load_fd_lora(F.save(type(pre), *F.peft_lora(pre.transformer, seed=1)), adapter_name="a")
    F.run(pre.transformer, c["x"])  # float: every layer takes a merged copy
    assert fdlora.merge_cache_bytes() > 0
    want, base = F.run(c["ref"].transformer, c["x"]), F.run(c["base"].transformer, c["x"])
    got = F.run(fd, c["x"])
    assert F.close(want, base) > 1e-3 and F.close(got, want) < REL
    n = check_no_dequantized_copy(fd, pre.transformer)
    assert 0 < n < len(layers(fd))
    assert all(lay.base.weight.dtype == FP8 for lay in layers(fd) if quantized.kind(lay.base))
    # fd-lora copes with casting enabled *before* load_fd_lora too (PEFT does not on CPU: its LoRA weights become
    # float8): same output, LoRA banks in the compute dtype, not float8
    early = quantize(copy.deepcopy(c["float"]), "layerwise-fp8")
    early.load_fd_lora(F.save(type(early), *F.peft_lora(c["float"].transformer, seed=1)), adapter_name="a")
    assert all(lay.bank.A.dtype == torch.float32 for lay in layers(early.transformer))
    assert F.close(F.run(early.transformer, c["x"]), want) < REL
    check_no_dequantized_copy(early.transformer, fd, pre.transformer)
    # and the pre-cast pipe's float copies are dropped once it is cast too
    quantize(pre, "layerwise-fp8")
    assert F.close(F.run(pre.transformer, c["x"]), want) < REL
    check_no_dequantized_copy(pre.transformer, fd, early.transformer)


def test_int4_where_it_runs(merge_cache_on):
    why = int4_runs()
    if why:
        pytest.skip(why)
    c = case("flux", "torchao-int4")
    got, want = F.run(c["fd"].transformer, c["x"]), F.run(c["ref"].transformer, c["x"])
    assert F.close(got, want) < REL
    assert check_no_dequantized_copy(c["fd"].transformer) and fdlora.merge_cache_bytes() == 0


def test_detection_table():
    """What fdlora.layers.quant.quantized calls plain, and what it calls each kind."""
    lin = nn.Linear(32, 16)
    assert quantized.kind(lin) is None and quantized.plain_weight(lin, torch.float32, torch.device("cpu"))
    assert not quantized.plain_weight(lin, torch.float16, torch.device("cpu"))
    f8 = nn.Linear(32, 16).to(FP8)
    assert quantized.kind(f8) == "float8_e4m3fn storage" and not quantized.plain_weight(f8, FP8, torch.device("cpu"))
    if _has("torchao"):
        from torchao.quantization import quantize_

        q = nn.Sequential(nn.Linear(32, 16))
        quantize_(q, torchao_config("int8"))
        assert q[0].weight.dtype == torch.float32  # looks float: why `type(base) is nn.Linear` was not enough
        assert quantized.kind(q[0]) == "torchao Int8Tensor"
        assert not quantized.plain_weight(q[0], torch.float32, torch.device("cpu"))


def test_missing_quant_library_names_the_extra():
    from fdlora.extras import missing

    for mod in ("torchao", "gguf", "bitsandbytes"):
        msg = str(missing(mod, "LoRA over this quantized base"))
        assert msg.count("\n") == 0 and "pip install 'fd-lora[quant]'" in msg, msg


@needs_torchao
def test_per_sample_grouped_path_skips_torchao_bases(merge_cache_on):
    """Per-sample calls at diffusion sizes (>= 64 rows a sample) run on per-blend merged copies for float bases
    (fdlora.layers.fastpath.remerge.refresh_groups); over a torchao base they run base(x) + delta per sample instead, equal to
    the quantized base's own output plus each sample's LoRA, and no copy is made."""
    from torchao.quantization import quantize_

    from fdlora.hub.adapter import LoraAdapter, ModuleLora

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48))
    quantize_(model, torchao_config("int8"))
    g = torch.Generator().manual_seed(1)
    loras = {n: ModuleLora(torch.randn(4, 64, generator=g) / 4, torch.randn(48, 4, generator=g) / 4, 8.0)
             for n in ("a", "b")}
    h = fdlora.inject(model, ["0"], max_slots=2, max_rank=4)
    for n, m in loras.items():
        h.add_adapter(LoraAdapter({"0": m}), n)
    x = torch.randn(2, 128, 64)
    with torch.no_grad():
        base = h.layers["0"].base(x)
        with h.per_sample({2: ["a", "b"]}):
            got = model(x)
    for i, n in enumerate(("a", "b")):
        m = loras[n]
        want = base[i] + m.scaling() * (x[i] @ m.A.t() @ m.B.t())
        assert F.close(got[i], want) < REL, n
    assert check_no_dequantized_copy(model) == 1 and fdlora.merge_cache_bytes() == 0


def test_layerwise_fp8_casting_on_a_locon_conv(merge_cache_on):
    """A conv LoRA (kohya LoCon: UNet resnets) whose Conv2d base diffusers' layerwise casting turns float8 after the
    layer took a merged copy: the copy is dropped, the conv runs through its casting hook, plus the LoCon delta."""
    import torch.nn.functional as tF
    from diffusers.hooks.layerwise_casting import apply_layerwise_casting

    from fdlora.hub.adapter import LoraAdapter, ModuleLora

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1))
    g = torch.Generator().manual_seed(1)
    m = ModuleLora(torch.randn(4, 8, 3, 3, generator=g) / 4, torch.randn(16, 4, 1, 1, generator=g) / 4, 8.0)
    h = fdlora.inject(model, ["0"], max_slots=2, max_rank=4)
    h.add_adapter(LoraAdapter({"0": m}), "a")
    x = torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        model(x)
        assert model[0].merged.buf is not None and fdlora.merge_cache_bytes() > 0  # float: merged copy
        apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=torch.float32, skip_modules_pattern=())
        got = model(x)
        base = model[0].base(x)
    want = base + m.scaling() * tF.conv2d(tF.conv2d(x, m.A, padding=1), m.B)
    assert model[0].base.weight.dtype == FP8
    assert F.close(got, want) < REL
    assert check_no_dequantized_copy(model) == 1 and fdlora.merge_cache_bytes() == 0


@needs_gguf
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_blends_merge_into_the_dequantized_weight(qtype, merge_cache_on, monkeypatch):
    """Blend calls over GGUF layers run F.linear on W' = diffusers' per-call dequantized W + the blend
    (fdlora.layers.quant.gguf): one adapter and a 2-blend equal diffusers' load_lora_weights on the same quantized model and
    fd-lora's base(x) + delta path; the tiny model's many-row layers took the merge (on CPU: diffusers' dequantization
    + addmm_), the few-row ones kept the delta; no dequantized copy is kept; a per-prompt batch takes the regular
    path and still equals diffusers."""
    from collections import Counter

    from fdlora.layers.quant import gguf as layer_gguf

    base = F.build("flux")
    dirs = {n: F.save(type(base), *F.peft_lora(base.transformer, seed=s)) for n, s in (("a", 1), ("b", 2))}
    ref, fd, qbase = (quantize(copy.deepcopy(base), f"gguf-{qtype}") for _ in range(3))
    for n, d in dirs.items():
        ref.load_lora_weights(d, adapter_name=n)
        fd.load_fd_lora(d, adapter_name=n)
    x = F.SPECS["flux"].inputs(2)
    wants = {}
    for names, weights in ((["a"], [1.0]), (["a", "b"], [0.7, -0.4])):
        ref.set_adapters(names, weights)
        fd.set_adapters(names, weights)
        want = wants[len(names)] = F.run(ref.transformer, x)
        for lay in layers(fd.transformer):
            lay.__dict__["gguf_path"] = None
        got = F.run(fd.transformer, x)
        assert F.close(got, want) < REL, (names, F.close(got, want))
        taken = Counter(lay.__dict__.get("gguf_path") for lay in layers(fd.transformer) if any(lay.bank.used))
        assert taken[layer_gguf.TORCH] > 0 and taken[layer_gguf.DELTA] > 0, taken
        assert set(taken) <= {layer_gguf.TORCH, layer_gguf.DELTA}, taken  # every LoRA layer is GGUF: each decided
        with monkeypatch.context() as m:
            m.setattr(layer_gguf, "forward", lambda layer, x: None)
            assert F.close(F.run(fd.transformer, x), got) < REL
        assert check_no_dequantized_copy(fd.transformer) == len(layers(fd.transformer))
        assert fdlora.merge_cache_bytes() == 0
    fd.set_adapters(["a"], [1.0])
    h = registry_of_models[fd.transformer]
    for lay in layers(fd.transformer):
        lay.__dict__["gguf_path"] = None
    with h.per_sample({2: ["a", None]}):
        per = F.run(fd.transformer, x)
    assert all(lay.__dict__["gguf_path"] is None for lay in layers(fd.transformer))
    base_y = F.run(qbase.transformer, x)
    assert F.close(per[:1], wants[1][:1]) < REL and F.close(per[1:], base_y[1:]) < REL


@needs_torchao
@pytest.mark.parametrize("what", ["int8", "float8"])
def test_torchao_blends_merge_into_the_dequantized_weight(what, merge_cache_on, monkeypatch):
    """Blend calls over torchao weight-only layers run F.linear on W' = torchao's per-call dequantized W + the blend
    (fdlora.layers.quant.dequant): one adapter and a 2-blend equal diffusers' load_lora_weights on the same quantized model
    and fd-lora's base(x) + delta path; the tiny model's many-row layers took the merge (on CPU: torchao's dequantize
    + addmm_), the few-row ones kept the delta; no dequantized copy is kept and the quantized values are untouched; a
    per-prompt batch takes the regular path and still equals diffusers."""
    from collections import Counter

    from fdlora.layers.quant import dequant

    base = F.build("flux")
    dirs = {n: F.save(type(base), *F.peft_lora(base.transformer, seed=s)) for n, s in (("a", 1), ("b", 2))}
    ref, fd, qbase = (quantize(copy.deepcopy(base), f"torchao-{what}") for _ in range(3))
    for n, d in dirs.items():
        ref.load_lora_weights(d, adapter_name=n)
        fd.load_fd_lora(d, adapter_name=n)
    values = [(lay.base.weight.qdata.clone(), lay.base.weight.scale.clone()) for lay in layers(fd.transformer)]
    x = F.SPECS["flux"].inputs(2)
    wants = {}
    for names, weights in ((["a"], [1.0]), (["a", "b"], [0.7, -0.4])):
        ref.set_adapters(names, weights)
        fd.set_adapters(names, weights)
        want = wants[len(names)] = F.run(ref.transformer, x)
        for lay in layers(fd.transformer):
            lay.__dict__["merge_path"] = None
        got = F.run(fd.transformer, x)
        assert F.close(got, want) < REL, (names, F.close(got, want))
        taken = Counter(lay.__dict__.get("merge_path") for lay in layers(fd.transformer) if any(lay.bank.used))
        assert taken[dequant.TORCH] > 0 and taken[dequant.DELTA] > 0, taken
        assert set(taken) <= {dequant.TORCH, dequant.DELTA}, taken  # every LoRA layer is torchao: each decided
        with monkeypatch.context() as m:
            m.setattr(dequant, "forward", lambda layer, x: None)
            assert F.close(F.run(fd.transformer, x), got) < REL
        assert check_no_dequantized_copy(fd.transformer) == len(layers(fd.transformer))
        assert fdlora.merge_cache_bytes() == 0
    assert all(torch.equal(lay.base.weight.qdata.view(torch.uint8), q.view(torch.uint8))
               and torch.equal(lay.base.weight.scale, s) for lay, (q, s) in zip(layers(fd.transformer), values))
    fd.set_adapters(["a"], [1.0])
    h = registry_of_models[fd.transformer]
    for lay in layers(fd.transformer):
        lay.__dict__["merge_path"] = None
    with h.per_sample({2: ["a", None]}):
        per = F.run(fd.transformer, x)
    assert all(lay.__dict__["merge_path"] is None for lay in layers(fd.transformer))
    base_y = F.run(qbase.transformer, x)
    assert F.close(per[:1], wants[1][:1]) < REL and F.close(per[1:], base_y[1:]) < REL
