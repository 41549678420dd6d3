"""Publish files into a local Hugging Face Hub cache exactly as huggingface_hub lays it out (offline demos, tests).

    <cache>/models--{org}--{name}/
        blobs/<etag>                    sha256 for LFS-style files, git blob sha1 for small text files
        snapshots/<commit>/<path>       -> symlink ../../blobs/<etag> (or a plain copy with symlinks=False)
        refs/<branch-or-tag>            the 40-hex commit, no newline

One layout feeds both the offline tests (HF_HUB_OFFLINE=1 with HF_HUB_CACHE pointing here) and
FakeHub, which serves the same folders over the Hub protocol. Stdlib only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from pathlib import Path

LFS_EXT = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fake_commit(repo_id: str, files: dict[str, bytes], salt: str = "") -> str:
    h = hashlib.sha1(repo_id.encode() + salt.encode())
    for k in sorted(files):
        h.update(k.encode())
        h.update(hashlib.sha256(files[k]).digest())
    return h.hexdigest()


def populate(cache_dir: str | os.PathLike, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",),
             commit: str | None = None, symlinks: bool = True) -> tuple[str, str]:
    """Write `files` ({path_in_repo: bytes}) as one commit of `repo_id`; point `refs` at it.

    Safe with several processes writing the same cache at once (and readers meanwhile): every blob, snapshot
    link and ref is written to a temporary name beside it and renamed into place, so a path either does not
    exist yet or holds the whole file. A failed write (a full disk, a read-only folder) raises OSError naming
    the cache and leaves no partial file behind. Returns (commit, snapshot_dir).
    """
    commit = commit or fake_commit(repo_id, files)
    storage = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    snap = storage / "snapshots" / commit
    try:
        for rel, data in files.items():
            lfs = rel.endswith(LFS_EXT) or len(data) > 10_000_000
            etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
            blob = storage / "blobs" / etag
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                _atomic(blob, lambda tmp, data=data: tmp.write_bytes(data))
            dst = snap / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if symlinks:
                target = os.path.relpath(blob, dst.parent)
                if not (dst.is_symlink() and os.readlink(dst) == target):
                    _atomic(dst, lambda tmp, target=target: os.symlink(target, tmp))
            else:
                _atomic(dst, lambda tmp, blob=blob: shutil.copyfile(blob, tmp))
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        for ref in refs:
            _atomic(storage / "refs" / ref, lambda tmp: tmp.write_text(commit))
    except OSError as e:
        raise OSError(e.errno, f"cannot write the local Hugging Face cache {cache_dir} ({e.strerror or e}); "
                               "nothing partial was left. Free space, or pass a writable cache folder",
                      e.filename) from None
    return commit, str(snap)


def _atomic(path: Path, write) -> None:
    """`write(tmp)` to a unique temporary name in path's folder, then rename it over `path` (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def files_from_dir(d: str | os.PathLike) -> dict[str, bytes]:
    d = Path(d)
    return {str(p.relative_to(d)).replace(os.sep, "/"): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
