"""lora_merge: W' = W + sum_s scale[s] B_s A_s, summed and added in fp32, rounded once (PEFT's merge numerics).

The merged-weight cache (fdlora.layers.fastpath.merged) writes W' into a buffer it keeps; with a stamp the merge runs
only when the blend weights or the bank changed since the last one.
"""

from __future__ import annotations

import torch

from .spec import OpSpec, acc


def lora_merge(
    out: torch.Tensor,  # [N, K] written in place, W's dtype
    W: torch.Tensor,  # [N, K]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32 (padding rows of A/B are zero, so ranks only say what is live)
    stamp: torch.Tensor | None = None,  # [S + 2] int32: merge only if scale / version differ from it, then stamp
    version: torch.Tensor | None = None,  # [1] int32, with stamp: the bank's device-side version
) -> torch.Tensor:
    S, R, K = A.shape
    if stamp is not None:
        now = scale.float().contiguous().view(torch.int32)
        if torch.equal(stamp[:S], now) and int(stamp[S]) == int(version[0]):
            return out
        stamp[:S], stamp[S], stamp[S + 1] = now, version[0], 0
    Bw = (acc(B) * acc(scale)[None, :, None]).reshape(B.shape[0], S * R)
    out.copy_(torch.addmm(acc(W), Bw, acc(A).reshape(S * R, K)))  # out / W may be strided views
    return out


def new_stamp(S: int, device: torch.device | str) -> torch.Tensor:
    """A stamp for S slots that matches no state (version -1): the first stamped merge always runs.
    Layout, int32 [S + 2]: fp32 bits of the blend weights merged last, the bank version, programs done (Triton)."""
    stamp = torch.zeros(S + 2, dtype=torch.int32, device=device)
    stamp[S] = -1
    return stamp


SPEC = OpSpec("lora_merge", lora_merge, mutates=frozenset({"out", "stamp"}))
