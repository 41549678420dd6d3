"""Per-GPU constants for the cost model, and `--calibrate`, which measures them on the current device.

H100 is fitted to our committed benchmarks (fdlora.kernels.costmodel.H100). The others scale it from datasheets
(dense fp16/bf16 tensor TFLOP/s without sparsity, HBM/GDDR bandwidth) at the H100's measured efficiencies
(cuBLAS ~ 790/989 of datasheet peak, streaming ~ 2500/3350 of datasheet bandwidth); say `fitted` only
where we measured. CPU values are rough defaults (only set_adapters timings were measured on a CPU):
calibrate there.
A calibration JSON under ~/.cache/fdlora/plan/<name>.json is preferred over the table when present.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..kernels.costmodel import H100, Device

_PEAK, _BW = 790.0 / 989.0, 2500.0 / 3350.0  # H100 SXM measured / datasheet

DEVICES: dict[str, Device] = {
    "h100": H100,
    "h200": H100.scaled(name="h200", source="datasheet: H100 compute, 4.8 TB/s HBM3e, 141 GB; per-call host time "
                        "fitted (bench_fullsize no-copy rows, CUDA extension built)",
                        hbm_gbs=4800 * _BW, memory_gib=141.0,
                        # SDXL's no-copy steps, each case alone (nocache_1 1.25x at 28822a7; per_prompt_2_nocopy
                        # 1.12x, per_prompt_cfg_nocopy 1.22x at 0b3c9e7): the planner within 8% of all three. On the
                        # extension a further blend of a per-prompt batch adds no launch to a layer (every blend is
                        # merged in one, and a two-prompt batch's GEMMs run as one): host_percall_group_us stays 0
                        host_percall_us=20.0),
    "a100": H100.scaled(name="a100", source="datasheet: A100 SXM 312 TFLOP/s bf16, 2.04 TB/s, 80 GB, 108 SMs",
                        peak_tflops=312 * _PEAK, hbm_gbs=2039 * _BW, sms=108, l2_bytes=40e6, memory_gib=80.0,
                        merge_us_per_mel=H100.merge_us_per_mel * 2500 / (2039 * _BW)),
    "l40s": H100.scaled(name="l40s", source="datasheet: L40S 362 TFLOP/s bf16, 864 GB/s GDDR6, 48 GB, 142 SMs",
                        peak_tflops=362 * _PEAK, hbm_gbs=864 * _BW, sms=142, l2_bytes=96e6, memory_gib=48.0,
                        merge_us_per_mel=H100.merge_us_per_mel * 2500 / (864 * _BW)),
    "4090": H100.scaled(name="4090", source="datasheet: RTX 4090 165 TFLOP/s fp16 (fp32 acc.), 1.01 TB/s, 24 GB",
                        peak_tflops=165 * _PEAK, hbm_gbs=1008 * _BW, sms=128, l2_bytes=72e6, memory_gib=24.0,
                        merge_us_per_mel=H100.merge_us_per_mel * 2500 / (1008 * _BW)),
    "cpu": Device("cpu", "rough defaults for a small x86 host (no CPU GEMM benchmarks); run --calibrate",
                  peak_tflops=0.05, k_half=64.0, hbm_gbs=8.0, l2_bytes=2e6, merge_us_per_mel=400.0,
                  merge_us_per_mel_rank=5.0, delta_gbs=8.0, delta_tflops=0.05, launch_us=5.0, sms=2,
                  memory_gib=16.0, attn_eff=0.5, host_op_us=10.0, host_cached_us=5.0, host_percall_us=60.0,
                  h2d_gbs=8.0),
}


def calibration_path(name: str) -> Path:
    return Path.home() / ".cache" / "fdlora" / "plan" / f"{name}.json"


def get(name: str, path: Path | None = None) -> Device:
    """The constants for `name`, a calibration file's where one exists."""
    key = name.lower().removeprefix("nvidia-")
    if key not in DEVICES:
        raise ConfigError(f"--gpu {name!r} is not known; use one of {', '.join(DEVICES)} (or --calibrate on it).")
    file = path or calibration_path(key)
    if file.is_file():
        data = json.loads(file.read_text())
        fields = {k: v for k, v in data.items() if k in Device.__dataclass_fields__ and k != "name"}
        return DEVICES[key].scaled(**fields)
    return DEVICES[key]


def _time(fn, reps: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) * 1e6 / reps)
    return best


def _known(device_name: str) -> str:
    """The DEVICES key a CUDA device name belongs to ("NVIDIA H200" -> "h200"), or "gpu"."""
    low = device_name.lower().replace(" ", "")
    return next((k for k in DEVICES if k != "cpu" and k in low), "gpu")


def calibrate(name: str | None = None, shapes: tuple[int, ...] | None = None, out: Path | None = None) -> Path:
    """Time square matmuls and a copy on this machine's device; write peak TFLOP/s and bandwidth as JSON. Default
    shapes: 2048-8192 on a GPU (smaller ones measure launch latency, not the tensor cores), 256-512 on a CPU."""
    cuda = torch.cuda.is_available()
    shapes = shapes or ((2048, 4096, 8192) if cuda else (256, 512))
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = name or (_known(torch.cuda.get_device_name()) if cuda else "cpu")
    peak = 0.0
    for n in shapes:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        us = _time(lambda a=a, b=b: a @ b, 5, sync)
        peak = max(peak, 2.0 * n**3 / us / 1e6)
    x = torch.randn(min(max(shapes) * 64, (64 << 20) // max(shapes)), max(shapes), device=dev, dtype=dtype)
    y = torch.empty_like(x)
    us = _time(lambda: y.copy_(x), 5, sync)
    gbs = 2.0 * x.numel() * x.element_size() / us / 1e3
    launch = _time(lambda: torch.add(x[:1], 1), 20, sync)
    data = dict(name=name, source=f"calibrate() on {torch.cuda.get_device_name() if cuda else 'cpu'}, "
                f"shapes {list(shapes)}", peak_tflops=peak, hbm_gbs=gbs, delta_gbs=gbs, launch_us=launch,
                time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    path = out or calibration_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path
