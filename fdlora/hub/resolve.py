"""Where an adapter's bytes are: a Hub repo id, a local directory, a single file, or a state dict.

Resolution is split in two so the RAM cache can answer before any file is read:

1. `resolve(source, ...)` pins the source: for a Hub repo, the revision becomes a commit sha and
   the weight file is chosen; nothing is downloaded. A 40-hex `revision` costs no request at all.
2. `fetch(resolved, ...)` makes the chosen files local (a download on a cache miss).

All Hub and cache work goes through huggingface_hub, so `HF_ENDPOINT`, `HF_HUB_OFFLINE`,
`HF_HUB_CACHE`, tokens and its download progress bars behave as everywhere else; fd-lora never
writes into the cache itself.

Weight-file rule, when no `weight_name` is given (`WEIGHT_RULE`), applied to the files at the top
level of the repo or directory (under `subfolder` when given):

1. ``adapter_model.safetensors``   PEFT; its ``adapter_config.json`` is fetched with it
2. ``pytorch_lora_weights.safetensors``   diffusers
3. the only ``*.safetensors`` file
4. with ``allow_pickle=True`` only: the same three steps for ``adapter_model.bin``,
   ``pytorch_lora_weights.bin`` and the only ``.bin/.pt/.pth/.ckpt`` file

Anything else (no candidate, or several and none named as above) raises `ResolveError` listing
the candidates; pass ``weight_name=`` then. Online, the file list is the Hub's listing at the
resolved commit (one request, remembered per commit for the process); offline, it is
huggingface_hub's cached tree listing for that commit or, failing that, the files in the cached
snapshot. Only the chosen file (and a PEFT config) is ever downloaded.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..errors import ResolveError
from .safefile import is_pickle_name

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
PICKLE_WEIGHTS = ("adapter_model.bin", "pytorch_lora_weights.bin")
WEIGHT_RULE = (
    "adapter_model.safetensors (PEFT) > pytorch_lora_weights.safetensors (diffusers) > the only *.safetensors "
    "file at the top level; .bin/.pt/.ckpt the same way only with allow_pickle=True"
)
COMMIT = re.compile(r"[0-9a-f]{40}")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")  # a source ending so names a file

_CACHE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
_LISTINGS: dict[tuple[str, str, str], tuple[str, ...]] = {}  # (endpoint, repo, sha) -> files; commits never change


@dataclass(frozen=True)
class Resolved:
    """A pinned source. `fingerprint` identifies its bytes: the commit for Hub sources, size+mtime for files."""

    kind: Literal["hub", "dir", "file", "memory"]
    source: str
    revision: str | None = None  # as requested
    sha: str | None = None  # the commit a Hub revision resolved to
    file: str | None = None  # weight file relative to the repo / directory (subfolder included)
    config_file: str | None = None  # PEFT adapter_config.json next to it, when expected
    choice: str = ""  # why this file
    path: str | None = None  # local path of the weight file (after fetch)
    config_path: str | None = None  # local path of the config, when there is one (after fetch)
    fingerprint: str | None = None
    state_dict: Mapping[str, Any] | None = None  # memory sources only


def resolve(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    weight_name: str | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    allow_pickle: bool = False,
) -> Resolved:
    """Pin `source` to exact bytes without downloading them (see the module docstring for the file rule)."""
    if isinstance(source, Mapping):
        return Resolved("memory", "<memory>", choice="in-memory state dict", state_dict=source)
    if not isinstance(source, (str, os.PathLike)):
        raise ResolveError(f"a source is a Hub repo id, a path or a state dict, got {type(source).__name__}.")
    for what, value in (("weight_name", weight_name), ("subfolder", subfolder), ("revision", revision)):
        check_relative(what, value)
    src = os.fspath(source)
    if isinstance(src, bytes) or "\0" in src:
        raise ResolveError(f"{src!r} is not a usable path or Hub repo id.")
    if os.path.isfile(src):
        return _local_file(src, "the source is a file")
    if os.path.isdir(src):
        return _local_dir(src, weight_name, subfolder, allow_pickle)
    if src.lower().endswith(WEIGHT_EXTS):
        raise ResolveError(f"{src!r} does not exist (no file at {os.path.abspath(os.path.expanduser(src))}); check "
                           "the path. A Hub repo id names a repo ('user/name'), not a weight file: pass the file as "
                           "weight_name= (fdlora inspect: --weight-name).")
    if src.startswith((".", "/", "~")) or not REPO_ID.fullmatch(src):
        raise ResolveError(f"{src!r} is neither an existing file or directory nor a Hub repo id ('user/name').")
    return _hub(src, weight_name, subfolder, revision, token, cache_dir, local_files_only, allow_pickle)


def fetch(r: Resolved, *, token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
          local_files_only: bool = False, force_download: bool = False) -> Resolved:
    """Make the weight file (and PEFT config) of a pinned Hub source local; local sources pass through."""
    if r.kind != "hub":
        return r
    from huggingface_hub import constants

    offline = local_files_only or constants.is_offline_mode()
    kw = dict(revision=r.sha, cache_dir=cache_dir, token=token, local_files_only=offline)
    path = _download(r, r.file, force_download=force_download, **kw)
    config_path = _optional_download(r, r.config_file, force_download, **kw) if r.config_file else None
    return replace(r, path=path, config_path=config_path)


def check_relative(what: str, value: str | None) -> None:
    """`weight_name`, `subfolder` and `revision` name things inside a repo or directory: a relative path with no
    `..`, no absolute or drive prefix, no NUL; anything else raises ResolveError (it would reach outside)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ResolveError(f"{what} must be a string, got {type(value).__name__}.")
    parts = value.replace("\\", "/").split("/")
    if (not value or "\0" in value or value.startswith(("/", "\\", "~")) or ".." in parts
            or (len(value) > 1 and value[1] == ":") or (what != "revision" and not value.strip("/"))):
        raise ResolveError(f"{what}={value!r} must name something inside the repo or directory (a relative path "
                           "without '..'); it would reach outside it.")


# --- local sources ---------------------------------------------------------------------------
def _local_file(path: str, choice: str) -> Resolved:
    path = os.path.abspath(path)
    d, name = os.path.split(path)
    config = os.path.join(d, PEFT_CONFIG) if name.startswith("adapter_model.") else None
    config = config if config and os.path.isfile(config) else None
    stamp = ";".join(f"{st.st_size}-{st.st_mtime_ns}" for st in map(os.stat, filter(None, (path, config))))
    return Resolved("file", path, file=name, choice=choice, path=path, config_file=config and PEFT_CONFIG,
                    config_path=config, fingerprint=stamp)


def _local_dir(d: str, weight_name: str | None, subfolder: str | None, allow_pickle: bool) -> Resolved:
    root = os.path.join(d, subfolder) if subfolder else d
    if weight_name:
        path = os.path.join(root, weight_name)
        inside = os.path.realpath(path).startswith(os.path.join(os.path.realpath(d), ""))
        if not inside:  # (a symlink inside the directory pointing out of it)
            raise ResolveError(f"{weight_name!r} in {root} resolves outside {d}; fd-lora reads only files inside "
                               "the directory it was given. Pass the file's own path instead.")
        if not os.path.isfile(path):
            raise ResolveError(f"{weight_name!r} is not in {root}; it holds {_ls(root)[:20]}.")
        r = _local_file(path, "weight_name given")
    else:
        files = [f for f in _ls(root) if os.path.isfile(os.path.join(root, f))]
        name, choice = choose_weight_file(files, allow_pickle, where=root)
        r = _local_file(os.path.join(root, name), choice)
    return replace(r, kind="dir", source=os.path.abspath(d),
                   file=posixpath.join(subfolder, r.file) if subfolder else r.file)


def _ls(d: str) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        raise ResolveError(f"{d} is not a readable directory.") from None


# --- the weight-file rule --------------------------------------------------------------------
def choose_weight_file(files: list[str], allow_pickle: bool, where: str) -> tuple[str, str]:
    """Pick the weight file among top-level `files` by `WEIGHT_RULE`; returns (name, why)."""
    top = sorted(f for f in files if "/" not in f)
    safe = [f for f in top if f.endswith(".safetensors")]
    pick = _rule(safe, (PEFT_WEIGHTS, DIFFUSERS_WEIGHTS), ".safetensors")
    if pick is None and allow_pickle:
        pick = _rule([f for f in top if is_pickle_name(f)], PICKLE_WEIGHTS, "pickle")
    if pick is not None:
        return pick
    nested = sorted(f for f in files if f.endswith(".safetensors") and "/" in f)
    pickles = [f for f in top if is_pickle_name(f)]
    hint = f" Pickle files {pickles} count only with allow_pickle=True." if pickles and not allow_pickle else ""
    raise ResolveError(
        f"cannot choose a weight file in {where}: rule is {WEIGHT_RULE}. Candidates: top level {safe}, "
        f"in subfolders {nested[:20]}.{hint} Pass weight_name='...' (and subfolder='...' for nested files)."
    )


def _rule(cands: list[str], names: tuple[str, str], kind: str) -> tuple[str, str] | None:
    for name, what in zip(names, ("PEFT adapter", "diffusers LoRA")):
        if name in cands:
            return name, f"{name}: the {what} file name (weight-file rule, fdlora.hub.WEIGHT_RULE)"
    if len(cands) == 1:
        return cands[0], f"{cands[0]}: the only {kind} file (weight-file rule, fdlora.hub.WEIGHT_RULE)"
    return None


# --- Hub sources -----------------------------------------------------------------------------
def _hub(repo: str, weight_name, subfolder, revision, token, cache_dir, local_files_only, allow_pickle) -> Resolved:
    from huggingface_hub import constants

    offline = local_files_only or constants.is_offline_mode()
    sha = commit_of(repo, revision, token=token, cache_dir=cache_dir, offline=offline)
    if weight_name:
        file, choice = (posixpath.join(subfolder, weight_name) if subfolder else weight_name), "weight_name given"
    else:
        files = _listing(repo, sha, token, cache_dir, offline, subfolder)
        if subfolder:
            pre = subfolder.strip("/") + "/"
            files = [f[len(pre):] for f in files if f.startswith(pre)]
        name, choice = choose_weight_file(files, allow_pickle, where=f"{repo}@{sha[:12]}/{subfolder or ''}")
        file = posixpath.join(subfolder, name) if subfolder else name
    d, base = posixpath.split(file)
    config = posixpath.join(d, PEFT_CONFIG) if base.startswith("adapter_model.") else None
    return Resolved("hub", repo, revision=revision, sha=sha, file=file, config_file=config, choice=choice,
                    fingerprint=sha)


def commit_of(repo: str, revision: str | None, *, token=None, cache_dir=None, offline: bool = False) -> str:
    """The commit sha `revision` (default: main) points at: no request for a full sha, else one (or the cache)."""
    if revision and COMMIT.fullmatch(revision.lower()):
        return revision.lower()
    from huggingface_hub import HfApi

    try:
        return HfApi().resolve_revision(repo, revision=revision, cache_dir=cache_dir, token=token,
                                        local_files_only=offline).resolved
    except Exception as e:
        raise hub_error(e, repo, revision) from None


def _listing(repo: str, sha: str, token, cache_dir, offline: bool, subfolder: str | None = None) -> list[str]:
    from huggingface_hub import constants

    key = (constants.ENDPOINT, repo, sha)
    if key in _LISTINGS:
        return list(_LISTINGS[key])
    if offline:
        return _cached_listing(repo, sha, cache_dir, subfolder)
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(repo, revision=sha, token=token)
    except Exception as e:
        raise hub_error(e, repo, sha) from None
    _LISTINGS[key] = tuple(files)
    return list(files)


def _cached_listing(repo: str, sha: str, cache_dir, subfolder: str | None) -> list[str]:
    """Offline: huggingface_hub's cached tree listing for the commit, else the files of the cached snapshot.

    The two named files of the rule are looked up directly (`try_to_load_from_cache`): when one is
    cached it wins anyway, and the scan of the whole cache is skipped.
    """
    from huggingface_hub import get_cached_repo_tree, scan_cache_dir, try_to_load_from_cache
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, CacheNotFound

    try:
        return [f.path for f in get_cached_repo_tree(repo, revision=sha, cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        pass
    for name in (PEFT_WEIGHTS, DIFFUSERS_WEIGHTS):
        file = posixpath.join(subfolder, name) if subfolder else name
        if isinstance(try_to_load_from_cache(repo, file, cache_dir=cache_dir, revision=sha), str):
            return [file]
    try:
        repos = scan_cache_dir(cache_dir).repos
    except CacheNotFound:  # no cache folder at all: nothing is cached
        repos = frozenset()
    for cached in repos:
        if cached.repo_id == repo and cached.repo_type == "model":
            for rev in cached.revisions:
                if rev.commit_hash == sha:
                    return [str(f.file_path.relative_to(rev.snapshot_path)).replace(os.sep, "/") for f in rev.files]
    raise ResolveError(f"{repo}@{sha[:12]} is not in the local Hugging Face cache and the Hub cannot be used "
                       "(offline mode or local_files_only). Download it once with network access.")


def _download(r: Resolved, file: str, **kw) -> str:
    from huggingface_hub import errors as he
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(r.source, file, **kw)
    except Exception as e:
        if isinstance(e, he.RemoteEntryNotFoundError):
            try:  # name the files that do exist in the error
                _listing(r.source, r.sha, kw.get("token"), kw.get("cache_dir"), offline=False)
            except Exception:
                pass  # the error below is still right, only less helpful
        raise hub_error(e, r.source, r.revision or r.sha, file, r.sha) from None


def _optional_download(r: Resolved, file: str, force_download: bool, **kw) -> str | None:
    """A file that may not exist (a PEFT config): None when the Hub says it does not, an error when unsure.

    A known absence is remembered by huggingface_hub (`.no_exist`), so it costs one request once.
    """
    from huggingface_hub import errors as he
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(r.source, file, cache_dir=kw["cache_dir"], revision=r.sha)
    if cached is not None and not force_download:
        return cached if isinstance(cached, str) else None  # a path, or huggingface_hub's "known absent" marker
    try:
        return hf_hub_download(r.source, file, force_download=force_download, **kw)
    except he.EntryNotFoundError as e:
        if isinstance(e, he.LocalEntryNotFoundError):  # offline and not cached: present or not, we cannot tell
            raise hub_error(e, r.source, r.revision or r.sha, file, r.sha) from None
        return None
    except Exception as e:
        raise hub_error(e, r.source, r.revision or r.sha, file, r.sha) from None


def hub_error(e: Exception, repo: str, revision: str | None, file: str | None = None,
              sha: str | None = None) -> Exception:
    """The fd-lora error (with the fix) for an exception huggingface_hub raised; unknown ones pass through."""
    from huggingface_hub import constants
    from huggingface_hub import errors as he

    rev = revision or "main"
    if isinstance(e, he.RepositoryNotFoundError):
        return ResolveError(f"{repo!r} is not a local path, and no Hub repo of that id was found at "
                            f"{constants.ENDPOINT} (or it is private or gated: log in or pass token=). Check the id.")
    if isinstance(e, he.RevisionNotFoundError):
        return ResolveError(f"revision {rev!r} does not exist in {repo!r}; pass a branch, tag or commit that exists "
                            "(huggingface_hub.list_repo_refs lists them).")
    if isinstance(e, (he.LocalEntryNotFoundError, he.OfflineModeIsEnabled, he.RevisionResolutionError)):
        what = f"{file!r} of {repo}@{rev}" if file else f"revision {rev!r} of {repo!r}"
        return ResolveError(f"{what} is not in the local Hugging Face cache and the Hub cannot be used (offline "
                            f"mode, local_files_only, or no connection to {constants.ENDPOINT}). Download it once "
                            "with network access, or unset HF_HUB_OFFLINE.")
    if isinstance(e, he.EntryNotFoundError | he.RemoteEntryNotFoundError):
        at = f"{repo}@{(sha or rev)[:12]}"
        return ResolveError(f"{file!r} is not in {at}; pass weight_name= (and subfolder=) with a file that exists "
                            f"there{_files_hint(repo, sha)}.")
    if isinstance(e, he.HFValidationError):
        return ResolveError(f"{repo!r} / revision {rev!r}{f' / file {file!r}' if file else ''} is not valid for the "
                            f"Hub ({str(e).splitlines()[0][:160]}); check the repo id, revision and file name.")
    if isinstance(e, he.HfHubHTTPError):
        return ResolveError(f"the Hub at {constants.ENDPOINT} refused {repo}@{rev}: {e}")
    if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests"):
        return ResolveError(f"could not reach the Hub at {constants.ENDPOINT} for {repo}@{rev} ({type(e).__name__}: "
                            f"{e}). Check the connection or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache.")
    if isinstance(e, OSError) and e.errno in _CACHE_ERRNOS:  # the cache cannot take the download
        where = f"{file!r} of {repo}@{rev}" if file else f"{repo}@{rev}"
        folder = e.filename or constants.HF_HUB_CACHE
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return ResolveError(f"no space left for {where} in the Hugging Face cache ({folder}): free space, or "
                                "point HF_HUB_CACHE / cache_dir= at a bigger disk. The download was not kept (no "
                                "partial file is ever visible under its final name).")
        return ResolveError(f"the Hugging Face cache ({folder}) is read-only and {where} is not in it. A read-only "
                            "cache serves what it holds (pin the commit, or HF_HUB_OFFLINE=1 / local_files_only=True); "
                            "download this once into a writable cache, or pass cache_dir= a writable folder.")
    if isinstance(e, (ValueError, TypeError)):  # huggingface_hub's argument checks (a bad file name, ...)
        return ResolveError(f"huggingface_hub refused {repo}@{rev}{f' file {file!r}' if file else ''}: "
                            f"{str(e).splitlines()[0][:160] if str(e) else type(e).__name__}.")
    return e


def _files_hint(repo: str, sha: str | None) -> str:
    from huggingface_hub import constants

    files = _LISTINGS.get((constants.ENDPOINT, repo, sha)) if sha else None
    return f" (files: {list(files)[:20]})" if files else ""
