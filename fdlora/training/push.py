"""`output: {dir: ..., push_to_hub: user/name}`: the trained PEFT adapter directory uploaded to a Hub model repo.

huggingface_hub does the work (create_repo with exist_ok, then one upload_folder commit; the token is its own:
HF_TOKEN or `hf auth login`; HF_ENDPOINT is honoured). Only the adapter's files go up (adapter_config.json,
adapter_model.safetensors, losses.json), never the checkpoints or anything else the user keeps in that folder.
The upload runs after the adapter is written, so a Hub error leaves the local output whole; it becomes one
SaveError line that says why (no token, no write access, no such namespace, unreachable endpoint) and how to
upload the kept directory later.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SaveError

FILES = ["adapter_config.json", "adapter_model.safetensors", "losses.json"]


def push(out: str | Path, repo_id: str, log=print) -> str:
    """Upload the adapter in `out` to model repo `repo_id` (created if missing); returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(out), allow_patterns=FILES,
                                 commit_message="fdlora train: adapter")
    except Exception as e:  # any Hub / network failure: one line, the local output stays as written
        raise SaveError(_explain(e, repo_id, out)) from e
    log(f"pushed {out} to {repo_id}: {info.commit_url}")
    return info.commit_url


def _unreachable(e: BaseException) -> bool:
    """A connection-level failure (refused, DNS, timeout), from httpx or the OS, anywhere in the cause chain."""
    while e is not None:
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in (
                "ConnectError", "ConnectTimeout", "ReadTimeout", "NetworkError", "TransportError"):
            return True
        e = e.__cause__ or e.__context__
    return False


def _explain(e: Exception, repo_id: str, out: str | Path) -> str:
    from huggingface_hub import constants

    status = getattr(getattr(e, "response", None), "status_code", None)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if status == 401:
        why, fix = "the Hub did not accept the token (none or invalid)", "run `hf auth login` or set HF_TOKEN to a " \
            "token with write access"
    elif status == 403:
        why, fix = "the token may not write there", f"use a write token for the '{repo_id.split('/')[0]}' " \
            "namespace, or a repo id under your own user name"
    elif status == 404:
        why, fix = "no such namespace or repo is visible to this token", "check the repo id (`user/name`, your " \
            "user or an organization you belong to)"
    elif status is None and _unreachable(e):
        why, fix = f"could not reach {constants.ENDPOINT}", "check the network (or HF_ENDPOINT)"
    elif status is None:
        why, fix = "the upload stopped", "check the repo id and the Hub's answer quoted here"
    else:
        why, fix = f"the Hub answered {status}", "check the repo id and the token"
    return (f"output.push_to_hub: upload to {repo_id!r} failed: {why} ({type(e).__name__}: {first}); fix: {fix}; "
            f"the adapter is saved in {out} (upload it later with `hf upload {repo_id} {out}`)")
