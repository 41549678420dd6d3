"""Fixtures of the hub tests: the loopback Hub (started by tests/conftest.py), publishing, tiny models."""

from __future__ import annotations

import uuid

import pytest
from support import hubcache, tiny


class Hub:
    """Publish fixture repos to the loopback server and count the requests the client makes."""

    def __init__(self, server) -> None:
        self.server = server
        self.url = server.url

    def publish(self, files: dict[str, bytes], repo: str | None = None, refs: tuple[str, ...] = ("main",),
                salt: str = "") -> tuple[str, str]:
        """Add a commit holding `files`; returns (repo_id, commit). A fresh repo id unless `repo` is given."""
        repo = repo or f"test/{uuid.uuid4().hex[:10]}"
        commit, _ = hubcache.populate(self.server.root, repo, files, refs=refs,
                                      commit=hubcache.fake_commit(repo, files, salt))
        return repo, commit

    def mark(self) -> int:
        return len(self.server.log)

    def since(self, mark: int) -> list[tuple[str, str, int | None]]:
        return self.server.log[mark:]


@pytest.fixture(scope="session")
def hub(pytestconfig) -> Hub:
    return Hub(pytestconfig.fakehub)


@pytest.fixture(scope="session")
def sd15_unet():
    return tiny.sd15_unet()


@pytest.fixture(scope="session")
def sdxl_unet():
    return tiny.sdxl_unet()


@pytest.fixture(scope="session")
def clip_te():
    return tiny.clip_te(seed=1)


@pytest.fixture(scope="session")
def clip_te2():
    return tiny.clip_te(with_proj=True, seed=2)
