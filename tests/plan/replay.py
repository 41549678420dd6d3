"""Rows of the committed H100 benchmarks, replayed through the planner's cost model (tests/plan/test_replay.py).

Each row: (id, measured us, predicted us). In scope, and why:
- per-layer paths (fused.json, fused_s10.json, fused_measured.json, probe_checked.json): every GPU-timed
  path the dispatcher can choose (cublas_base, merged, cublas_delta, fused, fused_pre, cached) at its M, K,
  N, slots and rank; `reference` is the fallback only (never chosen on CUDA) and `op` duplicates the chosen path;
- delta*.json: the cuBLAS base of each shape (the delta kernel alone has its own sweep files and no planner
  path of its own; its cost enters through cublas_delta above);
- whole steps (pipeline*.json eager, captured.json CUDA-graph replays): SDXL / Flux at depth 6, base, merged,
  merged-weight cache and per-call, through the meta trace and the host/GPU overlap;
- llm*.json: Llama-3-8B-shaped 4-layer decode (32 rows, 512 context) and prefill (4096 tokens), base.
Out of scope: cutlass_*.json (an experiment, not a path), sweep_*/probe_tma (tile-config sweeps of one kernel),
PEFT columns (not an fd-lora strategy), layer_host/load/set_adapters (host-only fits, used as constants).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fdlora.kernels.costmodel import H100, Problem, estimate, gemm_us

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "nvidia-h100-80gb-hbm3"
PATHS = ("merged", "cublas_delta", "fused", "fused_pre")


def _lora(name: str) -> tuple[int, int]:
    if name.startswith("blend"):
        s, r = name[5:].split("x")
        return int(s), int(r)
    return 1, int(name.lstrip("r"))


def layer_rows() -> list[tuple[str, float, float]]:
    out = []
    for f in ("fused.json", "fused_s10.json", "fused_measured.json", "probe_checked.json"):
        for row in json.loads((RESULTS / f).read_text())["rows"]:
            S, R = _lora(row["lora"])
            M, K, N = row["M"], row["K"], row["N"]
            est = estimate(Problem(M, K, N, S, R, torch.bfloat16, "cuda", 132, 1), H100, delta=True)
            est["cublas_base"] = est["cached"] = gemm_us(M, K, N, 2, H100)
            for path in (*PATHS, "cublas_base", "cached"):
                if path in row["us"]:
                    out.append((f"{f}:{M}x{K}x{N}-{row['lora']}-{path}", row["us"][path], est[path]))
    for f in ("delta.json", "delta_13de786.json", "delta_s8.json", "delta_llm_s8.json"):
        seen = set()
        for row in json.loads((RESULTS / f).read_text())["rows"]:
            key = (row["M"], row["K"], row["N"], row["dtype"])
            if key in seen or "base_us" not in row:
                continue
            seen.add(key)
            out.append((f"{f}:{row['M']}x{row['K']}x{row['N']}-base", row["base_us"],
                        gemm_us(row["M"], row["K"], row["N"], 2, H100)))
    return out


def step_rows() -> list[tuple[str, float, float]]:
    from fdlora.plan import plan

    out = []
    depth = {"sdxl": {"transformer_layers_per_block": [1, 2, 6]}, "flux-dev": {"num_layers": 3, "num_single_layers": 6}}
    for f, eager in (("pipeline.json", True), ("pipeline_sdxl_repeat.json", True), ("captured.json", False)):
        data = json.loads((RESULTS / f).read_text())
        for key, model in (("sdxl", "sdxl"), ("flux", "flux-dev")):
            if key not in data:
                continue
            for label, blend in (("1 adapter", 1), ("4-adapter blend", 4)):
                r = plan(model, depth=depth[model], eager=eager, blend=blend)
                pre = "fd-lora" if not eager else "fdlora"
                cols = {f"base {label} ms": r.info["base_step_ms"], f"merged {label} ms": r.by_name("merged").step_ms,
                        f"{pre} {'cached ' if not eager else ''}{label} ms": r.by_name("cache").step_ms,
                        f"{pre} per-call {label} ms": r.by_name("dynamic").step_ms}
                for col, pred in cols.items():
                    if col in data[key]:
                        out.append((f"{f}:{key}:{col}", data[key][col], pred))
    for f in ("llm.json", "llm_repeat.json", "llm_s8.json", "llm_session7.json", "llm_profile_dense.json"):
        data = json.loads((RESULTS / f).read_text())
        dec = plan("llama-3-8b", depth={"num_hidden_layers": 4}, batch=32, tokens=1, context=512)
        pre = plan("llama-3-8b", depth={"num_hidden_layers": 4}, batch=1, tokens=4096, context=0)
        out.append((f"{f}:decode base", data["decode_ms"]["base"], dec.info["base_step_ms"]))
        out.append((f"{f}:prefill base_1", data["prefill_ms"]["base_1"], pre.info["base_step_ms"]))
    return out
