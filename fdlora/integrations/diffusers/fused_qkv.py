"""LoRA on to_q / to_k / to_v (and add_q_proj / add_k_proj / add_v_proj) onto attention whose projections were
fused by `pipe.fuse_qkv_projections()` (diffusers' to_qkv, to_kv and to_added_qkv). diffusers itself cannot: its
LoRA stays on the unused to_q/to_k/to_v and has no effect, silently.

A fused projection computes [q; k; v] = W_qkv x. Its adapter is the block form of the three: A = [A_q; A_k; A_v]
(rank r_q + r_k + r_v) and B = blockdiag(c_q B_q, c_k B_k, c_v B_v), each module's own scale c folded into its block
(the fused module's scale is 1). Exact: each output slice gets its own module's delta and nothing else; a
projection the file does not cover gets a zero block. When the modules share one A (kohya Flux files: one lora_down
for q, k and v, which diffusers' converter copies to each), the fused LoRA is that A once with the scaled B stacked,
rank r instead of 3r (`_one_a`). Modules with a LoRA bias or a DoRA magnitude are left where
they are (and warned about), as is everything on attention that is not fused.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch import nn

from fdlora.errors import PartialLoadWarning
from fdlora.hub.adapter import LoraAdapter, ModuleLora

logger = logging.getLogger("fdlora")

# fused module -> the projections it concatenates, in order
FUSIONS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
           "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def _fused_attention(model: nn.Module) -> dict[str, list[str]]:
    """Attention module path -> its fused projections in use (after fuse_qkv_projections)."""
    out = {}
    for path, m in model.named_modules():
        if getattr(m, "fused_projections", False):
            names = [f for f in FUSIONS if isinstance(getattr(m, f, None), nn.Module)]  # (fd-lora-wrapped too)
            if names:
                out[path] = names
    return out


def _block(parts: list[tuple[ModuleLora | None, int]], use_rslora: bool, dtype: torch.dtype) -> ModuleLora:
    """The fused module's LoRA from (module or None, output width) per part, in the fused order."""
    shared = _one_a(parts, use_rslora, dtype)
    if shared is not None:
        return shared
    ranks = [m.rank for m, _ in parts if m is not None]
    K = next(m.A.shape[1] for m, _ in parts if m is not None)
    R, N = sum(ranks), sum(n for _, n in parts)
    A = torch.zeros(R, K, dtype=dtype)
    B = torch.zeros(N, R, dtype=dtype)
    r0 = n0 = 0
    for m, n in parts:
        if m is not None:
            A[r0:r0 + m.rank] = m.A.to(dtype)
            B[n0:n0 + n, r0:r0 + m.rank] = m.B.to(dtype) * m.scaling(use_rslora)
            r0 += m.rank
        n0 += n
    return ModuleLora(A, B, alpha=math.sqrt(R) if use_rslora else float(R))


def _one_a(parts: list[tuple[ModuleLora | None, int]], use_rslora: bool, dtype: torch.dtype) -> ModuleLora | None:
    """When every part holds the same A (kohya Flux files carry one lora_down for q, k and v, which diffusers'
    converter hands to each): that A once and the parts' scaled B stacked, rank r instead of the block form's n*r
    (same product: B_i A = the block form's slice i). None when the parts' A differ."""
    present = [m for m, _ in parts if m is not None]
    if len(present) < 2:
        return None
    A0 = present[0].A
    if any(m.A.shape != A0.shape or m.A.dtype != A0.dtype or not torch.equal(m.A, A0) for m in present[1:]):
        return None
    r, N = A0.shape[0], sum(n for _, n in parts)
    B = torch.zeros(N, r, dtype=dtype)
    n0 = 0
    for m, n in parts:
        if m is not None:
            B[n0:n0 + n] = m.B.to(dtype) * m.scaling(use_rslora)
        n0 += n
    return ModuleLora(A0.to(dtype).clone(), B, alpha=math.sqrt(r) if use_rslora else float(r))


def retarget(model: nn.Module, adapter: LoraAdapter) -> LoraAdapter:
    """`adapter` with its q/k/v modules moved onto `model`'s fused projections (unchanged if nothing is fused)."""
    fused = _fused_attention(model)
    if not fused:
        return adapter
    modules = dict(adapter.modules)
    moved = kept = 0
    for attn, names in fused.items():
        prefix = f"{attn}." if attn else ""
        for fname in names:
            projections = FUSIONS[fname]
            paths = [prefix + p for p in projections]
            found = [modules.get(p) for p in paths]
            if not any(found):
                continue
            plain = [m for m in found if m is not None and m.A.dim() == 2 and m.bias is None and m.magnitude is None]
            if len(plain) != sum(m is not None for m in found):
                kept += sum(m is not None for m in found)
                continue
            widths = [getattr(model.get_submodule(attn), p).out_features for p in projections]
            dtype = next(m.A.dtype for m in found if m is not None)
            modules[prefix + fname] = _block(list(zip(found, widths)), adapter.use_rslora, dtype)
            for p in paths:
                modules.pop(p, None)
            moved += 1
    if kept:
        msg = (f"{kept} q/k/v modules with a LoRA bias or DoRA magnitude stay on the unfused projections, which the "
               "fused attention does not use; call pipe.unfuse_qkv_projections() to apply them.")
        logger.warning("fd-lora: %s", msg)
        warnings.warn(f"fd-lora: {msg}", PartialLoadWarning, stacklevel=3)
    if moved:
        logger.info("fd-lora: %d q/k/v LoRA groups loaded onto fused projections (fuse_qkv_projections)", moved)
    return LoraAdapter(modules, use_rslora=adapter.use_rslora, name=adapter.name, provenance=adapter.provenance)
