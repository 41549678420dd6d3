"""What each serving strategy costs per step, per switch and in memory, from one traced step.

Strategies (each a cost on the LoRA-targeted Linear/Conv calls of the trace, the rest of the step shared):
- merged:    fuse B A into W; steps run at base speed; a switch un-merges and re-merges (2 merges a layer);
             one blend per model, so it cannot serve several adapters in one batch;
- dynamic:   fd-lora per-call; every call runs the dispatcher's best path (fdlora.kernels.costmodel.estimate);
             switches are a device-side scale write (set_adapters ~0.3 ms on an H100);
- cache:     fd-lora's merged-weight cache; calls run the cached W' (one GEMM), a switch re-merges stale
             layers from W; with `cache_budget_gib` the layers that fit are cached, the rest run per-call;
- grouped:   per-prompt batches: one merged weight per distinct blend (G = adapters per batch), each
             group's rows on its own weight (a G-way batched GEMM), merged again on a switch;
- quantized: LoRA over an nf4 base (bitsandbytes): dequantize + GEMM (or a 4-bit GEMV for few rows) plus the
             per-call delta; cannot merge (the merged weight would need requantizing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.costmodel import Device, Problem, estimate, gemm_us, merge_us
from .step import gpu_us, step_us
from .trace import Op

NF4_BYTES = 0.5 + 4 / 64  # 4-bit codes plus one fp32 absmax per 64 weights
SET_ADAPTERS_US = 300.0  # fd-lora set_adapters weight change (0.31 ms with 700 layers on an H100)


@dataclass
class Strategy:
    name: str
    step_ms: float
    switch_ms: float
    extra_gib: float
    feasible: bool = True
    why_not: str = ""
    per_layer_us: dict[str, float] = field(default_factory=dict)

    def per_step_ms(self, switch_every: float) -> float:
        """Amortised step time when the adapter (or blend) changes every `switch_every` steps."""
        return self.step_ms + self.switch_ms / max(switch_every, 1e-9)


def _targets(ops: list[Op], targets: tuple[str, ...]) -> list[int]:
    return [i for i, o in enumerate(ops) if o.weight and any(o.weight.endswith(t) for t in targets)]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def strategies(ops: list[Op], views: int, targets: tuple[str, ...], dev: Device, dtype: torch.dtype, *,
               eager: bool, adapters: int, rank: int, blend: int, groups: int, budget_gib: float | None,
               calls: int = 1) -> tuple[list[Strategy], dict]:
    """Every strategy's numbers; `blend` adapters active at once, `groups` distinct blends in one batch,
    `calls` forward calls per step (the layer's merge happens once per switch, its GEMM every call)."""
    idx = _targets(ops, targets)
    b = _itemsize(dtype)
    R = -(-rank // 16) * 16
    width = blend * R
    base = step_us(ops, dev, eager, views) / 1e3
    w_el = {i: ops[i].N * ops[i].K for i in idx}
    merge_all = sum(merge_us(ops[i].N, ops[i].K, width, dev) for i in idx) / 1e3
    host_merge = len(idx) * dev.host_op_us / 1e3
    out: list[Strategy] = []

    one = "several adapters in one batch need per-row weights" if groups > 1 else ""
    out.append(Strategy("merged", base, 2 * (merge_all + host_merge), 0.0, groups <= 1, one))

    dyn_gpu, dyn_layer = {}, {}
    for i in idx:
        o = ops[i]
        us = estimate(Problem(o.M, o.K, o.N, max(blend, groups), R, dtype, "cuda", dev.sms, 1), dev, delta=True)
        us.pop("reference")
        dyn_gpu[i] = min(us.values()) - gpu_us(o, dev)
        dyn_layer[o.weight] = min(us.values())
    dyn_host = {i: dev.host_percall_us + (groups - 1) * dev.host_percall_group_us for i in idx}
    dynamic = step_us(ops, dev, eager, views, dyn_gpu, dyn_host) / 1e3
    out.append(Strategy("dynamic", dynamic, SET_ADAPTERS_US / 1e3, 0.0, per_layer_us=dyn_layer))

    cache_gib = sum(w_el.values()) * b / 2**30
    cached, left = set(idx), budget_gib
    if budget_gib is not None:  # cache the layers where per-call costs most per byte first
        cached = set()
        for i in sorted(idx, key=lambda i: -(dyn_gpu[i] + dyn_host[i]) / w_el[i]):
            if w_el[i] * b / 2**30 <= left:
                cached.add(i)
                left -= w_el[i] * b / 2**30
    c_gpu = {i: (0.0 if i in cached else dyn_gpu[i]) for i in idx}
    c_host = {i: (dev.host_cached_us if i in cached else dyn_host[i]) for i in idx}
    c_merge = sum(merge_us(ops[i].N, ops[i].K, width, dev) for i in cached) / 1e3
    name = "cache" if budget_gib is None else "cache-budget"
    out.append(Strategy(name, step_us(ops, dev, eager, views, c_gpu, c_host) / 1e3,
                        c_merge + SET_ADAPTERS_US / 1e3, sum(w_el[i] for i in cached) * b / 2**30,
                        groups <= 1, one))

    g_gpu = {}
    for i in idx:
        o = ops[i]
        rows = max(1, o.M // groups)
        g_gpu[i] = groups * gemm_us(rows, o.K, o.N, o.itemsize, dev) - gpu_us(o, dev)
    g_host = {i: dev.host_cached_us * groups for i in idx}
    g_merge = groups * sum(merge_us(ops[i].N, ops[i].K, R, dev) for i in idx) / 1e3
    out.append(Strategy("grouped", step_us(ops, dev, eager, views, g_gpu, g_host) / 1e3, g_merge,
                        groups * cache_gib, groups > 1, "" if groups > 1 else "one blend per batch: that is cache"))

    q_gpu = {}
    for i in idx:
        o = ops[i]
        w_bytes = o.N * o.K
        if o.M <= 16:  # bnb's 4-bit GEMV reads the codes once
            q = max(2.0 * o.M * o.N * o.K / (dev.peak_tflops * 0.05e6), w_bytes * NF4_BYTES / (dev.hbm_gbs * 1e3))
        else:  # dequantize to a 16-bit copy, then cuBLAS
            q = w_bytes * (NF4_BYTES + b) / (dev.hbm_gbs * 1e3) + dev.launch_us + gpu_us(o, dev)
        q_gpu[i] = q + dyn_gpu[i] - gpu_us(o, dev) + dev.launch_us
    q_host = {i: dev.host_percall_us + 2 * dev.host_op_us for i in idx}
    saved = -sum(w_el.values()) * (b - NF4_BYTES) / 2**30
    out.append(Strategy("quantized", step_us(ops, dev, eager, views, q_gpu, q_host) / 1e3,
                        SET_ADAPTERS_US / 1e3, saved))

    bank_gib = sum(adapters * R * (ops[i].K + ops[i].N) for i in idx) * b / 2**30
    info = dict(base_step_ms=base, lora_layers=len(idx), merge_ms=merge_all + host_merge, bank_gib=bank_gib,
                load_ms=bank_gib * 2**30 / (dev.h2d_gbs * 1e6) + len(idx) * adapters * dev.host_op_us / 1e3,
                target_weight_gib=cache_gib)
    return out, info
