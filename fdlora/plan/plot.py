"""`fdlora plan --plot FILE`: the plan's strategies drawn, time and memory side by side (needs matplotlib).

Left: amortised ms per step against steps between adapter switches, one line per feasible strategy (a switch's cost
spread over the steps it serves), the recommended one drawn thicker. Right: the device memory each strategy needs
(weights + activations + its own extra bytes, what the table and the recommendation use), against the GPU's memory
where the plan knows it.
"""

from __future__ import annotations

from .api import PlanResult


def plot(result: PlanResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    feasible = [s for s in result.strategies if s.feasible]
    ks = [2 ** (i / 4) for i in range(0, 49)]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for s in feasible:
        ax_t.plot(ks, [s.per_step_ms(k) for k in ks], label=s.name, lw=2.6 if s.name == result.recommended else 1.4)
    at = result.workload.get("switch_every")
    if isinstance(at, (int, float)) and at > 0:
        ax_t.axvline(at, color="#888888", ls="--", lw=1, label=f"switch every {at:g} steps")
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("steps between adapter switches")
    ax_t.set_ylabel("ms per step (amortised)")
    ax_t.set_title(f"time: {result.model} on {result.gpu}", loc="left", fontsize=10)
    ax_t.legend(fontsize=8, frameon=False)

    names = [s.name for s in result.strategies]
    need = [result.need_gib(s) for s in result.strategies]
    colours = ["#2b7bba" if s.name == result.recommended else "#9cc3e4" if s.feasible else "#cccccc"
               for s in result.strategies]
    ax_m.barh(range(len(names)), need, color=colours)
    for i, (s, v) in enumerate(zip(result.strategies, need)):
        ax_m.text(v, i, f" {v:.1f} GiB" + ("" if s.feasible else " (not possible)"), va="center", fontsize=8)
    total = result.info.get("device_gib") if isinstance(result.info, dict) else None
    if isinstance(total, (int, float)) and total > 0:
        ax_m.axvline(total, color="#d8703a", ls="--", lw=1, label=f"GPU memory {total:.0f} GiB")
        ax_m.legend(fontsize=8, frameon=False, loc="lower right")
    ax_m.set_yticks(range(len(names)), names)
    ax_m.invert_yaxis()
    ax_m.set_xlim(0, max(need + [total or 0]) * 1.35)
    ax_m.set_xlabel("device memory needed (GiB)")
    ax_m.set_title("memory", loc="left", fontsize=10)
    fig.suptitle(f"recommended: {result.recommended}", x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
