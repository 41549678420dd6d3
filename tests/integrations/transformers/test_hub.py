"""load_fd_lora from a Hub repo id: the real huggingface_hub client against the loopback Hub of tests/conftest.py."""

from __future__ import annotations

import copy
import os
import uuid

import pytest
import torch
from support import hubcache

import fdlora
from integrations.transformers.models import built, ids


def publish(server, folder: str, subfolder: str = "") -> tuple[str, str]:
    files = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            files[f"{subfolder}{name}"] = f.read()
    repo = f"test/{uuid.uuid4().hex[:10]}"
    commit, _ = hubcache.populate(server.root, repo, files, commit=hubcache.fake_commit(repo, files))
    return repo, commit


def test_load_from_hub_repo_with_revision_and_subfolder(pytestconfig):
    b = built("llama")
    repo, commit = publish(pytestconfig.fakehub, b.dirs["two"], "adapters/two/")
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), repo, "two", subfolder="adapters/two", revision=commit)
    local = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["two"], "two")
    x = ids(2)
    with torch.no_grad():
        assert torch.equal(model(x).logits, local(x).logits)
    with pytest.raises(fdlora.errors.ResolveError, match="does-not-exist"):
        fdlora.load_fd_lora(copy.deepcopy(b.base), "test/does-not-exist", "x")
