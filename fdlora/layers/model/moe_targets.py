"""Where MoE layers go in a model, for the handle: routers, fused expert parameters, routed-expert containers.

The handle knows layers by path and swaps a fused layer in at that path. Two MoE kinds need more:
a fused expert parameter ("<experts>.<param>", fdlora.layers.modules.moe_experts) is not a module, so its layer
goes into the `FusedLoraExperts` that replaces its experts module; and Linear layers inside a routed
container (Switch-Transformers' experts, fdlora.layers.modules.moe_routed) need that container wrapped so that
per-row adapters follow the gathered tokens. The handle asks this module first (`make`, `check`,
`put`, `take`, `enter`, `leave`) and does its usual swap when the answer is "not mine".
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fdlora.hub.adapter import ModuleLora
from fdlora.layers.modules import moe_experts as experts
from fdlora.layers.modules import moe_routed as routed
from fdlora.layers.modules import moe_router as router
from fdlora.layers.state import ModelState


def _module(model: nn.Module, path: str, modules: Mapping[str, nn.Module] | None = None) -> nn.Module | None:
    if modules is not None:
        return modules.get(path)
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _router_at(model: nn.Module, path: str, modules: Mapping[str, nn.Module] | None = None) -> nn.Module | None:
    base = _module(model, path, modules)
    return base if base is not None and router.is_router(base) else None


def check(model: nn.Module, path: str, m: ModuleLora, what: str,
          modules: Mapping[str, nn.Module] | None = None) -> bool:
    """True if `path` (not wrapped yet) is a MoE target and LoRA `m` fits it; raises if it is one and `m` does not
    fit; False for every other path. `modules`: the model's modules by path, if the caller has them."""
    target = experts.param_target(model, path, modules)
    if target is not None:
        experts.check_fits(*target, m, path, what)
        return True
    base = _router_at(model, path, modules)
    if base is not None:
        router.check(base, m, path, what)
        return True
    return False


def make(model: nn.Module, path: str, state: ModelState, index: int, rank: int, dtype: torch.dtype | None,
         modules: Mapping[str, nn.Module] | None = None) -> nn.Module | None:
    """The layer for a MoE target at `path` (an ExpertLora or a FusedLoraRouter), or None for any other path."""
    target = experts.param_target(model, path, modules)
    if target is not None:
        return experts.ExpertLora(*target, state, index, path, rank, dtype)
    base = _router_at(model, path, modules)
    return None if base is None else router.FusedLoraRouter(base, state, index, path, rank, dtype)


def put(model: nn.Module, layer: nn.Module) -> bool:
    """Place an expert parameter's layer in the FusedLoraExperts at its experts path (replacing the experts module
    first if needed): True. False: the handle swaps `layer` in at its path."""
    if not isinstance(layer, experts.ExpertLora):
        return False
    parent = layer.path.rpartition(".")[0]
    module = model.get_submodule(parent)
    if not isinstance(module, experts.FusedLoraExperts):
        module = experts.FusedLoraExperts(module)
        set_module(model, parent, module)
    module.loras[layer.param] = layer
    return True


def take(model: nn.Module, layer: nn.Module) -> bool:
    """Take an expert parameter's layer out, the original experts module back when no parameter has LoRA any more:
    True. False: the handle swaps the original back at the layer's path."""
    if not isinstance(layer, experts.ExpertLora):
        return False
    parent = layer.path.rpartition(".")[0]
    module = model.get_submodule(parent)
    if isinstance(module, experts.FusedLoraExperts):
        del module.loras[layer.param]
        if not len(module.loras):
            set_module(model, parent, module.base)
    return True


def enter(model: nn.Module, state: ModelState, paths: list[str]) -> None:
    """After fused layers were swapped in at `paths`: a RoutedExperts over every served routed-expert container
    (fdlora.layers.modules.moe_routed.FORWARDS) that holds one of them."""
    for path, m in list(model.named_modules()):
        if type(m).__name__ in routed.FORWARDS and any(p.startswith(path + ".") for p in paths):
            set_module(model, path, routed.RoutedExperts(m, state))


def leave(model: nn.Module) -> None:
    """Restore: every routed-expert container back."""
    for path, m in list(model.named_modules()):
        if isinstance(m, routed.RoutedExperts):
            set_module(model, path, m.original)


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
