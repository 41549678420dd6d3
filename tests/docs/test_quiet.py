"""Known third-party warnings stay off stderr (fdlora/quiet.py); FDLORA_VERBOSE=1 or the user's logging shows them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import fdlora  # noqa: F401  (installs the filters)
from fdlora import quiet


class _Catch(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def torchao_logger():
    log = logging.getLogger("torchao")
    catch, level = _Catch(), log.level
    log.addHandler(catch)
    yield log, catch
    log.removeHandler(catch)
    log.setLevel(level)


def test_known_message_is_dropped_and_others_pass(torchao_logger, monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_VAR, raising=False)
    log, catch = torchao_logger
    log.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    log.warning("something else torchao wants said")
    log.error("Failed to load (an error is never hidden)")
    assert catch.messages == ["something else torchao wants said", "Failed to load (an error is never hidden)"]


def test_verbose_env_and_user_logging_bring_it_back(torchao_logger, monkeypatch):
    log, catch = torchao_logger
    monkeypatch.setenv(quiet.VERBOSE_VAR, "1")
    log.warning("Failed to load _C_mxfp8")
    monkeypatch.delenv(quiet.VERBOSE_VAR)
    log.setLevel(logging.INFO)  # the user asked for torchao's records
    log.warning("Failed to load _C_cutlass_90a")
    assert catch.messages == ["Failed to load _C_mxfp8", "Failed to load _C_cutlass_90a"]


def test_every_known_logger_has_its_filter():
    for name in quiet.KNOWN:
        assert any(isinstance(f, quiet.KnownNoise) for f in logging.getLogger(name).filters), name


def _stderr(code: str, **env) -> str:
    run_env = {k: v for k, v in os.environ.items() if k != quiet.VERBOSE_VAR} | env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_import_fdlora_and_diffusers_prints_nothing_to_stderr():
    pytest.importorskip("diffusers")
    code = "import fdlora\nfrom diffusers import StableDiffusionPipeline\n"
    assert _stderr(code) == ""
    assert _stderr("import sys\nfrom fdlora.apps.cli import main\nsys.argv = ['fdlora', '--help']\n"
                   "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n"
                   "    try:\n        main()\n    except SystemExit:\n        pass\n") == ""
