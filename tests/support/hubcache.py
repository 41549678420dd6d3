"""The local HF cache writer lives in the library (the quickstart publishes its demo adapters with it)."""

from fdlora.fixtures.localcache import LFS_EXT, fake_commit, files_from_dir, git_blob_sha1, populate

__all__ = ["LFS_EXT", "fake_commit", "files_from_dir", "git_blob_sha1", "populate"]
