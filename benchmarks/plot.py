"""Charts of the committed benchmark results, for the README and the docs.

    python benchmarks/plot.py                 # reads benchmarks/results/<gpu>/*.json, writes docs/assets/*.png|svg
    python benchmarks/plot.py --out /tmp/x    # somewhere else

Each chart names its GPU and the file it was read from. Charts (PNG and SVG each):

- `x_base_<gpu>`: step time / base step per case on full-size models, fd-lora against diffusers+PEFT (or PEFT) on
  the same adapters, from `fullsize.json` (how its cases were run, as its `method` says: each alone in a fresh
  process, or, in older files, one after another in one process).
- `x_base_h200_alone`: the same cases on an H200, each alone in a fresh process (the table H200_ALONE below).
- `breadth_<gpu>`: one row per diffusers family, 1 adapter and a 4-adapter blend (`breadth.json`).
- `load_latency`: one SDXL-size r32 LoRA loaded from the Hub cache and from fd-lora's RAM cache, against
  diffusers' `load_lora_weights` (`load.json`).
- `train_step`: a training step against PEFT's on the same model, batch and optimizer, per GPU (`train.json`).
- `memory`: peak GPU memory, training (fd-lora vs PEFT) and inference with the merged-weight cache (`fullsize.json`).
- `serve_<gpu>`: images/s against offered load and p50/p99 latency, fd-lora serve against a diffusers+PEFT server
  (`serve.json`, benchmarks/bench_serve.py).

Only matplotlib is needed (`pip install matplotlib`); nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
OUT = ROOT.parent / "docs" / "assets"

FD, REF, BASE = "#2b7bba", "#d8703a", "#888888"  # fd-lora, diffusers+PEFT, base / floor
GPU_NAMES = {"nvidia-h100-80gb-hbm3": "H100 80GB", "nvidia-h200": "H200"}

# fullsize.json: (model, fd-lora case, reference case or None, label)
FULLSIZE_CASES = [
    ("sdxl", "cache_1", "peft_cache_1", "1 adapter"),
    ("sdxl", "cache_blend4", "peft_cache_blend4", "4-adapter blend"),
    ("sdxl", "per_prompt_2", None, "per-prompt, 2 prompts"),
    ("sdxl", "per_prompt_cfg", None, "per-prompt, 2 prompts x CFG"),
    ("sdxl", "slider_every_step", None, "slider moved every step"),
    ("sdxl", "nocache_1", None, "no merged-weight cache"),
    ("flux", "cache_1", "peft_cache_1", "1 adapter"),
    ("flux", "cache_blend4", "peft_cache_blend4", "4-adapter blend"),
    ("flux", "per_prompt_2", None, "per-prompt, 2 prompts"),
    ("flux", "slider_every_step", None, "slider moved every step"),
    ("flux", "nocache_1", None, "no merged-weight cache"),
    ("llama", "decode32_mixed4", "peft_decode32_mixed4", "decode 32x1, 4 adapters by row"),
    ("llama", "generate16_mixed4", None, "generate 16x32, 4 adapters"),
    ("llama", "prefill2048_1", None, "prefill 2048, 1 adapter"),
    ("llama", "decode32_nocache_1", None, "decode, no merged cache"),
]
MODEL_NAMES = {"sdxl": "SDXL UNet fp16, batch 2, 1024²", "flux": "Flux-dev bf16, 4096+512 tokens",
               "llama": "Llama-3-8B bf16"}


# Full-size cases on an H200, each run alone in a fresh process (median of per-round ratios, interleaved with a
# deep-copied base), at commit 997cd6a with bench_fullsize.py; where three runs spread, the slowest is drawn. A case
# that results/nvidia-h200/fullsize.json holds (measured the same way, at a later commit) replaces its row here.
# (model, case in fullsize.json, label, fd-lora, reference or None)
H200_ALONE = {"commit": "997cd6a", "rows": [
    ("sdxl", "cache_1", "1 adapter", 1.07, 1.97), ("sdxl", "cache_blend4", "4-adapter blend", 1.05, 4.29),
    ("sdxl", "per_prompt_2", "per-prompt, 2 prompts", 1.70, None),
    ("sdxl", "per_prompt_cfg", "per-prompt, 2 prompts x CFG", 1.48, None),
    ("sdxl", "slider_every_step", "slider moved every step", 1.11, None),
    ("sdxl", "nocache_1", "no merged-weight cache", 3.2, None),
    ("flux", "cache_1", "1 adapter", 1.00, 1.16), ("flux", "cache_blend4", "4-adapter blend", 1.00, 1.66),
    ("flux", "per_prompt_2", "per-prompt, 2 prompts", 1.01, None),
    ("flux", "slider_every_step", "slider moved every step", 1.09, None),
    ("flux", "nocache_1", "no merged-weight cache", 1.42, None),
    ("llama", "decode32_1", "decode 32x1, 1 adapter", 1.05, 1.93),
    ("llama", "decode32_mixed4", "decode 32x1, 4 adapters by row", 1.63, 9.3),
    ("llama", "generate16_mixed4", "generate, 4 adapters by row", 1.56, 8.5),
    ("llama", "prefill2048_1", "prefill 2048, 1 adapter", 1.00, None),
    ("llama", "prefill2048_nocache_1", "prefill 2048, no merged cache", 1.21, None),
    ("llama", "decode32_nocache_1", "decode 32x1, no merged cache", 1.60, None),
    ("sdxl", "per_prompt_2_nocopy", "per-prompt, 2 prompts, no copy", 1.53, None),
    ("sdxl", "per_prompt_cfg_nocopy", "per-prompt, 2 prompts x CFG, no copy", 1.49, None),
    ("flux", "per_prompt_2_nocopy", "per-prompt, 2 prompts, no copy", 1.085, None),
    ("llama", "decode32_mixed4_nocopy", "decode 32x1, 4 adapters by row, no copy", 1.11, None),
    ("llama", "generate16_mixed4_nocopy", "generate, 4 adapters by row, no copy", 1.15, None),
    ("llama", "prefill2048_nocopy", "prefill 2048, no copy", 1.16, None),
]}
MIN_TABLE_CASES = 4  # a fullsize.json with fewer fd-lora cases is drawn through H200_ALONE-style overrides only


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
                         "svg.hashsalt": "fd-lora", "figure.dpi": 100})
    return plt


def _save(fig, out: Path, name: str) -> list[Path]:
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None, "Creator": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


def _load(gpu: str, name: str) -> dict | None:
    path = RESULTS / gpu / name
    return json.loads(path.read_text()) if path.exists() else None


def _bars(ax, labels, fd, ref, ref_label="diffusers+PEFT", xlabel="x base step (1.0 = the model without LoRA)"):
    """Horizontal paired bars: fd-lora and the reference (None where it has no row)."""
    import numpy as np

    y = np.arange(len(labels))
    h = 0.38
    ax.barh(y - h / 2, fd, h, color=FD, label="fd-lora")
    refs = [r if r is not None else 0 for r in ref]
    ax.barh(y + h / 2, refs, h, color=REF, label=ref_label)
    for yi, v in zip(y, fd):
        ax.text(v, yi - h / 2, f" {v:.2f}", va="center", fontsize=8)
    for yi, v in zip(y, ref):
        if v is not None:
            ax.text(v, yi + h / 2, f" {v:.2f}", va="center", fontsize=8)
    ax.axvline(1.0, color=BASE, lw=1, ls="--")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)


def _method(data: dict) -> str:
    """How a fullsize.json's cases were run, as its `method` field says (one process for the older files)."""
    m = data.get("method", "")
    if "fresh process" in m:
        return "each case alone in a fresh process, the median of three runs"
    return "cases measured one after another in one process"


def plot_fullsize(gpu: str, out: Path) -> list[Path]:
    data = _load(gpu, "fullsize.json")
    if not data or sum(1 for m, c, _, _ in FULLSIZE_CASES if any(
            (x["model"], x["case"]) == (m, c) for x in data["cases"])) < MIN_TABLE_CASES:
        return []
    plt = _plt()
    rows = {(c["model"], c["case"]): c["x_base"] for c in data["cases"]}
    models = [m for m in MODEL_NAMES if any((m, c) in rows for mm, c, _, _ in FULLSIZE_CASES if mm == m)]
    counts = [sum(1 for m, c, _, _ in FULLSIZE_CASES if m == mm and (m, c) in rows) for mm in models]
    fig, axes = plt.subplots(len(models), 1, figsize=(7.5, 1.0 + 0.42 * sum(counts) + 0.5 * len(models)),
                             gridspec_kw={"height_ratios": counts})
    for ax, model in zip(axes, models):
        cases = [(c, r, lbl) for m, c, r, lbl in FULLSIZE_CASES if m == model and (m, c) in rows]
        _bars(ax, [lbl for _, _, lbl in cases], [rows[(model, c)] for c, _, _ in cases],
              [rows.get((model, r)) if r else None for _, r, _ in cases],
              ref_label="PEFT" if model == "llama" else "diffusers+PEFT")
        ax.set_title(MODEL_NAMES[model], loc="left", fontsize=9, fontweight="bold")
        ax.set_xscale("log")
        ax.set_xlim(0.9, max(12, ax.get_xlim()[1]))
        ax.set_xticks([1, 1.5, 2, 4, 8], ["1", "1.5", "2", "4", "8"])
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    fig.suptitle(f"Full-size step time, {GPU_NAMES.get(gpu, gpu)}: x the base step, lower is better\n"
                 f"(benchmarks/results/{gpu}/fullsize.json; {_method(data)})",
                 fontsize=9, x=0.02, ha="left")
    fig.tight_layout()
    return _save(fig, out, f"x_base_{gpu}")


def plot_h200_alone(out: Path) -> list[Path]:
    plt = _plt()
    committed = _load("nvidia-h200", "fullsize.json") or {"cases": []}
    newer = {(c["model"], c["case"]): c for c in committed["cases"]}
    rows = []
    for model, case, label, fd, ref in H200_ALONE["rows"]:
        c = newer.get((model, case))
        if c is not None:
            sha = str(c.get("git_sha") or committed.get("git_sha") or "")[:7]
            label, fd = f"{label} (at {sha})" if sha else label, c.get("x_base_max", c["x_base"])
        rows.append((model, label, fd, ref))
    models = list(dict.fromkeys(r[0] for r in rows))
    counts = [sum(1 for r in rows if r[0] == mm) for mm in models]
    fig, axes = plt.subplots(len(models), 1, figsize=(7.5, 1.0 + 0.42 * sum(counts) + 0.5 * len(models)),
                             gridspec_kw={"height_ratios": counts})
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r[0] == model]
        _bars(ax, [r[1] for r in mine], [r[2] for r in mine], [r[3] for r in mine],
              ref_label="PEFT" if model == "llama" else "diffusers+PEFT")
        ax.set_title(MODEL_NAMES[model], loc="left", fontsize=9, fontweight="bold")
        ax.set_xscale("log")
        ax.set_xlim(0.9, 12)
        ax.set_xticks([1, 1.5, 2, 4, 8], ["1", "1.5", "2", "4", "8"])
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    fig.suptitle(f"Full-size step time, H200: x the base step, lower is better\n(each case alone in a fresh "
                 f"process, at {H200_ALONE['commit']} unless a row says; the slowest of three runs; rows at a later "
                 f"commit ran with the CUDA extension built)", fontsize=9, x=0.02, ha="left")
    fig.tight_layout()
    return _save(fig, out, "x_base_h200_alone")


def plot_breadth(gpu: str, out: Path) -> list[Path]:
    data = _load(gpu, "breadth.json")
    if not data or "rows" not in data or "family" not in data["rows"][0]:
        return []
    plt = _plt()
    rows = {(r["family"], r["case"]): r["x_base"] for r in data["rows"]}
    families = list(dict.fromkeys(r["family"] for r in data["rows"]))
    labels, fd, ref = [], [], []
    for f in families:
        for n, case in (("1 adapter", "1"), ("4-blend", "blend4")):
            if (f, f"fdlora_{case}") in rows:
                labels.append(f"{f}, {n}")
                fd.append(rows[(f, f"fdlora_{case}")])
                ref.append(rows.get((f, f"peft_{case}")))
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.36 * len(labels)))
    _bars(ax, labels, fd, ref)
    ax.set_xlim(0.9, max(ref + fd) * 1.15)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    rank = data.get("meta", {}).get("rank", 16)
    ax.set_title(f"Diffusers families at full size, {GPU_NAMES.get(gpu, gpu)}, LoRA r{rank}, eager, merged-weight "
                 f"cache: x the base step\n(benchmarks/results/{gpu}/breadth.json)", loc="left", fontsize=9)
    fig.tight_layout()
    return _save(fig, out, f"breadth_{gpu}")


def plot_load(out: Path) -> list[Path]:
    rows = []
    for gpu in sorted(p.name for p in RESULTS.iterdir() if p.is_dir()):
        d = _load(gpu, "load.json")
        if d and not d.get("tiny"):
            rows.append((gpu, d))
    if not rows:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 1.0 * len(rows)))
    labels, vals, colours = [], [], []
    for gpu, d in rows:
        g = GPU_NAMES.get(gpu, gpu)
        for lbl, key, col in (("fd-lora, RAM cache (re-load)", "fdlora_ram_cache_ms", FD),
                              ("fd-lora, Hub cache (file on disk)", "fdlora_hub_cache_ms", FD),
                              ("diffusers load_lora_weights", "diffusers_peft_load_lora_weights_ms", REF)):
            labels.append(f"{lbl} — {g}")
            vals.append(d[key])
            colours.append(col)
    ax.barh(range(len(vals)), vals, color=colours)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f} ms" if v >= 100 else f" {v:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(vals)), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(5, max(vals) * 4)
    ax.set_xlabel("ms, median (log scale), lower is better")
    a = rows[0][1]["adapter"]
    ax.set_title(f"Loading an SDXL-size LoRA (r{rows[0][1]['rank']}, {a['modules']} modules, "
                 f"{a['file_mb']:.0f} MB) into a loaded pipeline\n(benchmarks/results/<gpu>/load.json)",
                 loc="left", fontsize=9)
    fig.tight_layout()
    return _save(fig, out, "load_latency")


def _train_rows():
    out = []
    for gpu in sorted(p.name for p in RESULTS.iterdir() if p.is_dir()):
        d = _load(gpu, "train.json")
        if d and not d.get("smoke"):
            sha = (d.get("env", {}).get("git_sha") or d.get("git_sha") or "")[:7]
            out.append((gpu, sha, d["cases"]))
    return out


TRAIN_NAMES = {"sdxl": "SDXL UNet, attention r16", "vit": "ViT-L/16 nf4 QLoRA", "llama": "Llama-3-8B shape, all-linear"}


def plot_train(out: Path) -> list[Path]:
    rows = _train_rows()
    if not rows:
        return []
    plt = _plt()
    import numpy as np

    cases = list(dict.fromkeys(c["case"] for _, _, cs in rows for c in cs))
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.55 * len(cases) * len(rows) / 2 + 0.6))
    y = np.arange(len(cases))
    h = 0.8 / len(rows)
    shades = [FD, "#7fb3d9", "#1b4f7a"]
    for i, (gpu, sha, cs) in enumerate(rows):
        by = {c["case"]: c["step_x_peft"] for c in cs}
        vals = [by.get(c, np.nan) for c in cases]
        ax.barh(y + (i - (len(rows) - 1) / 2) * h, vals, h, color=shades[i % len(shades)],
                label=f"{GPU_NAMES.get(gpu, gpu)} (at {sha})")
        for yi, v in zip(y, vals):
            if v == v:
                ax.text(v, yi + (i - (len(rows) - 1) / 2) * h, f" {v:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color=REF, lw=1.2, ls="--", label="PEFT = 1")
    ax.set_yticks(y, [TRAIN_NAMES.get(c, c) for c in cases])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.6)
    ax.set_xlabel("training step time / PEFT's on the same model, batch and optimizer (lower is better)")
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.set_title("Training step against PEFT (benchmarks/results/<gpu>/train.json)", loc="left", fontsize=9)
    fig.tight_layout()
    return _save(fig, out, "train_step")


def plot_memory(out: Path) -> list[Path]:
    train = _train_rows()
    full = _load("nvidia-h100-80gb-hbm3", "fullsize.json")
    if not train and not full:
        return []
    plt = _plt()
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.2))
    ax = axes[0]
    gpu, sha, cs = train[0]
    labels = [TRAIN_NAMES.get(c["case"], c["case"]) for c in cs]
    y = np.arange(len(cs))
    ax.barh(y - 0.2, [c["fd_peak_gib"] for c in cs], 0.4, color=FD, label="fd-lora")
    ax.barh(y + 0.2, [c["peft_peak_gib"] for c in cs], 0.4, color=REF, label="PEFT")
    for yi, c in zip(y, cs):
        ax.text(c["fd_peak_gib"], yi - 0.2, f" {c['fd_peak_gib']:.1f}", va="center", fontsize=8)
        ax.text(c["peft_peak_gib"], yi + 0.2, f" {c['peft_peak_gib']:.1f}", va="center", fontsize=8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("peak GiB")
    ax.set_title(f"Training, {GPU_NAMES.get(gpu, gpu)} (train.json)", loc="left", fontsize=9)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax = axes[1]
    if full:
        rows = {(c["model"], c["case"]): c for c in full["cases"]}
        items = [(m, c) for m, c in (("sdxl", "cache_1"), ("flux", "cache_1"), ("llama", "prefill2048_1"))
                 if (m, c) in rows and rows[(m, c)].get("cache_gib")]
        y = np.arange(len(items))
        cache = [rows[k]["cache_gib"] for k in items]
        ax.barh(y, cache, 0.5, color="#9cc3e4")
        for yi, c in zip(y, cache):
            ax.text(c, yi, f" {c:.1f} GiB", va="center", fontsize=8)
        ax.set_yticks(y, [MODEL_NAMES[m].split(" ")[0] for m, _ in items])
        ax.invert_yaxis()
        ax.set_xlim(0, max(cache) * 1.3)
        ax.set_xlabel("GiB: one merged copy of every targeted weight")
        ax.set_title("Inference: the merged-weight cache, H100 (fullsize.json)\n"
                     "a budget (25% of GPU memory by default); set_merge_cache(0) gives it back", loc="left",
                     fontsize=9)
    fig.tight_layout()
    return _save(fig, out, "memory")


def plot_serve(gpu: str, out: Path) -> list[Path]:
    """Closed loop (images/s and p50/p99 latency by client count, both servers) and open loop (fd-lora's images/s
    served against the Poisson rate offered)."""
    data = _load(gpu, "serve.json")
    runs = [r for r in (data or {}).get("runs", []) if r.get("served")]
    if not runs:
        return []
    plt = _plt()
    fig, (ax, lx, ox) = plt.subplots(1, 3, figsize=(13, 3.6))
    for server, colour, label in (("fdlora", FD, "fd-lora serve"), ("diffusers_peft", REF, "diffusers+PEFT")):
        closed = sorted((r for r in runs if r["server"] == server and r.get("mode") == "closed"),
                        key=lambda r: r["clients"])
        n = [r["clients"] for r in closed]
        ax.plot(n, [r["throughput_ips"] for r in closed], "o-", color=colour, label=label)
        lx.plot(n, [r["p50_s"] for r in closed], "o-", color=colour, label=f"{label} p50")
        lx.plot(n, [r["p99_s"] for r in closed], "s--", color=colour, label=f"{label} p99")
        opened = sorted((r for r in runs if r["server"] == server and r.get("mode") == "open"),
                        key=lambda r: r["rate_rps"])
        if opened:
            ox.plot([r["rate_rps"] for r in opened], [r["throughput_ips"] for r in opened], "o-", color=colour,
                    label=f"{label} served")
            for r in opened:
                ox.annotate(f"p50 {r['p50_s']:.1f} s, p99 {r['p99_s']:.1f} s", (r["rate_rps"], r["throughput_ips"]),
                            fontsize=7, textcoords="offset points", xytext=(4, -10))
    ceiling = (data.get("base_ceiling") or {}).get("ips")
    if ceiling:  # the base model without adapters, the largest batch at once: no LoRA server passes it here
        ax.axhline(ceiling, color="grey", ls=":", label=f"base model, {data['base_ceiling']['batch']} in one batch")
    for a, xl, yl in ((ax, "clients (closed loop)", "images/s"), (lx, "clients (closed loop)", "latency, s"),
                      (ox, "offered rate, requests/s (open loop)", "images/s served")):
        a.set_xlabel(xl)
        a.set_ylabel(yl)
        a.legend(fontsize=8, frameon=False)
    c = data["config"]
    fig.suptitle(f"Serving {data['model']} {c['size']}², {c['steps']} steps, CFG: {c['adapters']} r{c['rank']} "
                 f"adapters over {c['adapters_per_replica']} slots, {GPU_NAMES.get(gpu, gpu)}"
                 f"{'' if data.get('ray') else ' (in-process engine, no Ray)'}\n"
                 f"(benchmarks/results/{gpu}/serve.json)", x=0.01, ha="left", fontsize=9)
    fig.tight_layout()
    return _save(fig, out, f"serve_{gpu}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for gpu in sorted(p.name for p in RESULTS.iterdir() if p.is_dir()):
        written += plot_fullsize(gpu, args.out) + plot_breadth(gpu, args.out) + plot_serve(gpu, args.out)
    written += plot_h200_alone(args.out) + plot_load(args.out) + plot_train(args.out) + plot_memory(args.out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
