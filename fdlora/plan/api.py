"""`fdlora.plan(model, ...)`: trace the model's step on `meta`, price every strategy, pick one and say why."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError
from . import devices, source
from .step import shard, with_context
from .strategies import Strategy, strategies
from .trace import trace


@dataclass
class PlanResult:
    model: str
    gpu: str
    gpu_source: str
    workload: dict
    info: dict
    strategies: list[Strategy]
    recommended: str
    reason: str
    break_even: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        for s in d["strategies"]:
            s["per_step_ms"] = self.by_name(s["name"]).per_step_ms(self.workload["switch_every"])
            s.pop("per_layer_us")
        return d

    def by_name(self, name: str) -> Strategy:
        return next(s for s in self.strategies if s.name == name)

    def need_gib(self, s: Strategy) -> float:
        """Device memory `s` needs: weights + activations + its +GiB (what the table and the recommendation use)."""
        return self.info["weights_gib"] + self.info["activations_gib"] + s.extra_gib

    def table(self) -> str:
        w = self.workload
        lines = [f"fdlora plan: {self.model} on {self.gpu} ({self.gpu_source})",
                 f"  batch {w['batch']}, {w.get('resolution') or w.get('tokens')} "
                 f"{'px' if 'resolution' in w else 'tokens'}, switch every {w['switch_every']} steps, "
                 f"{w['adapters_per_batch']} adapter(s) per batch; {self.info['lora_layers']} LoRA layers, "
                 f"base step {self.info['base_step_ms']:.2f} ms",
                 f"  {'strategy':<13}{'step ms':>10}{'x base':>8}{'switch ms':>11}{'per step':>10}{'+GiB':>8}"]
        base, free = self.info["base_step_ms"], self.info["free_gib"]
        for s in self.strategies:
            flag = f"  (no: {s.why_not})" if not s.feasible else "" if s.extra_gib <= free else (
                f"  (does not fit: {self.need_gib(s):.2f} GiB with the weights and activations, "
                f"{self.info['device_gib']:g} GiB on {self.gpu})")
            lines.append(f"  {s.name:<13}{s.step_ms:>10.2f}{s.step_ms / base:>8.2f}{s.switch_ms:>11.2f}"
                         f"{s.per_step_ms(w['switch_every']):>10.2f}{s.extra_gib:>8.2f}{flag}")
        be = ", ".join(f"{k} {v:.1f}" if math.isfinite(v) else f"{k} never" for k, v in self.break_even.items())
        lines += [f"  memory: weights {self.info['weights_gib']:.2f} GiB, banks {self.info['bank_gib']:.3f} GiB, "
                  f"activations ~{self.info['activations_gib']:.2f} GiB; {self.info['device_gib']:g} GiB on "
                  f"{self.gpu} leaves {free:.2f} GiB for a strategy's +GiB; load {self.info['load_ms']:.1f} ms, "
                  f"merge all {self.info['merge_ms']:.1f} ms",
                  f"  merging pays off after (steps between switches): {be}",
                  f"recommended: {self.recommended} ({self.reason})"]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Per-step time vs steps between switches, one line per strategy."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ks = [2 ** (i / 4) for i in range(0, 49)]
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in self.strategies:
            if s.feasible:
                ax.plot(ks, [s.per_step_ms(k) for k in ks], label=s.name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("steps between adapter switches")
        ax.set_ylabel("ms per step (amortised)")
        ax.set_title(f"{self.model} on {self.gpu}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def plan(model: str, *, adapters: int = 1, rank: int = 16, targets: tuple[str, ...] | None = None,
         gpu: str = "h100", batch: int | None = None, tokens: int | None = None, resolution: int | None = None,
         context: int | None = None, steps: int | None = None, switch_every: float = 1.0,
         adapters_per_batch: int = 1, blend: int = 1, tp: int = 1, cache_budget_gib: float | None = None,
         eager: bool = True, dtype: str | None = None, depth: dict | None = None) -> PlanResult:
    """Predict step time, switch cost and memory of every LoRA serving strategy for `model` on `gpu`.

    `switch_every`: steps (denoiser calls or decode tokens) between adapter/blend changes; `depth` overrides
    config keys (reduced-depth benchmarks). Reads config files only; see fdlora.plan.source.
    """
    if min(adapters, rank, switch_every, adapters_per_batch, blend, tp) <= 0:
        raise ConfigError("adapters, rank, switch_every, adapters_per_batch, blend and tp must be positive.")
    spec = source.resolve(model)
    spec.config.update(depth or {})
    if targets:
        spec.targets = tuple(targets)
    dt = source.DTYPES.get(dtype or spec.dtype)
    if dt is None:
        raise ConfigError(f"dtype {dtype!r}: use one of {', '.join(source.DTYPES)}.")
    w = dict(spec.workload)
    for k, v in dict(batch=batch, tokens=tokens, resolution=resolution, context=context, steps=steps).items():
        if v is not None:
            w[k] = v
    w.update(switch_every=switch_every, adapters_per_batch=adapters_per_batch, blend=blend, tp=tp, eager=eager)
    dev = devices.get(gpu)
    net = source.build(spec, dt)
    rec = trace(net, source.inputs(spec, net, dt, w))
    ops = rec.ops
    if spec.family == "llm":
        c = spec.config
        ops = shard(with_context(ops, w.get("context", 0)), tp, c["hidden_size"], c["num_hidden_layers"])
    strats, info = strategies(ops, rec.views, spec.targets, dev, dt, eager=eager, adapters=adapters, rank=rank,
                              blend=blend, groups=adapters_per_batch, budget_gib=cache_budget_gib)
    if info["lora_layers"] == 0:
        raise ConfigError(f"{model}: no Linear/Conv matches targets {list(spec.targets)}; pass --targets with "
                          "module name suffixes of this model (e.g. to_q q_proj).")
    weights = sum(p.numel() for p in net.parameters()) * dt.itemsize / 2**30 / tp
    info.update(weights_gib=weights, activations_gib=_activations(ops, spec, w, dt.itemsize))
    info.update(device_gib=dev.memory_gib, free_gib=dev.memory_gib - weights - info["activations_gib"])
    best, reason = _recommend(strats, switch_every, info)
    merged = next(s for s in strats if s.name == "merged")
    be = {s.name: _break_even(merged, s) for s in strats if s.name not in ("merged", "grouped") and s.feasible}
    return PlanResult(model, dev.name, dev.source, w, info, strats, best, reason, be)


def _activations(ops, spec, w, item) -> float:
    """Peak activations, roughly: the largest call's inputs and outputs, twice (+ the KV cache of an LLM)."""
    peak = 2 * max((o.bytes for o in ops if o.kind != "allreduce"), default=0.0)
    if spec.family == "llm":
        c = spec.config
        kvh = c.get("num_key_value_heads", c["num_attention_heads"])
        d = c["hidden_size"] // c["num_attention_heads"]
        peak += 2 * c["num_hidden_layers"] * w["batch"] * (w.get("context", 0) + w["tokens"]) * kvh * d * item
    return peak / 2**30


def _break_even(merged: Strategy, s: Strategy) -> float:
    """Steps between switches above which merging beats `s`: merged.switch/K + base < s.switch/K + s.step."""
    gain = s.step_ms - merged.step_ms
    if gain <= 0:
        return math.inf
    return max(0.0, (merged.switch_ms - s.switch_ms) / gain)


def _recommend(strats: list[Strategy], k: float, info: dict) -> tuple[str, str]:
    """The fastest strategy at a switch every `k` steps among those that fit: weights + activations + its +GiB
    within the device's memory (`free_gib` = memory - weights - activations: the numbers the table prints)."""
    free_gib = info["free_gib"]
    ok = [s for s in strats if s.feasible and s.extra_gib <= free_gib]
    if not ok:
        raise ConfigError(f"no strategy fits in memory ({free_gib:.1f} GiB free after weights and activations); use a "
                          "larger GPU, --tp, or the quantized base.")
    ok.sort(key=lambda s: s.per_step_ms(k))
    best, nxt = ok[0], (ok[1] if len(ok) > 1 else None)
    why = f"{best.per_step_ms(k):.2f} ms per step at a switch every {k:g} steps"
    if nxt:
        why += f", {nxt.per_step_ms(k) / best.per_step_ms(k):.2f}x faster than {nxt.name}"
    skipped = [s.name for s in strats if s.feasible and s.extra_gib > free_gib]
    if skipped and free_gib < 0:
        why += (f"; weights + activations ({info['weights_gib'] + info['activations_gib']:.2f} GiB) exceed the "
                f"device's {info['device_gib']:g} GiB, so {', '.join(skipped)} do not fit even at +0 GiB")
    elif skipped:
        why += f"; {', '.join(skipped)} need more than the {free_gib:.2f} GiB left after weights and activations"
    return best.name, why
