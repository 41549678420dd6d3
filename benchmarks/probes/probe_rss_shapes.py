# Measures: host RSS of a process running the full-size SDXL UNet at batch sizes it has not run before, then again.
"""Whether a server's RSS grows with the batch shapes it meets for the first time (kernel modules loaded on first
use, library workspaces) rather than with the requests it serves: the base SDXL UNet (real config, random fp16
weights) runs one step at CFG batch 2b for b = 1, 2, 4, 8, then the same sequence again; RSS is read after each
call, after glibc's malloc_trim. Results: JSON with the RSS after each call.

    python benchmarks/probes/probe_rss_shapes.py --out /tmp/rss_shapes.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fdlora.fixtures import fullsize  # noqa: E402


def rss_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    unet = fullsize.sdxl_unet("cuda", torch.float16)
    steps = []
    with torch.inference_mode():
        for rep in range(2):
            for b in (1, 2, 4, 8):
                inp = fullsize.sdxl_inputs(unet, batch=2 * b)
                unet(**inp)
                torch.cuda.synchronize()
                del inp
                steps.append({"round": rep, "images": b, "rss_mb": round(rss_mb(), 1)})
                print(steps[-1], flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(unset: LAZY)"), "steps": steps}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
