"""Few-row eager LoRA through cuBLAS: per-sample and per-row adapters at decode sizes.

Why: an eager decode step is host-bound. A Triton launch costs ~35 us of host time (binding ~30
arguments and Triton's Python launcher), the split shrink + expand pair twice that, against ~5 us
for a torch op, while the GPU work of a 32-row LoRA is a few microseconds either way
(benchmarks/profile_layer.py). With few rows the live slots, taken as one rank-S*R adapter, cost
three torch ops:

    h  = x A_live^T                 torch.mm with an fp32 output: fp32 accumulation, h stays fp32
    hw = (h * w).to(dtype)          w [G, S] fp32 = group weight * scale, per sample group and slot
    y += hw B_live^T                addmm_: fp32 accumulation, added to y before its one rounding

which is the numerics contract of the Triton kernels (they too cast the scaled h to the weight dtype
for the expand). A_live / B_live are views of the bank up to its last used slot; every live slot is
computed for every row (the per-row kernel reads only the rows' own), so the path is taken only while
those extra weight reads stay within MAX_EXTRA of the base weight's.

When (`forward`, from FusedLoraLinear.forward): per-sample or per-row mode, eager (not frozen,
compiled or being captured: those keep the Triton kernels, whose launches do not depend on the live
extent), a CUDA input of at most DENSE_ROWS rows, and a torch whose mm takes out_dtype.
"""

from __future__ import annotations

import torch

from .state import Mode

DENSE_ROWS = 64  # decode batches; above, the GPU time of the Triton kernels outweighs the host time saved
MAX_EXTRA = 0.125  # live-slot weight elements S*R*(K+N) allowed, as a share of the base weight's K*N


def _mm_fp32_works() -> bool:
    """torch.mm(..., out_dtype=float32) on half inputs (CUDA, torch >= 2.8)."""
    try:
        x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


_MM_FP32: list[bool] = []  # filled on the first CUDA call


def _live(layer) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(A_live [S*R, K], B_live^T [S*R, N], S, R) of the layer's bank, or None when the dense path does not
    pay (nothing loaded, or the live slots too wide); kept per bank version and storage."""
    bank = layer.bank
    A = bank._buffers["A"]
    key = (bank.version, A.data_ptr(), A.shape)
    got = layer.__dict__.get("_dense")
    if got is not None and got[0] == key:
        return got[1]
    S = max((s + 1 for s, u in enumerate(bank.used) if u), default=0)
    N, K = layer.out_features, layer.in_features
    R = A.shape[1]
    live = None
    if S and S * R * (K + N) <= MAX_EXTRA * K * N:
        live = (A[:S].reshape(S * R, K), bank._buffers["B"][:, :S].reshape(N, S * R).t(), S, R)
    layer.__dict__["_dense"] = (key, live)
    return live


def forward(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The layer's output through the dense path, or None when this call does not take it."""
    st = layer.state
    if not x.is_cuda or st.static or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    K = layer.in_features
    M = x.numel() // K if K else 0
    if not 0 < M <= DENSE_ROWS or x.dtype != layer.bank._buffers["A"].dtype:
        return None
    live = _live(layer)
    if live is None:
        return None
    if not _MM_FP32:
        _MM_FP32.append(_mm_fp32_works())
    if not _MM_FP32[0]:
        return None
    A, Bt, S, R = live
    if st.mode is Mode.ROWS:
        row_slot = st.row_slot(x.device)
        if row_slot.shape[0] != M:
            return None  # the per-row kernel path raises the clear error
        w = st.row_onehot(x.device)[:, :S] * layer.scale_unit[:S]  # [M, S]
    else:
        scale, gw = layer._weights(x, M)  # raises for a batch the per-sample spec does not cover
        w = gw[:, :S] * scale[:S]  # [G, S]
    base = layer.base
    if type(base) is torch.nn.Linear and not (args or kwargs):
        p = base._parameters
        y = torch.nn.functional.linear(x, p["weight"], p["bias"])
    else:
        y = base(x, *args, **kwargs).contiguous()
    x2, y2 = x.reshape(M, K), y.view(M, layer.out_features)
    G = w.shape[0]
    h = torch.mm(x2, A.t(), out_dtype=torch.float32).view(G, M // G, S, R)
    hw = (h * w.view(G, 1, S, 1)).to(y.dtype).view(M, S * R)
    y2.addmm_(hw, Bt)
    if layer.bank._buffers["bias"] is not None:
        if st.mode is Mode.ROWS:
            layer._add_bias(y2, layer.scale_unit, layer.blend_weight, st.row_slot(x.device))
        else:
            layer._add_bias(y2, scale, gw, None)
    return y
