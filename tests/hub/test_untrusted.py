"""Issue 28, hub side: hostile or corrupt adapter files and arguments fail with an fd-lora error, on both readers."""

from __future__ import annotations

import json
import math
import struct
import warnings

import pytest
import torch
from safetensors.torch import save
from support import loras

from fdlora.errors import (
    AdapterNameError,
    AdapterShapeError,
    CapacityError,
    FdLoraError,
    FormatError,
    NonFiniteError,
    PartialLoadWarning,
    ResolveError,
    UnsafeFileError,
)
from fdlora.hub import load_adapters
from fdlora.hub.safefile import read_weights

READERS = ("pinned", "safetensors")


@pytest.fixture(params=READERS)
def reader(request, monkeypatch):
    """Every file test runs on both read paths: the one-buffer reader used with CUDA, forced here on CPU."""
    monkeypatch.setenv("FDLORA_READER", request.param)
    return request.param


def lora(rank=2, paths=("layers.0.q_proj", "layers.0.k_proj"), seed=0):
    return loras.make_lora({p: (16, 16) for p in paths}, rank=rank, seed=seed)


def raw_file(tmp_path, header: dict, data: bytes, name="x.safetensors"):
    h = json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


# --- item 2: alphas ------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [math.nan, math.inf, -1e30], ids=["nan", "inf", "-1e30"])
def test_bad_alpha_tensor_is_refused(alpha, reader, tmp_path):
    sd = loras.kohya_state({"text_encoder": lora(paths=("text_model.encoder.layers.0.self_attn.q_proj",))})
    sd = {k: torch.tensor(alpha) if k.endswith(".alpha") else v for k, v in sd.items()}
    (tmp_path / "k.safetensors").write_bytes(save(sd))
    with pytest.raises((FormatError, NonFiniteError), match="alpha"):
        load_adapters(tmp_path / "k.safetensors", cache=None, check_finite=True)


@pytest.mark.parametrize("alpha", ["NaN", "Infinity", "-1e30"])
def test_bad_lora_alpha_in_config_or_metadata_is_refused(alpha, reader, tmp_path):
    files = loras.peft_files(lora())
    cfg = json.loads(files["adapter_config.json"])
    text = json.dumps(cfg).replace('"lora_alpha": 2', f'"lora_alpha": {alpha}')
    files["adapter_config.json"] = text.encode()
    for n, b in files.items():
        (tmp_path / n).write_bytes(b)
    with pytest.raises((FormatError, NonFiniteError), match="alpha"):
        load_adapters(tmp_path, cache=None, check_finite=True)
    d = tmp_path / "diffusers"
    d.mkdir()
    meta = {"text_encoder": {"r": 2, "lora_alpha": float(alpha), "target_modules": ["q_proj", "k_proj"]}}
    for n, b in loras.diffusers_files({"text_encoder": lora()}, metadata=meta).items():
        (d / n).write_bytes(b)
    with pytest.raises((FormatError, NonFiniteError), match="alpha"):
        load_adapters(d, cache=None, check_finite=True)


def test_non_finite_error_names_the_adapter(clip_te):
    from fdlora.hub.adapter import LoraAdapter, ModuleLora
    from fdlora.layers import FdLoraHandle

    A = torch.full((2, 32), math.nan)
    bad = LoraAdapter({"encoder.layers.0.self_attn.q_proj": ModuleLora(A, torch.zeros(32, 2))})
    h = FdLoraHandle(clip_te)
    try:
        with pytest.raises(NonFiniteError, match="adapter 'pix'"):
            h.add_adapter(bad, "pix")
    finally:
        h.restore()


# --- item 3: the pinned reader checks what safetensors checks --------------------------------------
F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": None}


@pytest.mark.parametrize("header,needle", [
    pytest.param({"a": {**F32x4, "data_offsets": [0, 16]}, "b": {**F32x4, "data_offsets": [8, 24]}}, "overlaps",
                 id="overlap"),
    pytest.param({"a": {**F32x4, "data_offsets": [0, 16]}, "b": {**F32x4, "data_offsets": [0, 16]}}, "overlaps",
                 id="alias"),
    pytest.param({"a": {**F32x4, "data_offsets": [16, 32]}}, "gap", id="gap"),
    pytest.param({"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}, "malformed",
                 id="negative-shape"),
    pytest.param({"a": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}}, "malformed",
                 id="float-shape"),
    pytest.param({"__metadata__": ["x"], "a": {**F32x4, "data_offsets": [0, 16]}}, "__metadata__",
                 id="metadata-list"),
    pytest.param({"__metadata__": {"k": 1}, "a": {**F32x4, "data_offsets": [0, 16]}}, "__metadata__",
                 id="metadata-int-value"),
])
def test_pinned_reader_checks_like_safetensors(header, needle, tmp_path):
    path = raw_file(tmp_path, header, bytes(32 if needle != "gap" else 32))
    for pin in (True, False):
        with pytest.raises(UnsafeFileError, match=needle):
            read_weights(str(path), pin=pin)


def test_duplicate_key_and_deep_nesting(tmp_path):
    entry = '{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}'
    dup = f'{{"a": {entry}, "a": {entry}}}'.encode()
    deep = b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for text, needle in ((dup, "twice"), (deep, "nests too deeply|not valid JSON")):
        path = tmp_path / "d.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
        for pin in (True, False):
            with pytest.raises(UnsafeFileError, match=needle):
                read_weights(str(path), pin=pin)


def test_both_readers_give_the_same_tensors(tmp_path):
    sd = loras.peft_state(lora(rank=3))
    sd["odd"] = torch.arange(3, dtype=torch.float16)  # misaligned offsets for what follows
    (tmp_path / "w.safetensors").write_bytes(save(sd, {"k": "v"}))
    a, ma = read_weights(str(tmp_path / "w.safetensors"), pin=True)
    b, mb = read_weights(str(tmp_path / "w.safetensors"), pin=False)
    assert ma == mb == {"k": "v"} and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


# --- item 5: ranks are capped before anything is allocated ------------------------------------------
def test_rank_above_the_limit_is_refused_at_read(monkeypatch, reader, tmp_path):
    monkeypatch.setenv("FDLORA_MAX_RANK", "32")
    (tmp_path / "w.safetensors").write_bytes(save(loras.peft_state(lora(rank=48))))
    with pytest.raises(CapacityError, match="FDLORA_MAX_RANK=48"):
        load_adapters(tmp_path / "w.safetensors", cache=None)
    monkeypatch.setenv("FDLORA_MAX_RANK", "64")
    adapters, _ = load_adapters(tmp_path / "w.safetensors", cache=None)
    assert adapters["model"].modules["layers.0.q_proj"].rank == 48


# --- item 7: partial loads warn, every time -------------------------------------------------------
@pytest.mark.parametrize("damage", ["missing-B", "renamed-key", "targets-match-nothing"])
def test_partial_loads_warn(damage, reader, tmp_path, caplog):
    files = loras.peft_files(lora(paths=("layers.0.q_proj", "layers.0.k_proj", "layers.1.q_proj")))
    sd = loras.peft_state(lora(paths=("layers.0.q_proj", "layers.0.k_proj", "layers.1.q_proj")), "base_model.model.")
    cfg = json.loads(files["adapter_config.json"])
    if damage == "missing-B":
        del sd["base_model.model.layers.0.k_proj.lora_B.weight"]
    elif damage == "renamed-key":
        sd["base_model.model.layers.0.k_proj.lora_Q.weight"] = sd.pop("base_model.model.layers.0.k_proj.lora_A.weight")
    else:
        cfg["target_modules"] = ["q_proj"]
    (tmp_path / "adapter_model.safetensors").write_bytes(save(sd))
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    from fdlora.hub.cache import AdapterCache

    ram = AdapterCache(pin=False)
    for _ in range(2):  # the second load is a RAM-cache hit: it warns again
        with pytest.warns(PartialLoadWarning, match=r"keys were not loaded \(e\.g\. \['base_model\.model\.layers\.0"):
            load_adapters(tmp_path, cache=ram)
    assert "were not loaded" in caplog.text


def test_clean_load_does_not_warn(reader, tmp_path):
    for n, b in loras.peft_files(lora()).items():
        (tmp_path / n).write_bytes(b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        load_adapters(tmp_path, cache=None)


# --- item 8: errors that used to escape FdLoraError -----------------------------------------------
def test_rank_zero_tensors(tmp_path):
    sd = {"layers.0.q_proj.lora_A.weight": torch.zeros(0, 16), "layers.0.q_proj.lora_B.weight": torch.zeros(16, 0)}
    (tmp_path / "w.safetensors").write_bytes(save(sd))
    with pytest.raises(AdapterShapeError, match="empty dimension"):
        load_adapters(tmp_path / "w.safetensors", cache=None)


def test_deeply_nested_adapter_config(tmp_path):
    for n, b in loras.peft_files(lora()).items():
        (tmp_path / n).write_bytes(b)
    (tmp_path / "adapter_config.json").write_text('{"r": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(FormatError, match="nests too deeply"):
        load_adapters(tmp_path, cache=None)


@pytest.mark.parametrize("repo", ["a" * 200 + "/b", "user/na--me", "user/x..y", "user/.hidden"])
def test_bad_repo_ids_are_resolve_errors(repo):
    with pytest.raises(ResolveError):
        load_adapters(repo, cache=None, local_files_only=True)


@pytest.mark.parametrize("kw", [dict(weight_name="../../etc/passwd"), dict(weight_name="/etc/passwd"),
                                dict(subfolder="../.."), dict(weight_name="a\0b"), dict(weight_name=7)],
                         ids=["dotdot", "absolute", "subfolder-dotdot", "nul", "not-a-string"])
def test_weight_name_cannot_leave_the_directory(kw, tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "secret.safetensors").write_bytes(save(loras.peft_state(lora())))
    with pytest.raises(ResolveError):
        load_adapters(tmp_path / "inner", cache=None, **kw)
    with pytest.raises(ResolveError):
        load_adapters("user/repo", cache=None, local_files_only=True, **kw)


def test_symlink_out_of_the_directory(tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "secret.safetensors").write_bytes(save(loras.peft_state(lora())))
    (tmp_path / "inner" / "link.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(ResolveError, match="outside"):
        load_adapters(tmp_path / "inner", weight_name="link.safetensors", cache=None)


@pytest.mark.parametrize("name", ["__base__", "", 5, None.__class__, "a\nb"], ids=["base", "empty", "int", "type",
                                                                                  "newline"])
def test_unusable_adapter_names(name, clip_te):
    from fdlora.hub.adapter import LoraAdapter, ModuleLora
    from fdlora.layers import FdLoraHandle

    a = LoraAdapter({"encoder.layers.0.self_attn.q_proj": ModuleLora(torch.ones(2, 32), torch.ones(32, 2))})
    h = FdLoraHandle(clip_te)
    try:
        with pytest.raises(AdapterNameError):
            h.add_adapter(a, name)
        assert h.list_adapters() == [] and not h.layers
    finally:
        h.restore()
    with pytest.raises(FdLoraError):
        load_adapters({"x.lora_A.weight": torch.ones(1, 2), "x.lora_B.weight": torch.ones(2, 1)}, name=name)


@pytest.mark.parametrize("alpha", [-4.0, -math.inf, math.inf], ids=["negative", "-inf", "inf"])
def test_flux_kohya_alpha_that_would_hang_diffusers_converter(alpha, tmp_path):
    """diffusers' kohya Flux converter loops forever on a negative or infinite alpha: refused before it runs."""
    import signal

    lora_ = loras.make_lora({"transformer_blocks.0.attn.to_out.0": (32, 32)}, rank=4)
    (tmp_path / "f.safetensors").write_bytes(loras.flux_kohya_file(lora_, alpha=alpha)["flux_lora.safetensors"])
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("the load hangs")))
    signal.alarm(20)
    try:
        with pytest.raises(FormatError, match="positive finite"):
            load_adapters(tmp_path / "f.safetensors", cache=None)
    finally:
        signal.alarm(0)
