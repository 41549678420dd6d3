"""Several processes, one cache (issue 28).

- 4 processes start at once on one empty HF cache and one fd-lora-written cache (fdlora.fixtures.localcache, what
  the quickstart and demo publish with): each loads the same 16 MB repo from the loopback Hub and writes /
  loads the same repo into the local cache, while a watcher thread in each checks every file visible under
  a final name (blobs, snapshot links, refs) holds its whole content. All 4 loads equal the file's own
  tensors.
- A read-only cache (a read-only bind mount; as root a chmod would not stop writes) serves what it holds,
  online and offline, writes nothing, and refuses what it lacks with one ResolveError line saying so.
- A full disk (a 4 MB tmpfs; without mount rights, ENOSPC injected into huggingface_hub's download) gives
  one ResolveError line, leaves no partial file under a final name, and the same load works once there is
  room. fd-lora's own cache writer fails the same way, leaving nothing partial.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import fdlora
from fdlora.errors import ResolveError
from fdlora.fixtures.localcache import populate

ROOT = Path(__file__).resolve().parents[2]
TEMP_SUFFIXES = (".incomplete", ".lock", ".tmp")
# huggingface_hub's umask probe: an empty `tmp_<uuid4>` touched and unlinked next to a download before the move
# (file_download._chmod_and_move); never a cache entry, and never holding content
_HF_PROBE = re.compile(r"tmp_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def temporary(p: Path) -> bool:
    """A name no reader resolves: a download's or lock's temp file, a hidden file, or the hub's empty umask probe."""
    return (p.name.endswith(TEMP_SUFFIXES) or p.name.startswith(".")
            or (_HF_PROBE.fullmatch(p.name) is not None and p.stat().st_size == 0))


def big_lora(seed: int = 0, modules: int = 16, rank: int = 64, width: int = 2048) -> bytes:
    """A diffusers-format LoRA of ~16 MB: big enough that concurrent downloads overlap."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(modules):
        sd[f"unet.down_blocks.{i}.attn.to_q.lora_A.weight"] = torch.randn(rank, width, generator=g)
        sd[f"unet.down_blocks.{i}.attn.to_q.lora_B.weight"] = torch.randn(width, rank, generator=g)
    return save(sd)


def digest(adapters) -> str:
    h = hashlib.sha256()
    for comp in sorted(adapters):
        for path, m in sorted(adapters[comp].modules.items()):
            h.update(path.encode())
            for t in (m.A, m.B):
                h.update(t.float().contiguous().numpy().tobytes())
    return h.hexdigest()


def partial_files(*roots: str | Path) -> list[str]:
    """Files under a final name whose content is not whole: blobs named by sha256 (or git sha1) that do not
    hash to their name, snapshot links that resolve to such content, empty refs."""
    from fdlora.fixtures.localcache import git_blob_sha1

    bad = []
    for root in roots:
        for p in Path(root).rglob("*"):
            if not p.is_file() or temporary(p):
                continue
            data = p.read_bytes()
            if p.parent.name == "blobs" and p.name not in (hashlib.sha256(data).hexdigest(), git_blob_sha1(data)):
                bad.append(str(p))
            elif p.parent.name != "blobs" and "snapshots" in p.parts and p.is_symlink():
                blob = p.resolve()
                if blob.name not in (hashlib.sha256(data).hexdigest(), git_blob_sha1(data)):
                    bad.append(str(p))
            elif "refs" in p.parts and len(data.strip()) != 40:
                bad.append(str(p))
    return bad


CHILD = textwrap.dedent("""
    import hashlib, json, os, sys, threading, time
    from pathlib import Path
    hf_cache, local, go, repo, src = sys.argv[1:6]
    sys.path.insert(0, os.path.join(os.environ["FDLORA_ROOT"], "tests"))
    from reliability.test_shared_cache import digest, temporary

    seen, bad, done = {}, [], threading.Event()

    def watch():  # every file under a final name must hold its whole content whenever it is visible
        from fdlora.fixtures.localcache import git_blob_sha1
        while not done.is_set():
            for root in (hf_cache, local):
                for p in Path(root).rglob("*"):
                    try:
                        if not p.is_file() or temporary(p):
                            continue
                        st = p.stat()
                        key = (str(p), st.st_ino, st.st_size, st.st_mtime_ns)
                        if seen.get(str(p)) == key:
                            continue
                        data = p.read_bytes()
                        name = p.resolve().name
                        if ("blobs" in p.resolve().parts
                                and name not in (hashlib.sha256(data).hexdigest(), git_blob_sha1(data))):
                            bad.append(f"{p}: {len(data)} bytes")
                        elif "refs" in p.parts and len(data.strip()) != 40:
                            bad.append(f"{p}: ref {data!r}")
                        seen[str(p)] = key
                    except FileNotFoundError:
                        pass
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    import fdlora
    from fdlora.fixtures.localcache import populate
    data = Path(src).read_bytes()
    while not os.path.exists(go):
        time.sleep(0.002)
    populate(local, "mirror/lora", {"pytorch_lora_weights.safetensors": data})  # fd-lora's own writer, 4 at once
    hub, _ = fdlora.load_adapters(repo)  # into the shared HF cache, 4 at once
    mine, _ = fdlora.load_adapters("mirror/lora", cache_dir=local, local_files_only=True)
    time.sleep(0.2)
    done.set()
    print(json.dumps({"hub": digest(hub), "local": digest(mine), "bad": bad, "checked": len(seen)}))
""")


def test_four_processes_one_empty_cache_never_see_a_partial_file(pytestconfig, tmp_path):
    store = pytestconfig.fakehub.root
    data = big_lora(seed=1)
    repo = f"shared/{uuid.uuid4().hex[:8]}"
    populate(store, repo, {"pytorch_lora_weights.safetensors": data})
    src = tmp_path / "pytorch_lora_weights.safetensors"
    src.write_bytes(data)
    want = digest(fdlora.load_adapters(str(src))[0])
    hf_cache, local, go = tmp_path / "hf", tmp_path / "local", tmp_path / "go"
    hf_cache.mkdir()
    env = dict(os.environ, HF_HUB_CACHE=str(hf_cache), FDLORA_ROOT=str(ROOT), HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(hf_cache), str(local), str(go), repo, str(src)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(3)  # all four imported fdlora and wait on the same start line
    go.write_text("go")
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for o in outs:
        assert o["bad"] == [] and o["checked"] > 0, o
        assert o["hub"] == want and o["local"] == want, o
    assert partial_files(hf_cache, local) == []
    blobs = [p for p in (hf_cache / f"models--{repo.replace('/', '--')}" / "blobs").iterdir()
             if not temporary(p)]
    assert len(blobs) == 1, blobs  # one copy of the file, not one per process


def _mount(*args: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def _load_in_child(repo: str, cache: Path, **env_extra) -> subprocess.CompletedProcess:
    code = ("import fdlora, sys\nsys.path.insert(0, 'tests')\nfrom reliability.test_shared_cache import digest\n"
            f"print(digest(fdlora.load_adapters({repo!r})[0]))")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_PROGRESS_BARS="1", **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_read_only_cache_serves_what_it_holds_and_says_so_for_the_rest(pytestconfig, tmp_path):
    store = pytestconfig.fakehub.root
    data = big_lora(seed=2, modules=2)
    have, lack = f"ro/{uuid.uuid4().hex[:8]}", f"ro/{uuid.uuid4().hex[:8]}"
    populate(store, have, {"pytorch_lora_weights.safetensors": data})
    populate(store, lack, {"pytorch_lora_weights.safetensors": big_lora(seed=3, modules=2)})
    cache, ro = tmp_path / "cache", tmp_path / "ro"
    cache.mkdir()
    ro.mkdir()
    first = _load_in_child(have, cache)
    assert first.returncode == 0, first.stderr[-2000:]
    if not (_mount("--bind", str(cache), str(ro)) and _mount("-o", "remount,ro,bind", str(ro))):
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        pytest.skip("cannot make a read-only bind mount here (needs root with mount rights)")
    try:
        with pytest.raises(OSError):
            (ro / "probe").write_text("x")  # really read-only, even for root
        before = _tree(ro)
        for env in ({}, {"HF_HUB_OFFLINE": "1"}):
            out = _load_in_child(have, ro, **env)
            assert out.returncode == 0 and out.stdout.strip() == first.stdout.strip(), out.stderr[-2000:]
        out = _load_in_child(lack, ro)
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("fdlora.errors.ResolveError:") and "read-only" in last and lack in last, last
        assert _tree(ro) == before  # nothing written
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_a_full_disk_gives_a_clear_error_and_leaves_nothing_partial(pytestconfig, tmp_path, monkeypatch):
    store = pytestconfig.fakehub.root
    data = big_lora(seed=4)  # 16 MB into 4 MB
    repo = f"full/{uuid.uuid4().hex[:8]}"
    populate(store, repo, {"pytorch_lora_weights.safetensors": data})
    src = tmp_path / "w.safetensors"
    src.write_bytes(data)
    want = digest(fdlora.load_adapters(str(src))[0])
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk))
    try:
        if not mounted:  # no mount rights: the disk fills after 4 MB of the download
            import huggingface_hub.file_download as fd

            real = fd.http_get

            def http_get(url, temp_file, **kw):
                temp_file.write(b"\0" * (4 << 20))
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(fd, "http_get", http_get)
        hf = disk / "hf"
        with pytest.raises(ResolveError) as e:
            fdlora.load_adapters(repo, cache_dir=str(hf))
        msg = str(e.value)
        assert "no space left" in msg and "\n" not in msg and repo in msg, msg
        assert partial_files(disk) == []
        with pytest.raises(OSError) as e2:  # fd-lora's own cache writer on the same full disk
            populate(disk / "local", "mirror/x", {"pytorch_lora_weights.safetensors": data})
        assert e2.value.errno == errno.ENOSPC and "nothing partial" in str(e2.value)
        assert partial_files(disk) == [] and not list(disk.rglob("*.tmp"))
        # room again: the same loads work and give the file's own tensors
        if mounted:
            assert _mount("-o", "remount,size=64m", str(disk))
        else:
            monkeypatch.setattr(fd, "http_get", real)
        got, _ = fdlora.load_adapters(repo, cache_dir=str(hf))
        assert digest(got) == want
        populate(disk / "local", "mirror/x", {"pytorch_lora_weights.safetensors": data})
        assert digest(fdlora.load_adapters("mirror/x", cache_dir=str(disk / "local"), local_files_only=True)[0]) \
            == want
        assert partial_files(disk) == []
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # lazy: a mapped file may hold it
