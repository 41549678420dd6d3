"""The load report: what was loaded from where, in which format and why, and what became of every key.

`str(report)` prints it (the `fdlora inspect` output). Every key of the source ends up matched
(it became part of a module), unused (nothing would read it) or dropped (it means something
fd-lora does not apply), each with its reason; `strict=True` turns any unused or dropped key into
an `UnusedKeysError`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import UnusedKeysError
from .adapter import ModuleLora

SHOW = 12  # list entries printed per section


@dataclass(frozen=True)
class GroupStats:
    """Modules of one component sharing a name (e.g. every `attn1.to_q`): how many, their ranks and alphas."""

    component: str
    group: str
    kind: str
    count: int
    ranks: tuple[int, ...]
    alphas: tuple[float, ...]


@dataclass
class LoadReport:
    source: str
    kind: str  # hub | dir | file | memory
    revision: str | None = None  # as requested
    sha: str | None = None  # commit it resolved to
    file: str | None = None
    file_choice: str = ""
    format: str = ""
    format_reason: str = ""
    also_matched: list[str] = field(default_factory=list)
    components: dict[str, int] = field(default_factory=dict)  # component -> module count
    # component -> modules, summarised into `groups` on first read (loads that nobody prints skip the work)
    modules_of: dict[str, dict[str, ModuleLora]] = field(default_factory=dict, repr=False, compare=False)
    rslora: dict[str, bool] = field(default_factory=dict)
    configs: dict[str, dict] = field(default_factory=dict)
    keys_total: int = 0
    keys_matched: int = 0
    keys_unused: dict[str, str] = field(default_factory=dict)
    keys_dropped: dict[str, str] = field(default_factory=dict)
    keys_saved: dict[str, str] = field(default_factory=dict)  # modules_to_save copies: not LoRA, not lost
    notes: list[str] = field(default_factory=list)
    # component -> why: applied by fd-lora where diffusers' load_lora_weights ignores it (Flux T5 LoRAs)
    diffusers_ignores: dict[str, str] = field(default_factory=dict)
    dtype: str | None = None
    nbytes: int = 0
    from_cache: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def modules(self) -> int:
        return sum(self.components.values())

    @property
    def groups(self) -> list[GroupStats]:
        """Rank and alpha per module group (`group_of`), per component."""
        got = self.__dict__.get("_groups")
        if got is None:
            got = self.__dict__["_groups"] = [g for c, mods in self.modules_of.items() for g in group_stats(c, mods)]
        return got

    def check_strict(self, asked: str = "strict=True", fix: str = "Pass strict=False to load the rest anyway.",
                     ) -> None:
        """Raise `UnusedKeysError` listing every unused or dropped key (what `strict=True` does). `asked` / `fix`
        word the option as the caller knows it (the CLI: --strict, drop --strict)."""
        bad = {**self.keys_unused, **self.keys_dropped}
        if bad:
            lines = "\n".join(f"  {k}: {why}" for k, why in list(bad.items())[:50])
            more = f"\n  ... and {len(bad) - 50} more" if len(bad) > 50 else ""
            raise UnusedKeysError(f"{self.source}: {asked} and {len(self.keys_unused)} keys are unused, "
                                  f"{len(self.keys_dropped)} dropped:\n{lines}{more}\n{fix}")

    def __str__(self) -> str:
        at = ""
        if self.kind == "hub":
            at = f" @ {self.revision or 'main'} -> {self.sha}"
        lines = [
            "fd-lora load report",
            f"  source    {self.source}{at}  [{self.kind}]",
            f"  file      {self.file_choice or self.file}",
            f"  format    {self.format}: {self.format_reason}"
            + (f" (also matched: {', '.join(self.also_matched)})" if self.also_matched else ""),
            f"  keys      {self.keys_total} total: {self.keys_matched} matched, {len(self.keys_unused)} unused, "
            f"{len(self.keys_dropped)} dropped"
            + (f", {len(self.keys_saved)} modules_to_save" if self.keys_saved else ""),
        ]
        for comp, n in self.components.items():
            extra = ", rsLoRA (alpha/sqrt(r))" if self.rslora.get(comp) else ""
            lines.append(f"  {comp}: {n} modules{extra}")
            for g in (g for g in self.groups if g.component == comp):
                scale = {round(a / r, 4) for r in g.ranks for a in g.alphas} if not self.rslora.get(comp) else None
                lines.append(f"    {g.group:<32} {g.kind:<6} x{g.count:<4} rank {_fmt(g.ranks):<8} "
                             f"alpha {_fmt(g.alphas):<8}" + (f" scale {_fmt(tuple(scale))}" if scale else ""))
        for title, keys in (("unused keys", self.keys_unused), ("dropped keys", self.keys_dropped),
                            ("modules_to_save keys", self.keys_saved)):
            if keys:
                lines.append(f"  {title} ({len(keys)}):")
                lines += [f"    {k}: {why}" for k, why in list(keys.items())[:SHOW]]
                if len(keys) > SHOW:
                    lines.append(f"    ... and {len(keys) - SHOW} more")
        lines += [f"  note      {c}: {why}" for c, why in self.diffusers_ignores.items()]
        lines += [f"  note      {n}" for n in self.notes]
        took = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        lines.append(f"  loaded    {self.dtype or 'file dtype'}, {self.nbytes / 1e6:.2f} MB"
                     + (", from the RAM cache" if self.from_cache else "") + (f"; {took}" if took else ""))
        return "\n".join(lines)


_PARTS = re.compile(r"\.(lora_down|lora_up|lora_A|lora_B|lora_mid|hada_\w+|lokr_\w+|alpha|diff|diff_b|dora_scale|"
                    r"lora_magnitude_vector)(\.\w+)*$")


def lost_modules(lost: dict[str, str]) -> dict[str, str]:
    """Lost keys grouped by the module they belong to: {module: why (of its first key)}."""
    out: dict[str, str] = {}
    for key, why in lost.items():
        out.setdefault(_PARTS.sub("", key), " ".join(why.split())[:160])
    return out


def group_of(path: str) -> str:
    """A name shared by a module's siblings across blocks: indices become *, and the path starts after the
    last index that has two or more segments below it (``attn1.to_q``, ``ff.net.*.proj``, ``resnets.*.conv1``)."""
    segs = ["*" if s.isdigit() else s for s in path.split(".")]
    cut = max((i + 1 for i, s in enumerate(segs) if s == "*" and len(segs) - i > 2), default=0)
    return ".".join(segs[cut:])


def group_stats(component: str, modules: dict[str, ModuleLora]) -> list[GroupStats]:
    acc: dict[tuple[str, str], list[ModuleLora]] = defaultdict(list)
    for path, m in modules.items():
        acc[(group_of(path), m.kind)].append(m)
    return [GroupStats(component, g, kind, len(ms), tuple(sorted({m.rank for m in ms})),
                       tuple(sorted({float(m.alpha) for m in ms})))
            for (g, kind), ms in sorted(acc.items())]


def _fmt(values: tuple) -> str:
    vals = [f"{v:g}" for v in values]
    return vals[0] if len(vals) == 1 else "{" + ",".join(vals[:6]) + (",..." if len(vals) > 6 else "") + "}"
