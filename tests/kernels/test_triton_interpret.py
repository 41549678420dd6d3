"""Run the Triton kernel tests on CPU under the interpreter, in a child pytest process.

TRITON_INTERPRET=1 must be set before any @triton.jit module is imported, and it must not leak
into the rest of the suite (with it, the registry would put every CPU layer on the slow
interpreted backend). So the interpreter gets its own process, started here with the variable
set, running the CPU half of test_triton_ops.py (delta ops) and of test_lora_linear.py (base GEMM
+ LoRA); their summaries are this test's result. To see every case on its own:
TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_ops.py -m "not gpu".
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
@pytest.mark.skipif(env.triton_interpret(), reason="this process already interprets: the kernel tests run here")
@pytest.mark.parametrize("module,least", [("test_triton_ops.py", 20), ("test_lora_linear.py", 15),
                                          ("test_bank_scatter.py", 2), ("test_lora_merge_many.py", 12),
                                          ("../layers/test_remerge.py", 3)])
def test_triton_kernels_under_the_interpreter(module: str, least: int) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", str(HERE / module)]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=HERE.parent.parent,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= least, f"too few interpreter tests ran:\n{out[-3000:]}"
