"""Step time from a meta trace: the roofline of fdlora.kernels.costmodel for every launched call, then the host.

Eager diffusers/transformers steps on an H100 are host-bound (PERF.md: the SDXL GPU is busy 42 of 106 ms),
so a sum of kernel times is wrong there. We replay the trace as two queues: the host issues call i after
`host_us` of Python and dispatch, the GPU starts it when both it is issued and the previous kernel is done.
Captured (CUDA-graph) steps have no host queue. Tensor parallelism shards the Linear GEMMs and attention
heads `tp` ways and adds two all-reduces per decoder layer (Megatron layout).
"""

from __future__ import annotations

from dataclasses import replace

from ..kernels.costmodel import Device, gemm_us
from .trace import Op

ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "fc2", "dense_4h_to_h")
NVLINK_GBS = 300.0  # all-reduce bus bandwidth an NCCL ring reaches on NVLink 4 (H100 SXM datasheet 450 GB/s)
ALLREDUCE_US = 10.0  # NCCL small-message latency per all-reduce


def op_us(op: Op, dev: Device) -> float:
    """GPU microseconds of one call on `dev`."""
    if op.kind in ("gemm", "conv"):
        return gemm_us(op.M, op.K, op.N, op.itemsize, dev, op.batch)
    if op.kind == "attn":
        return max(op.flops / (dev.peak_tflops * dev.attn_eff * 1e6), op.bytes / (dev.hbm_gbs * 1e3)) + dev.launch_us
    return op.bytes / (dev.hbm_gbs * dev.elementwise_eff * 1e3) + dev.launch_us


def with_context(ops: list[Op], context: int) -> list[Op]:
    """LLM decode/prefill with `context` cached tokens: attention reads the KV cache (traced without one)."""
    out = []
    for op in ops:
        if op.kind == "attn" and context:
            L, D, S, bh = op.M, op.K, op.N, op.batch
            qo = 2 * bh * L * D * op.itemsize
            S2 = S + context
            op = replace(op, N=S2, flops=4.0 * bh * L * S2 * D, bytes=qo + (op.bytes - qo) * S2 / S)
        out.append(op)
    return out


def shard(ops: list[Op], tp: int, hidden: int, layers: int) -> list[Op]:
    """Tensor-parallel rank `tp` of an LLM step: column/row-parallel Linears, heads split, all-reduces added."""
    if tp <= 1:
        return ops
    out = []
    for op in ops:
        if op.kind == "gemm" and op.weight:
            if op.weight.endswith(ROW_PARALLEL):
                op = replace(op, K=max(1, op.K // tp), flops=op.flops / tp)
            else:
                op = replace(op, N=max(1, op.N // tp), flops=op.flops / tp)
        elif op.kind == "attn":
            op = replace(op, batch=max(1, op.batch // tp), flops=op.flops / tp, bytes=op.bytes / tp)
        out.append(op)
    rows = next((o.M for o in ops if o.kind == "gemm" and o.weight), 1)
    ar_bytes = rows * hidden * 2.0
    ar_us = ALLREDUCE_US + 2 * (tp - 1) / tp * ar_bytes / (NVLINK_GBS * 1e3)
    out += [Op("allreduce", 0.0, ar_bytes, 2.0, M=int(ar_us * 1000))] * (2 * layers)
    return out


def gpu_us(op: Op, dev: Device) -> float:
    return op.M / 1000.0 if op.kind == "allreduce" else op_us(op, dev)


def overlap(gpu: list[float], host: list[float]) -> float:
    """Wall microseconds of an eager step: kernels queue behind both the host issuing them and the GPU."""
    t_host = t_gpu = 0.0
    for g, h in zip(gpu, host, strict=True):
        t_host += h
        t_gpu = max(t_gpu, t_host) + g
    return max(t_gpu, t_host)


def step_us(ops: list[Op], dev: Device, eager: bool, views: int = 0,
            extra_gpu: dict[int, float] | None = None, extra_host: dict[int, float] | None = None) -> float:
    """Wall microseconds of one step; `extra_*` add a strategy's per-call cost at op indices (LoRA layers)."""
    extra_gpu, extra_host = extra_gpu or {}, extra_host or {}
    gpu = [gpu_us(o, dev) + extra_gpu.get(i, 0.0) for i, o in enumerate(ops)]
    if not eager:
        return sum(gpu)
    per_view = views * 1.0 / max(1, len(ops))  # a view is ~1 us of host, no kernel
    host = [dev.host_op_us + per_view + extra_host.get(i, 0.0) for i in range(len(ops))]
    return overlap(gpu, host)
