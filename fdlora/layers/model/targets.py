"""Which modules to wrap: PEFT's own target semantics (suffix list, regex, "all-linear", exclusions)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fdlora.errors import TargetError
from fdlora.extras import detached_import
from fdlora.layers.modules.fused import _FusedLora, spec_of

Targets = str | Sequence[str]


def match_targets(
    model: nn.Module,
    targets: Targets,
    exclude: Targets | None = None,
    layers_to_transform: int | Sequence[int] | None = None,
    layers_pattern: str | Sequence[str] | None = None,
) -> list[str]:
    """Module paths of `model` that PEFT would target with the same LoraConfig fields (PEFT's own code when it
    is installed; without it, the core install matches suffix lists and full-match regexes the same way)."""
    try:
        detached_import("peft.tuners.tuners_utils")  # (a first import of peft must not keep this call's frames)
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists
    except ModuleNotFoundError:
        LoraConfig = None
        check_target_module_exists = _core_matcher(targets, exclude, layers_to_transform, layers_pattern)
    if LoraConfig is not None:
        cfg = LoraConfig(
            target_modules=targets if isinstance(targets, str) else list(targets),
            exclude_modules=exclude if exclude is None or isinstance(exclude, str) else list(exclude),
            layers_to_transform=layers_to_transform,
            layers_pattern=layers_pattern,
        )
        cfg = _maybe_include_all_linear_layers(cfg, model)
    else:
        cfg = None
    inside_fused = set()
    paths = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(p + ".") for p in inside_fused):
            continue
        if isinstance(module, _FusedLora):
            inside_fused.add(path)
            continue
        hit = check_target_module_exists(cfg, path)
        if hit and type(hit).__name__ != "_ExcludedModule":
            paths.append(path)
    if not paths:
        names = [p for p, _ in model.named_modules() if p][:8]
        raise TargetError(
            f"targets {targets!r} match no module of {type(model).__name__} (first modules: {names}). "
            "Targets follow PEFT: a list of module-name suffixes, a full-match regex string, or 'all-linear'."
        )
    unsupported = [f"{p} ({type(model.get_submodule(p)).__name__})" for p in paths
                   if spec_of(model.get_submodule(p)) is None]
    if unsupported:
        raise TargetError(
            f"fd-lora wraps Linear, transformers Conv1D, Conv2d and Linear-like modules; these targets are not: "
            f"{unsupported[:10]}. Narrow the targets (e.g. 'to_q' instead of 'attn1')."
        )
    return paths


def _core_matcher(targets: Targets, exclude: Targets | None, layers_to_transform, layers_pattern):
    """PEFT's check_target_module_exists for plain targets (a suffix list or a full-match regex, with exclusions),
    for installs without peft; 'all-linear' and layer selection need peft's own code."""
    import re

    if targets == "all-linear" or layers_to_transform is not None or layers_pattern is not None:
        from fdlora.extras import missing

        raise missing("peft", "targets='all-linear' / layers_to_transform / layers_pattern")

    def hit(spec: Targets, path: str) -> bool:
        if isinstance(spec, str):
            return re.fullmatch(spec, path) is not None
        return path in spec or any(path.endswith("." + t) for t in spec)

    def check(_cfg, path: str) -> bool:
        return hit(targets, path) and not (exclude is not None and hit(exclude, path))

    return check

