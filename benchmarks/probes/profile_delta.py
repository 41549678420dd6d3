# Showed: ncu counters of one tuned delta launch, behind the delta configs + y prefetch (b4ff797); no JSON.
"""One tuned launch of the delta kernels inside an NVTX range "profile", for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats python benchmarks/probes/profile_delta.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_delta import CASES, build, fd_fn  # noqa: E402

from fdlora.kernels import registry  # noqa: E402

PROFILE = [("r16", 8192, 1280, 1280, torch.float16), ("rows8xr16", 16, 4096, 4096, torch.bfloat16)]


def main() -> None:
    ops = registry.ops("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, M, K, N, dtype in PROFILE:
        c = next(c for c in CASES if c.name == name)
        x, W, A, B, scale, gw, ranks, row_slot = build(M, K, N, dtype, c, gen)
        y = x.new_empty(M, N).normal_()
        fd = fd_fn(c, ops, x, A, B, scale, gw, ranks, row_slot)
        fd(y)  # autotune outside the range
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        fd(y)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
