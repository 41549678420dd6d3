"""Resolution through the real huggingface_hub client against the loopback Hub: pinning, requests, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save
from support import hubcache, loras

from fdlora.errors import ResolveError
from fdlora.hub import AdapterCache, load_adapters
from fdlora.hub import resolve as resolve_module
from fdlora.hub.resolve import choose_weight_file, resolve

SHAPES = {"blocks.0.to_q": (8, 8), "blocks.1.to_q": (8, 8)}


def lora_files(seed: int, kind: str = "diffusers") -> dict[str, bytes]:
    lora = loras.make_lora(SHAPES, rank=2, seed=seed)
    if kind == "peft":
        return loras.peft_files(lora)
    return loras.diffusers_files({"unet": lora})


def first_A(adapters) -> torch.Tensor:
    return next(iter(adapters.values())).modules["blocks.0.to_q"].A


# --- the weight-file rule ----------------------------------------------------------------------
@pytest.mark.parametrize("files,allow_pickle,chosen", [
    pytest.param(["adapter_model.safetensors", "adapter_config.json", "pytorch_lora_weights.safetensors"], False,
                 "adapter_model.safetensors", id="peft-first"),
    pytest.param(["pytorch_lora_weights.safetensors", "other.safetensors", "README.md"], False,
                 "pytorch_lora_weights.safetensors", id="diffusers-name"),
    pytest.param(["my_style.safetensors", "README.md", "sub/x.safetensors"], False, "my_style.safetensors",
                 id="single-top-level"),
    pytest.param(["pytorch_lora_weights.bin", "a.safetensors"], True, "a.safetensors", id="safetensors-before-pickle"),
    pytest.param(["pytorch_lora_weights.bin", "README.md"], True, "pytorch_lora_weights.bin", id="pickle-allowed"),
    pytest.param(["lora.ckpt"], True, "lora.ckpt", id="single-pickle"),
])
def test_weight_rule_picks(files, allow_pickle, chosen):
    name, why = choose_weight_file(files, allow_pickle, where="repo")
    assert name == chosen and "rule" in why


@pytest.mark.parametrize("files,allow_pickle,needle", [
    pytest.param(["a.safetensors", "b.safetensors"], False, "'a.safetensors', 'b.safetensors'", id="ambiguous"),
    pytest.param(["README.md", "sub/x.safetensors"], False, "sub/x.safetensors", id="only-nested"),
    pytest.param(["pytorch_lora_weights.bin"], False, "allow_pickle=True", id="pickle-not-allowed"),
])
def test_weight_rule_errors_list_candidates(files, allow_pickle, needle):
    with pytest.raises(ResolveError, match="weight_name") as e:
        choose_weight_file(files, allow_pickle, where="repo")
    assert needle in str(e.value)


# --- Hub sources: revisions, pinning and requests ----------------------------------------------
UNET_PATH = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
TE_PATH = "text_model.encoder.layers.0.self_attn.q_proj"


def fixture_repo(fmt: str) -> tuple[dict[str, bytes], str, dict[str, int]]:
    """(files, the file the rule must choose, modules per component) of a one-format fixture repo."""
    u, t = loras.make_lora({UNET_PATH: (8, 8)}, seed=13), loras.make_lora({TE_PATH: (8, 8)}, seed=14)
    flux = loras.make_lora({"transformer_blocks.0.attn.to_out.0": (8, 8)}, seed=15)
    qkv = (torch.randn(3, 8), torch.randn(24, 3))
    cases = {
        "peft": (loras.peft_files(u), "adapter_model.safetensors", {"unet": 1}),
        "diffusers": (loras.diffusers_files({"unet": u, "text_encoder": t}, metadata={"unet": {"r": 4}}),
                      "pytorch_lora_weights.safetensors", {"unet": 1, "text_encoder": 1}),
        "kohya": (loras.kohya_file({"unet": u, "text_encoder": t}, kind="sdxl", sgm=True, name="style.safetensors"),
                  "style.safetensors", {"unet": 1, "text_encoder": 1}),
        "flux-kohya": (loras.flux_kohya_file(flux, qkv=qkv, alpha=1.0), "flux_lora.safetensors", {"transformer": 4}),
        "flux-xlabs": (loras.xlabs_file(flux.weights["transformer_blocks.0.attn.to_out.0"], qkv), "lora.safetensors",
                       {"transformer": 4}),
    }
    files, chosen, components = cases[fmt]
    return {**files, "README.md": b"# a fixture"}, chosen, components


REASONS = {  # what each detector's reason must name: the evidence specific to its format
    "peft": "adapter_config.json", "diffusers": "save_lora_weights", "kohya": "SGM block names",
    "flux-kohya": "lora_unet_double_blocks_0_", "flux-xlabs": ".processor.",
}


@pytest.mark.parametrize("fmt", ["peft", "diffusers", "kohya", "flux-kohya", "flux-xlabs"])
def test_every_format_through_the_hub(hub, fmt):
    files, chosen, components = fixture_repo(fmt)
    repo, commit = hub.publish(files, refs=("main", "v1"))
    adapters, report = load_adapters(repo, revision="v1", cache=None)
    assert (report.format, report.file, report.sha, report.components) == (fmt, chosen, commit, components)
    assert all(a.provenance.revision == commit and a.provenance.file == chosen for a in adapters.values())
    assert isinstance(report.format_reason, str) and REASONS[fmt] in report.format_reason, report.format_reason

def test_revisions_tags_and_pinning(hub):
    repo, c1 = hub.publish(lora_files(1), refs=("main", "v1"))
    _, c2 = hub.publish(lora_files(2), repo=repo, refs=("main",))
    main, r_main = load_adapters(repo, cache=None)
    v1, r_v1 = load_adapters(repo, revision="v1", cache=None)
    pinned, r_pin = load_adapters(repo, revision=c1, cache=None)
    short, r_short = load_adapters(repo, revision=c1[:10], cache=None)
    assert (r_main.sha, r_v1.sha, r_pin.sha, r_short.sha) == (c2, c1, c1, c1)
    assert main["unet"].provenance.revision == c2 and v1["unet"].provenance.format == "diffusers"
    assert torch.equal(first_A(v1), first_A(pinned)) and torch.equal(first_A(v1), first_A(short))
    assert not torch.equal(first_A(main), first_A(v1))
    assert r_main.file == "pytorch_lora_weights.safetensors" and "diffusers LoRA file name" in r_main.file_choice


def test_sha_pinned_cached_load_makes_no_request(hub):
    repo, commit = hub.publish(lora_files(3))
    load_adapters(repo, revision=commit, cache=None)  # lists the commit, downloads the chosen file
    mark = hub.mark()
    load_adapters(repo, revision=commit, weight_name="pytorch_lora_weights.safetensors", cache=None)
    load_adapters(repo, revision=commit, cache=None)  # the listing of a commit is remembered
    assert hub.since(mark) == []


def test_branch_load_from_ram_cache_only_resolves(hub):
    repo, commit = hub.publish(lora_files(4))
    ram = AdapterCache(max_bytes=1 << 30)
    first, _ = load_adapters(repo, cache=ram)
    mark = hub.mark()
    again, report = load_adapters(repo, cache=ram)
    requests = hub.since(mark)
    assert len(requests) == 1 and requests[0][1].startswith("/api/models/")  # one resolve, no download
    assert report.from_cache and report.sha == commit and again["unet"].modules.keys() == first["unet"].modules.keys()
    mark = hub.mark()
    load_adapters(repo, revision=commit, cache=ram)
    assert hub.since(mark) == []


# --- diffusers' Hub keywords ----------------------------------------------------------------------
def test_token_goes_with_every_request(hub):
    repo, _ = hub.publish(lora_files(20, "peft"))  # PEFT: the config download takes the token too
    mark = hub.mark()
    load_adapters(repo, token="hf_xyz", cache=None)
    requests = hub.since(mark)
    assert any(m == "GET" and "/resolve/" in p for m, p, _ in requests)
    assert [r.authorization for r in requests] == ["Bearer hf_xyz"] * len(requests)
    other, _ = hub.publish(lora_files(20, "peft"))
    mark = hub.mark()
    load_adapters(other, cache=None)
    assert {r.authorization for r in hub.since(mark)} == {None}  # the header came from token=, not the client


def test_cache_dir_holds_the_download(hub, tmp_path):
    from huggingface_hub import constants

    files = lora_files(21)
    repo, commit = hub.publish(files)
    _, report = load_adapters(repo, cache_dir=tmp_path, cache=None)
    folder = f"models--{repo.replace('/', '--')}"
    cached = tmp_path / folder / "snapshots" / commit / report.file
    assert cached.read_bytes() == files[report.file]
    assert not os.path.exists(os.path.join(constants.HF_HUB_CACHE, folder))


@pytest.mark.parametrize("pinned,cache_folder", [(False, "empty"), (True, "empty"), (True, "missing")],
                         ids=["branch", "sha", "sha-no-cache-folder"])
def test_local_files_only_uncached_raises_without_requests(hub, tmp_path, pinned, cache_folder):
    repo, commit = hub.publish(lora_files(22))
    cache_dir = tmp_path if cache_folder == "empty" else tmp_path / "missing"
    mark = hub.mark()
    with pytest.raises(ResolveError, match="local Hugging Face cache"):
        load_adapters(repo, revision=commit if pinned else None, cache_dir=cache_dir, local_files_only=True,
                      cache=None)
    assert hub.since(mark) == []


def test_local_files_only_cached_loads_without_requests(hub, tmp_path, monkeypatch):
    repo, commit = hub.publish(lora_files(23, "peft"))
    online, _ = load_adapters(repo, cache_dir=tmp_path, cache=None)
    monkeypatch.setattr(resolve_module, "_LISTINGS", {})  # forget the listing, as a new process would
    mark = hub.mark()
    offline, report = load_adapters(repo, cache_dir=tmp_path, local_files_only=True, cache=None)
    assert hub.since(mark) == []
    assert (report.sha, report.file, report.format) == (commit, "adapter_model.safetensors", "peft")
    assert torch.equal(first_A(online), first_A(offline))


def test_force_download_refetches_and_bypasses_the_ram_cache(hub):
    repo, commit = hub.publish(lora_files(24))
    ram = AdapterCache(max_bytes=1 << 30)
    load_adapters(repo, revision=commit, cache=ram)
    mark = hub.mark()
    _, forced = load_adapters(repo, revision=commit, cache=ram, force_download=True)
    gets = [p for m, p, _ in hub.since(mark) if m == "GET" and "/resolve/" in p]
    assert [p.rsplit("/", 1)[-1] for p in gets] == ["pytorch_lora_weights.safetensors"]
    assert not forced.from_cache and ram.hits == 0
    mark = hub.mark()
    _, again = load_adapters(repo, revision=commit, cache=ram)
    assert again.from_cache and hub.since(mark) == []


def test_only_the_chosen_files_are_fetched(hub):
    files = {**lora_files(5, "peft"), "README.md": b"# card", "other/big.safetensors": b"x" * 4096,
             "pytorch_lora_weights.safetensors": lora_files(6)["pytorch_lora_weights.safetensors"]}
    repo, _ = hub.publish(files)
    mark = hub.mark()
    adapters, report = load_adapters(repo, cache=None)
    fetched = sorted({p.rsplit("/", 1)[-1] for m, p, _ in hub.since(mark) if "/resolve/" in p})
    assert fetched == ["adapter_config.json", "adapter_model.safetensors"]
    assert report.format == "peft" and report.file == "adapter_model.safetensors"


def test_peft_weights_without_config(hub):
    sd = loras.peft_state(loras.make_lora(SHAPES, rank=2, seed=12), "base_model.model.")
    repo, commit = hub.publish({"adapter_model.safetensors": save(sd)})
    _, report = load_adapters(repo, revision=commit, cache=None)
    assert report.format == "peft" and any("no adapter_config.json" in n for n in report.notes)
    mark = hub.mark()
    load_adapters(repo, revision=commit, cache=None)  # the config's absence is remembered too
    assert hub.since(mark) == []


def test_subfolder_and_weight_name(hub):
    files = {"loras/a.safetensors": lora_files(7)["pytorch_lora_weights.safetensors"], "README.md": b"x"}
    repo, _ = hub.publish(files)
    a, r = load_adapters(repo, subfolder="loras", cache=None)
    b, _ = load_adapters(repo, weight_name="a.safetensors", subfolder="loras", cache=None)
    assert r.file == "loras/a.safetensors" and torch.equal(first_A(a), first_A(b))
    with pytest.raises(ResolveError, match="subfolder"):
        load_adapters(repo, cache=None)  # the only weights are nested


@pytest.mark.parametrize("case", ["repo", "file", "revision"])
def test_missing_repo_file_revision(hub, case):
    repo, _ = hub.publish(lora_files(8))
    kw = {"repo": dict(source="test/does-not-exist"),
          "file": dict(source=repo, weight_name="nope.safetensors"),
          "revision": dict(source=repo, revision="no-such-branch")}[case]
    needle = {"repo": "no Hub repo", "file": "pytorch_lora_weights.safetensors", "revision": "does not exist"}[case]
    with pytest.raises(ResolveError, match=needle):
        load_adapters(**kw, cache=None)


# --- local sources -------------------------------------------------------------------------------
def test_local_dir_and_file(tmp_path):
    for name, data in lora_files(9, "peft").items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "notes.txt").write_text("x")
    from_dir, r_dir = load_adapters(tmp_path, cache=None)
    from_file, r_file = load_adapters(tmp_path / "adapter_model.safetensors", cache=None)
    assert r_dir.kind == "dir" and r_file.kind == "file" and r_dir.format == r_file.format == "peft"
    assert torch.equal(first_A(from_dir), first_A(from_file))
    with pytest.raises(ResolveError, match="missing.safetensors' does not exist"):
        resolve(str(tmp_path / "missing.safetensors"))
    with pytest.raises(ResolveError, match="neither"):
        resolve(str(tmp_path / "missing"))


def test_offline_cache_in_a_subprocess(tmp_path):
    """HF_HUB_OFFLINE is read at import, so the offline client runs in its own process over a hand-made cache."""
    cache = tmp_path / "hub"
    repo = "offline/style"
    c0, _ = hubcache.populate(cache, repo, {"style.safetensors": lora_files(9)["pytorch_lora_weights.safetensors"],
                                            "README.md": b"x"}, refs=("v0",))
    c1, _ = hubcache.populate(cache, repo, lora_files(10), refs=("main", "v1"))
    c2, _ = hubcache.populate(cache, repo, {"pytorch_lora_weights.safetensors": save(
        loras.peft_state(loras.make_lora(SHAPES, rank=2, seed=11), "transformer."))}, refs=("main",))
    code = textwrap.dedent(f"""
        import json, sys
        from fdlora.hub import load_adapters
        from fdlora.errors import ResolveError
        out = {{}}
        for key, kw in {{"main": {{}}, "v1": {{"revision": "v1"}}, "sha": {{"revision": "{c1}"}},
                         "v0": {{"revision": "v0"}}}}.items():
            ad, r = load_adapters("{repo}", cache=None, **kw)
            out[key] = [r.sha, r.file, list(ad)]
        out["peft_imported"] = "peft" in sys.modules
        try:
            load_adapters("offline/missing", cache=None)
        except ResolveError as e:
            out["missing"] = str(e)
        print(json.dumps(out))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["main"] == [c2, "pytorch_lora_weights.safetensors", ["transformer"]]
    assert out["v1"] == out["sha"] == [c1, "pytorch_lora_weights.safetensors", ["unet"]]
    assert out["v0"] == [c0, "style.safetensors", ["unet"]]  # found by scanning the cached snapshot
    assert "local Hugging Face cache" in out["missing"] and not out["peft_imported"]
