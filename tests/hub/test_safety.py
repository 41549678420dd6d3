"""Bad input fails with an fd-lora error that names the fix, and never leaves a model changed."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save, save_file
from support import loras, tiny

import fdlora
from fdlora.errors import (
    AdapterShapeError,
    FdLoraError,
    FormatError,
    NonFiniteError,
    ResolveError,
    TargetError,
    UnsafeFileError,
    UnusedKeysError,
)
from fdlora.hub import AdapterPool, load_adapters
from fdlora.hub.formats import FORMATS
from fdlora.hub.safefile import read_weights
from fdlora.layers import FdLoraHandle


def peft_sd(paths=("layers.0.q_proj",), rank=2, seed=0):
    return loras.peft_state(loras.make_lora({p: (16, 16) for p in paths}, rank=rank, seed=seed))


# --- files ---------------------------------------------------------------------------------------
def test_pickle_is_refused_unless_allowed(tmp_path):
    torch.save(peft_sd(), tmp_path / "pytorch_lora_weights.bin")
    with pytest.raises(ResolveError, match="allow_pickle=True"):
        load_adapters(tmp_path, cache=None)  # the rule skips pickles
    with pytest.raises(UnsafeFileError, match="pickle"):
        load_adapters(tmp_path, weight_name="pytorch_lora_weights.bin", cache=None)
    adapters, report = load_adapters(tmp_path, allow_pickle=True, cache=None)
    assert report.file == "pytorch_lora_weights.bin" and "layers.0.q_proj" in adapters["model"].modules


def test_truncated_file(tmp_path):
    data = save(peft_sd())
    (tmp_path / "a.safetensors").write_bytes(data[:-7])
    with pytest.raises(UnsafeFileError, match="truncated"):
        load_adapters(tmp_path / "a.safetensors", cache=None)
    (tmp_path / "b.safetensors").write_bytes(data[:5])
    with pytest.raises(UnsafeFileError, match="too short"):
        load_adapters(tmp_path / "b.safetensors", cache=None)


@pytest.mark.parametrize("header,needle", [
    pytest.param(None, "header claims", id="absurd-length"),
    pytest.param(b"{not json", "not valid JSON", id="not-json"),
    pytest.param(json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode(), "need 16",
                 id="size-mismatch"),
    pytest.param(json.dumps({"x": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 1 << 22]}}).encode(),
                 "truncated", id="offsets-past-end"),
    pytest.param(json.dumps({"x": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode(), "malformed",
                 id="unknown-dtype"),
])
def test_hostile_headers(tmp_path, header, needle):
    path = tmp_path / "h.safetensors"
    if header is None:
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    else:
        path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(UnsafeFileError, match=needle):
        read_weights(str(path))


def test_unknown_format_lists_every_detector(tmp_path):
    save_file({"encoder.weight": torch.zeros(2, 2), "decoder.bias": torch.zeros(2)}, tmp_path / "w.safetensors")
    with pytest.raises(FormatError) as e:
        load_adapters(tmp_path / "w.safetensors", cache=None)
    for f in FORMATS:
        assert f"{f.name}: needs {f.expects}" in str(e.value)


def test_strict_and_finite(tmp_path):
    sd = peft_sd()
    sd["layers.0.q_proj.something_else"] = torch.zeros(3)
    adapters, report = load_adapters(dict(sd), cache=None)
    assert list(report.keys_unused) == ["layers.0.q_proj.something_else"]
    with pytest.raises(UnusedKeysError, match="something_else"):
        load_adapters(dict(sd), strict=True, cache=None)
    bad = peft_sd()
    bad["layers.0.q_proj.lora_B.weight"][0, 0] = float("nan")
    load_adapters(bad, cache=None)  # off by default
    with pytest.raises(NonFiniteError, match="NaN"):
        load_adapters(bad, check_finite=True, cache=None)


# --- wrong base model: the handle validates before writing ----------------------------------------
def test_wrong_base_model_names_modules_and_changes_nothing(sd15_unet, sdxl_unet):
    lora = loras.make_lora(tiny.shapes(sd15_unet, ("attn2.to_k", "attn2.to_q")), rank=4)
    adapters, _ = load_adapters(loras.kohya_state({"unet": lora}), cache=None)
    unet = copy.deepcopy(sdxl_unet)
    before = tiny.snapshot(unet)
    with pytest.raises(AdapterShapeError, match=r"attn2\.to_k.*another base model"):
        fdlora.add_adapter(unet, adapters["unet"], "wrong")
    assert tiny.same_snapshot(before, tiny.snapshot(unet))
    pool = AdapterPool(FdLoraHandle(unet))
    with pytest.raises(AdapterShapeError, match=r"attn2\.to_k"):
        pool.add("wrong", adapters["unet"])
    assert pool.known() == [] and tiny.same_snapshot(before, tiny.snapshot(unet))
    with pytest.raises(TargetError, match="not a module"):
        pool.add("elsewhere", load_adapters(peft_sd(("no.such.module",)), cache=None)[0]["model"])
    assert pool.known() == [] and tiny.same_snapshot(before, tiny.snapshot(unet))


# --- fuzz ----------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"q_proj": torch.nn.Linear(16, 16),
                                                               "fc": torch.nn.Linear(16, 24)}) for _ in range(2))
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
TARGETS = {"layers.0.q_proj": ((16,), 16), "layers.1.fc": ((16,), 24), "conv": ((4, 3, 3), 8), "no.such": ((16,), 16)}
STYLES = {  # how each layout names (path, A or B): mostly what the formats expect, sometimes not
    "peft": lambda p, ab: f"{p}.lora_{ab}.weight",
    "peft-prefixed": lambda p, ab: f"base_model.model.{p}.lora_{ab}.weight",
    "diffusers": lambda p, ab: f"unet.{p}.lora_{ab}.weight",
    "diffusers-old": lambda p, ab: f"text_encoder.{p}.lora_linear_layer.{'down' if ab == 'A' else 'up'}.weight",
    "kohya": lambda p, ab: f"lora_unet_{p.replace('.', '_')}.lora_{'down' if ab == 'A' else 'up'}.weight",
    "flux-kohya": lambda p, ab: f"lora_unet_double_blocks_0_{p.replace('.', '_')}.lora_{'down' if ab == 'A' else 'up'}"
                                ".weight",
}
NOISE_KEYS = st.builds(lambda a, b: a + b, st.sampled_from(["", "unet.", "lora_unet_", "base_model.model.layers.0.",
                                                             "double_blocks.0.processor."]),
                       st.sampled_from(["alpha", "q_proj.alpha", "x.lora_B.bias", "qkv_lora1.down.weight",
                                        "fc.dora_scale", "w.weight", "hada_w1_a", "lora_magnitude_vector"]))


@st.composite
def lora_dicts(draw):
    """Mostly well-formed LoRA state dicts in some layout, with wrong shapes, dtypes, values and keys mixed in."""
    style = STYLES[draw(st.sampled_from(sorted(STYLES)))]
    sd = {}
    for path in draw(st.lists(st.sampled_from(sorted(TARGETS)), min_size=1, max_size=3, unique=True)):
        a_shape, n = TARGETS[path]
        r = draw(st.integers(1, 4))
        if draw(st.integers(0, 4)) == 0:  # a wrong width
            a_shape, n = (draw(st.sampled_from([8, 15, 16])),), draw(st.sampled_from([8, 16, 24]))
        b_shape = (n, r, 1, 1) if len(a_shape) == 3 else (n, r)
        dtype = draw(st.sampled_from(DTYPES[:3] * 3 + DTYPES[3:]))
        fill = draw(st.sampled_from([0.5, 0.5, 0.5, float("nan")]))
        for ab, shape in (("A", (r, *a_shape)), ("B", b_shape)):
            if draw(st.integers(0, 9)):  # now and then a half is missing
                sd[style(path, ab)] = torch.full(shape, fill).to(dtype)
        if draw(st.booleans()):
            sd[style(path, "A").split(".lora")[0] + ".alpha"] = torch.tensor(draw(st.sampled_from([1.0, 4.0])))
    for key in draw(st.lists(NOISE_KEYS, max_size=2)):
        sd[key] = torch.ones(draw(st.sampled_from([(), (2,), (16,), (2, 16)])))
    return sd


@pytest.fixture(scope="module")
def net():
    return Net()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=lora_dicts(), as_file=st.booleans(),
       meta=st.sampled_from([{}, {"lora_adapter_metadata": "{"}, {"lora_adapter_metadata": '{"unet.r": 2}'}]))
def test_fuzz_only_fdlora_errors_and_no_trace(net, tmp_path_factory, sd, as_file, meta):
    before = tiny.snapshot(net)
    try:
        if as_file:
            path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
            path.write_bytes(save({k: v.contiguous() for k, v in sd.items()}, {"format": "pt", **meta}))
            adapters, report = load_adapters(path, cache=None)
        else:
            adapters, report = load_adapters(sd, metadata=meta, cache=None)
        assert report.modules == sum(len(a.modules) for a in adapters.values())
        for adapter in adapters.values():
            try:
                fdlora.add_adapter(net, adapter, "fuzz")
            except FdLoraError:
                assert tiny.same_snapshot(before, tiny.snapshot(net))
            else:
                fdlora.restore(net)
    except FdLoraError:
        pass
    assert tiny.same_snapshot(before, tiny.snapshot(net))


def corrupt_file(tmp_path_factory, cut: int, flip: int, byte: int):
    """A PEFT safetensors file with byte `flip` set to `byte` and the last `cut` bytes gone."""
    data = bytearray(save(peft_sd()))
    if flip < len(data):
        data[flip] = byte
    path = tmp_path_factory.mktemp("bytes") / "c.safetensors"
    path.write_bytes(bytes(data[: len(data) - cut]))
    return path


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 400), flip=st.integers(0, 400), byte=st.integers(0, 255))
def test_fuzz_corrupt_bytes(tmp_path_factory, cut, flip, byte):
    path = corrupt_file(tmp_path_factory, cut, flip, byte)
    try:
        load_adapters(path, cache=None)
    except FdLoraError:
        pass


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_one_buffer_read_in_parallel_chunks(tmp_path, monkeypatch, chunk):
    """Large files are read by several threads in chunks: the bytes are the file's, whatever the chunking."""
    from fdlora.hub import safefile

    monkeypatch.setattr(safefile, "READ_CHUNK", chunk)
    data = bytes(range(256)) * 41 + b"tail"
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    buf = torch.zeros(len(data), dtype=torch.uint8)
    assert safefile.read_into(str(path), buf) == len(data) and bytes(buf.numpy()) == data
    longer = torch.zeros(len(data) + 9, dtype=torch.uint8)  # a file that shrank: fewer bytes, caller raises
    assert safefile.read_into(str(path), longer) == len(data)


def test_one_buffer_read_equals_safetensors(tmp_path):
    """read_weights(pin=True) (the whole file in one buffer, tensors as views) gives what safetensors gives."""
    g = torch.Generator().manual_seed(0)
    sd = {"a.lora_A.weight": torch.randn(3, 5, generator=g).half(), "b": torch.randn(7, generator=g),
          "c": torch.randn(2, 3, generator=g).bfloat16(), "d": torch.arange(5, dtype=torch.int64),
          "e": torch.randn(1, generator=g).half()}
    path = tmp_path / "m.safetensors"
    save_file(sd, path, metadata={"format": "pt", "note": "x"})
    plain, meta = read_weights(str(path))
    one, meta1 = read_weights(str(path), pin=True)
    assert meta == meta1 == {"note": "x"} and plain.keys() == one.keys()
    for k in plain:
        assert plain[k].dtype == one[k].dtype and torch.equal(plain[k], one[k]), k


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 400), flip=st.integers(0, 400), byte=st.integers(0, 255))
def test_fuzz_corrupt_bytes_one_buffer_read(tmp_path_factory, cut, flip, byte):
    path = corrupt_file(tmp_path_factory, cut, flip, byte)
    try:
        got, _ = read_weights(str(path), pin=True)
    except FdLoraError:
        return
    want, _ = read_weights(str(path))  # whatever passes the checks reads the same both ways
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got if got[k].dtype.is_floating_point
                                             and not got[k].isnan().any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_the_finite_screen_flags_exactly_the_tensors_with_nan_or_inf(dtype):
    """check_finite screens by one fp32 sum per tensor and confirms element by element: a huge but finite tensor
    (its sum overflows) passes, a single NaN / +Inf / -Inf anywhere fails, and the error names the first such."""
    from fdlora.hub.adapter import LoraAdapter, ModuleLora, _finite

    big = torch.full((4, 64), torch.finfo(dtype).max / 2, dtype=dtype)  # finite (bf16 / fp32 / fp64: its sum is not)
    clean = torch.randn(4, 64).to(dtype)
    bad = {}
    for name, v in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
        t = torch.randn(4, 64).to(dtype)
        t[3, 63] = v
        bad[name] = t
    assert _finite([big, clean, *bad.values(), torch.zeros(0, 8, dtype=dtype)]) == [True, True, False, False, False,
                                                                                   True]
    mods = {"a": ModuleLora(clean, clean.t().contiguous()), "b": ModuleLora(big, clean.t().contiguous()),
            "c": ModuleLora(clean, bad["-inf"].t().contiguous()), "d": ModuleLora(bad["nan"], clean.t().contiguous())}
    with pytest.raises(NonFiniteError, match=r"c\.B contains NaN or Inf"):
        LoraAdapter(mods).check_finite("x")
    LoraAdapter({k: mods[k] for k in "ab"}).check_finite("x")  # the huge finite one passes
