# Showed (H100, session 15; printed, no JSON): every TORCH_CHECK failure inside the compiled extension segfaults
# the process (6 of 6 cases, through pybind and through torch.ops), where it should raise RuntimeError.
"""Does a bad operand reach the CUDA extension as an error or as a crash? One case per process:

    python3 -X faulthandler benchmarks/probes/probe_device_check.py direct_scale_cpu
"""

from __future__ import annotations

import sys

import torch

from fdlora.kernels.cuda.ops import _C

CASES = ("direct_badshape", "direct_A_cpu", "direct_ranks_cpu", "gw_cpu", "direct_scale_cpu", "op_scale_cpu")


def main(case: str) -> None:
    d, (M, K, N, S, R) = "cuda", (8, 64, 40, 3, 16)
    x = torch.randn(M, K, device=d, dtype=torch.float16)
    y = torch.zeros(M, N, device=d, dtype=torch.float16)
    A = torch.randn(S, R, K, device=d, dtype=torch.float16)
    B = torch.randn(N, S, R, device=d, dtype=torch.float16)
    scale, gw = torch.ones(S, device=d), torch.ones(2, S, device=d)
    ranks = torch.full((S,), R, dtype=torch.int32, device=d)
    calls = {
        "direct_badshape": lambda: _C.lora_delta(y, x[:, :32], A, B, scale, gw, ranks),
        "direct_A_cpu": lambda: _C.lora_delta(y, x, A.cpu(), B, scale, gw, ranks),
        "direct_ranks_cpu": lambda: _C.lora_delta(y, x, A, B, scale, gw, ranks.cpu()),
        "gw_cpu": lambda: _C.lora_delta(y, x, A, B, scale, gw.cpu(), ranks),
        "direct_scale_cpu": lambda: _C.lora_delta(y, x, A, B, scale.cpu(), gw, ranks),
        "op_scale_cpu": lambda: torch.ops.fdlora_cuda.lora_delta(y, x, A, B, scale.cpu(), gw, ranks),
    }
    try:
        calls[case]()
        print(case, "no error")
    except RuntimeError as e:
        print(case, "raised:", str(e).splitlines()[0][:150])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else CASES[0])
