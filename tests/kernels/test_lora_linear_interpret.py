"""Run the lora_linear tests on CPU under the Triton interpreter, in a child pytest process.

Same mechanism as test_triton_interpret.py (which does this for the delta ops): TRITON_INTERPRET=1
must be set before any @triton.jit module is imported and must not leak into the rest of the
suite, so the interpreter gets its own process running the CPU half of test_lora_linear.py; its
summary is this test's result. Every case on its own:
TRITON_INTERPRET=1 python -m pytest tests/kernels/test_lora_linear.py -m "not gpu".
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fdlora import env

HERE = Path(__file__).parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(env.triton_interpret(), reason="this process already interprets: test_lora_linear.py runs here")
def test_lora_linear_under_the_interpreter() -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           str(HERE / "test_lora_linear.py")]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=HERE.parent.parent,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 15, f"too few interpreter tests ran:\n{out[-3000:]}"
