"""Fuzzed adapter files in every supported format: each either loads as a valid adapter or fails with an fd-lora
error; a failure leaves the model bit-identical and the adapter loaded before it working; no header claim is
allocated; pickle never runs. Seeded: the same files every run (FDLORA_RELIABILITY_SCALE sets how many)."""

from __future__ import annotations

import json
import pickle
import random
import resource
import struct
from collections import Counter

import pytest
import torch
from support import loras, tiny

import fdlora
from fdlora.errors import FdLoraError
from fdlora.hub import load_adapters

from .conftest import scaled

N_FILES = 1000
TRIPPED: list[str] = []


def _trip(*args):  # what a hostile pickle would call; must never run
    TRIPPED.append("pickle executed")


class Hostile:
    def __reduce__(self):
        return (_trip, ("boom",))


def seeds(clip, flux) -> dict[str, tuple[dict[str, bytes], str]]:
    """kind -> (files of a valid adapter, the weight file's name)."""
    te = loras.make_lora(tiny.shapes(clip, ("q_proj", "v_proj")), rank=4, seed=1)
    flx = loras.make_lora({p: s for p, s in tiny.shapes(flux, ("to_out.0", "ff.net.2", "proj_out")).items()
                           if p in loras.FLUX_BFL}, rank=4, seed=2)
    mix = loras.make_lora(tiny.shapes(flux, ("to_q", "to_k")), rank=4, seed=3)
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    out = {
        "peft-dir": (loras.peft_files(te, lora_alpha=8), "adapter_model.safetensors"),
        "diffusers-metadata": (loras.diffusers_files({"text_encoder": te}, metadata={"text_encoder": cfg}),
                               "pytorch_lora_weights.safetensors"),
        "diffusers-alphas": (loras.diffusers_files({"text_encoder": te}, network_alphas=True),
                             "pytorch_lora_weights.safetensors"),
        "kohya": (loras.kohya_file({"text_encoder": loras.Lora(
            {"text_model." + p: w for p, w in te.weights.items()})}), "lora.safetensors"),
        "flux-kohya": (loras.flux_kohya_file(flx, alpha=2.0), "flux_lora.safetensors"),
        "flux-mixture": (loras.flux_mixture_file(mix), "flux_mixture.safetensors"),
    }
    return out


def split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


def mutate(files: dict[str, bytes], weight: str, rng: random.Random) -> tuple[str, dict[str, bytes | None]]:
    """One random corruption of one adapter's files: (what was done, the files to write; None deletes one)."""
    data = files[weight]
    header, body = split(data)
    names = [k for k in header if k != "__metadata__"]
    key = rng.choice(names)
    info = header[key]
    op = rng.choice(["dtype", "shape", "offsets", "huge-claim", "rename", "drop", "duplicate", "alpha", "metadata",
                     "truncate", "bitflip-header", "bitflip-data", "nan-data", "config", "pickle", "garbage",
                     "rank-zero", "header-length"])
    if op == "dtype":
        info["dtype"] = rng.choice(["F16", "BF16", "I32", "U8", "BOOL", "F8_E4M3", "Q4", 7, None])
    elif op == "shape":
        s = info["shape"] or [1]
        info["shape"] = rng.choice([s[::-1], [-s[0], -s[-1]], [s[0] * 2, s[-1] // 2], s + [1], [], [2.5], "x"])
    elif op == "offsets":
        b, e = info["data_offsets"]
        d = rng.choice([-16, 4, 16, len(body)])
        info["data_offsets"] = rng.choice([[b + d, e + d], [b, e + d], [0, e - b], [e, b], [b, "x"]])
    elif op == "huge-claim":  # a header claiming ~TBs: must be refused without allocating it
        info["shape"] = [1 << 20, 1 << 20]
        info["data_offsets"] = [info["data_offsets"][0], info["data_offsets"][0] + (1 << 42)]
    elif op == "rename":
        header[key.replace("lora", rng.choice(["lorb", "LORA", ""]), 1).replace("weight", "wieght")] = header.pop(key)
    elif op == "drop":
        del header[key]  # (its bytes stay: a gap)
    elif op == "duplicate":
        header[rng.choice(names) + ".copy"] = dict(header[rng.choice(names)])
    elif op == "alpha":
        v = rng.choice([float("nan"), float("inf"), -1e30, 1e38])
        alphas = [k for k in names if k.endswith(".alpha")]
        if alphas:
            k = rng.choice(alphas)
            b = header[k]["data_offsets"][0]
            raw = torch.tensor([v], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
            nb = {"F32": 4, "F16": 2, "BF16": 2}.get(header[k]["dtype"], 4)
            body = body[:b] + torch.tensor([v]).to(getattr(torch, {"F32": "float32", "F16": "float16", "BF16":
                                                                    "bfloat16"}.get(header[k]["dtype"], "float32"))
                                                   ).view(torch.uint8).numpy().tobytes()[:nb] + body[b + nb:]
            del raw
        meta = header.get("__metadata__", {})
        if "lora_adapter_metadata" in meta:
            meta["lora_adapter_metadata"] = meta["lora_adapter_metadata"].replace('"lora_alpha": 8',
                                                                                  f'"lora_alpha": {v}')
        if "adapter_config.json" in files:
            cfg = json.loads(files["adapter_config.json"])
            cfg["lora_alpha"] = v
            return op, {weight: join(header, body), "adapter_config.json": json.dumps(cfg).encode()}
    elif op == "metadata":
        header["__metadata__"] = rng.choice([["x"], 5, {"k": 1}, {"lora_adapter_metadata": "{not json"},
                                             {"lora_adapter_metadata": "[" * 5000 + "]" * 5000},
                                             {"lora_adapter_metadata": '{"text_encoder.r": "x"}'}, None])
        if header["__metadata__"] is None:
            del header["__metadata__"]
    elif op == "truncate":
        return op, {weight: data[:rng.randrange(0, len(data))]}
    elif op == "bitflip-header":
        n = struct.unpack("<Q", data[:8])[0]
        i = rng.randrange(8, 8 + n)
        return op, {weight: data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]}
    elif op == "bitflip-data":
        if not body:
            return op, {weight: data}
        i = len(data) - len(body) + rng.randrange(len(body))
        return op, {weight: data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]}
    elif op == "nan-data":
        b, e = info["data_offsets"]
        if info["dtype"] == "F32" and e - b >= 4:
            body = body[:b] + struct.pack("<f", rng.choice([float("nan"), float("inf")])) + body[b + 4:]
    elif op == "config":
        if "adapter_config.json" not in files:
            return op, {weight: data[:len(data) // 2]}
        cfg = json.loads(files["adapter_config.json"])
        cfg.update(rng.choice([{"r": 5}, {"target_modules": ["nothing_matches"]}, {"peft_type": "IA3"},
                               {"use_dora": True}, {"rank_pattern": {"q_proj": 3}}, {"lora_alpha": "x"},
                               {"lora_alpha": 10 ** 400}, {"target_modules": 5}]))
        text = json.dumps(cfg) if rng.random() < 0.8 else "[" * 50_000 + "]" * 50_000
        return op, {"adapter_config.json": text.encode()}
    elif op == "pickle":
        return op, {weight: None, "adapter_model.bin": pickle.dumps({"w": Hostile()})}
    elif op == "garbage":
        return op, {weight: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))}
    elif op == "rank-zero":
        info["shape"] = [0] + info["shape"][1:]
        info["data_offsets"] = [info["data_offsets"][0]] * 2
    elif op == "header-length":
        return op, {weight: struct.pack("<Q", rng.choice([0, 1 << 62, len(data)])) + data[8:]}
    return op, {weight: join(header, body)}


@pytest.fixture(scope="module")
def models():
    clip, flux = tiny.clip_te(seed=4), tiny.flux_transformer(seed=5)
    kinds = seeds(clip, flux)  # (shapes are read from the plain modules, before injection)
    keeper = loras.make_lora(tiny.shapes(clip, ("k_proj",)), rank=2, seed=9)
    hc = fdlora.inject(clip, ["q_proj", "v_proj", "k_proj"], max_rank=16)
    hf = fdlora.inject(flux, ["to_q", "to_k", "to_out.0", "ff.net.2", "proj_out"], max_rank=16)
    yield {"clip": (clip, hc), "flux": (flux, hf), "kinds": kinds, "keeper": keeper}
    hc.restore()
    hf.restore()


@pytest.mark.filterwarnings("ignore::fdlora.errors.PartialLoadWarning")  # (partial loads are an allowed outcome)
def test_fuzzed_files(models, figures, tmp_path, monkeypatch):
    clip, hc = models["clip"]
    flux, hf = models["flux"]
    kinds, keeper = models["kinds"], models["keeper"]
    x = torch.randint(0, 50, (2, 7))
    hc.add_adapter(load_adapters(loras.peft_state(keeper), cache=None)[0]["text_encoder"], "keeper")
    ref = hc.model(x).last_hidden_state.clone()
    snaps = {"clip": tiny.snapshot(clip), "flux": tiny.snapshot(flux)}
    handle_of = {"text_encoder": hc, "model": hc, "transformer": hf}
    rng = random.Random(28)
    n = scaled(N_FILES)
    per_kind, outcomes = Counter(), Counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for i in range(n):
        kind = list(kinds)[i % len(kinds)]
        files, weight = kinds[kind]
        op, changed = mutate(dict(files), weight, rng)
        d = tmp_path / f"{i}"
        d.mkdir()
        for name, b in {**files, **changed}.items():
            if b is not None:
                (d / name).write_bytes(b)
        per_kind[kind] += 1
        reader = ("pinned", "safetensors")[i % 2]  # both read paths: the one-buffer reader is CUDA's default
        monkeypatch.setenv("FDLORA_READER", reader)
        per_kind[f"reader:{reader}"] += 1
        try:
            adapters, _ = load_adapters(d, cache=None, check_finite=True, allow_pickle=op == "pickle" and i % 2 == 0)
            for comp, a in adapters.items():
                h = handle_of[comp]
                h.add_adapter(a, "fuzz", activate=False, validate=True)
                h.delete_adapter("fuzz")
            outcomes["loaded"] += 1
        except FdLoraError as e:
            assert "\n" not in str(e).split(":")[0], e  # a one-line reason leads the message
            outcomes[type(e).__name__] += 1
        except Exception as e:  # anything else is a bug: say which file did it
            raise AssertionError(f"case {i} ({kind}, {op}) raised {type(e).__name__}: {e}") from e
        if i % 50 == 0 or i == n - 1:
            assert tiny.same_snapshot(tiny.snapshot(clip), snaps["clip"]), f"case {i} ({kind}, {op}) changed CLIP"
            assert tiny.same_snapshot(tiny.snapshot(flux), snaps["flux"]), f"case {i} ({kind}, {op}) changed Flux"
            assert hc.list_adapters() == ["keeper"] and hf.list_adapters() == []
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    assert not TRIPPED
    assert rss_growth < 256 << 20, f"peak RSS grew {rss_growth / 1e6:.0f} MB while headers claimed terabytes"
    hc.set_adapters(["keeper"])
    torch.testing.assert_close(hc.model(x).last_hidden_state, ref, rtol=0, atol=0)
    assert outcomes["loaded"] < n // 2  # most corruptions must be caught, not silently accepted
    figures["fuzzed_files"] += n
    figures["per_kind"].update({f"file:{k}": v for k, v in per_kind.items()})
    figures["outcomes"].update({f"file:{k}": v for k, v in outcomes.items()})
    figures["fuzz_peak_rss_growth_bytes"] = rss_growth
