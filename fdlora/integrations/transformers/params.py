"""PEFT's LoRA on parameters (lora.ParamWrapper: `target_parameters`, and what "all-linear" wraps on MoE models)
as fd-lora adapter paths and factors.

PEFT wraps each targeted parameter in its own ParamWrapper; several parameters of one module nest, the
first targeted (in the module's parameter order) innermost, so a folder's keys are
"<module>(.base_layer)*.lora_A.weight": "<experts>.lora_A" is the outermost (last) parameter,
"<experts>.base_layer.lora_A" the one before. fd-lora names them by what they adapt:

    3-D expert parameter  "<experts>.<param>"   ModuleLora kind "experts" (fdlora.layers.modules.moe_experts)
    2-D weight (a router)  "<module>"            a linear ModuleLora, as PEFT's math is Linear's there
                                                  (fdlora.layers.modules.moe_router)
"""

from __future__ import annotations

import re

import torch
from torch import nn

from fdlora.errors import FormatError, TargetError
from fdlora.hub.adapter import ModuleLora
from fdlora.layers.modules import moe_experts as experts
from fdlora.layers.modules.fused import LayerSpec, _FusedLora, check_fits, spec_of
from fdlora.layers.modules.moe_router import is_router

BASE_LAYER = ".base_layer"


def is_param_wrapper(layer: nn.Module) -> bool:
    return type(layer).__name__ == "ParamWrapper"


def wrappers(path: str, layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """[(fd-lora path, PEFT LoRA layer)] of the PEFT layer at `path`: itself, or every ParamWrapper of a nest."""
    if not is_param_wrapper(layer):
        return [(path, layer)]
    out = []
    while is_param_wrapper(layer):
        param = getattr(layer.get_base_layer(), layer.parameter_name)
        out.append((f"{path}.{layer.parameter_name}" if param.dim() == 3 else path, layer))
        layer = layer.base_layer
    return out


def module_lora(path: str, layer: nn.Module, name: str, alpha: float, bias: torch.Tensor | None,
                magnitude: torch.Tensor | None, what: str) -> ModuleLora:
    """Adapter `name` of PEFT layer `layer` as a canonical ModuleLora, checked against the module it adapts."""
    A, B = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()
    if is_param_wrapper(layer):
        return factors(layer.get_base_layer(), layer.parameter_name, path, A, B, alpha, what)
    return ModuleLora(A, B, alpha, bias, magnitude=magnitude)


def factors(module: nn.Module, param: str, path: str, A: torch.Tensor, B: torch.Tensor, alpha: float,
            what: str) -> ModuleLora:
    """PEFT ParamWrapper factors of `module.param` (lora_A, lora_B as stored) -> a checked ModuleLora."""
    W = getattr(module, param, None)
    if isinstance(W, torch.Tensor) and W.dim() == 3:
        if not experts.is_experts(module) or param not in experts.expert_params(module):
            raise TargetError(f"{what}: {path} is a 3-D parameter of {type(module).__name__}, which is not an "
                              "experts module fd-lora runs (transformers' use_experts_implementation experts); serve "
                              "this adapter with PEFT.")
        m = ModuleLora(*experts.peft_factors(module, param, A, B), alpha)
        experts.check_fits(module, param, m, path, what)
        return m
    if param != "weight" or not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise TargetError(f"{what}: {path}.{param} is a {tuple(getattr(W, 'shape', ()))} parameter; fd-lora serves "
                          "LoRA on 3-D expert parameters and on 2-D `weight`s (routers, Linear-like modules).")
    m = ModuleLora(A, B, alpha)
    spec = spec_of(module) or (LayerSpec("linear", (W.shape[1],), W.shape[0]) if is_router(module) else None)
    if spec is None:
        raise TargetError(f"{what}: {path} is a {type(module).__name__}; fd-lora serves parameter LoRA on expert "
                          "parameters and router weights.")
    check_fits(spec, m, path, what)
    return m


def targeted_params(model: nn.Module, config: object) -> dict[str, list[str]]:
    """PEFT's `_inject_parameters` matching, as data: module path -> [its targeted parameter names in the module's
    parameter order (the nesting order: first innermost)], for `config.target_parameters`."""
    names = sorted(set(getattr(config, "target_parameters", None) or []))
    found: dict[str, list[str]] = {}
    if not names:
        return found
    alias = {p + ".base": p for p, mod in model.named_modules() if isinstance(mod, (experts.FusedLoraExperts,
                                                                                    _FusedLora))}
    for path, module in model.named_modules():
        path = alias.get(path, path)  # a module fd-lora wraps is known by its own path
        if not path:
            continue
        for pname, _ in module.named_parameters(recurse=False):
            key = f"{path}.{pname}"
            if key in names or any(key.endswith(f".{t}") for t in names):
                found.setdefault(path, []).append(pname)
    return found


def fd_path(model: nn.Module, module_path: str, param: str) -> str:
    """fd-lora's path for LoRA on `module_path`.`param`: "<module>.<param>" for a 3-D expert parameter, else the
    module path (a 2-D weight: Linear math)."""
    module = model.get_submodule(module_path)
    if isinstance(module, (experts.FusedLoraExperts, _FusedLora)):
        module = module.base
    return f"{module_path}.{param}" if getattr(module, param).dim() == 3 else module_path


_KEY = re.compile(r"^(?P<module>.+?)(?P<nest>(?:\.base_layer)*)$")


def saved_path(model: nn.Module, key_path: str, found: dict[str, list[str]], what: str) -> tuple[str, nn.Module,
                                                                                                  str] | None:
    """(fd-lora path, module, parameter) of a saved ParamWrapper key path "<module>(.base_layer)*", or None when
    that module has no targeted parameter (a regular LoRA module)."""
    m = _KEY.match(key_path)
    module_path, depth = m["module"], m["nest"].count(BASE_LAYER)
    params = found.get(module_path)
    if not params:
        return None
    if depth >= len(params):
        raise FormatError(f"{what}: {key_path} is ParamWrapper nesting level {depth}, but its LoraConfig targets only "
                          f"{params} on {module_path}; adapter_config.json does not fit the weights.")
    param = params[len(params) - 1 - depth]  # the outermost wrapper is the last targeted parameter
    module = model.get_submodule(module_path)
    if isinstance(module, (experts.FusedLoraExperts, _FusedLora)):
        module = module.base
    return fd_path(model, module_path, param), module, param


def remap(model: nn.Module, parts: dict[str, dict[str, torch.Tensor]], found: dict[str, list[str]],
          what: str) -> dict[str, dict[str, torch.Tensor]]:
    """A saved file's LoRA parts keyed by PEFT path ("<module>(.base_layer)*") -> keyed by fd-lora path, with
    3-D expert parameters' factors in fd-lora's layout (A [E, r, K], B [E, N, r]); other modules unchanged."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key_path, w in parts.items():
        hit = saved_path(model, key_path, found, what)
        if hit is None:
            out[key_path] = w
            continue
        path, module, param = hit
        if getattr(module, param).dim() == 3 and "A.weight" in w and "B.weight" in w:
            A, B = experts.peft_factors(module, param, w["A.weight"], w["B.weight"])
            w = {**w, "A.weight": A, "B.weight": B}
        out[path] = w
    return out


def to_peft(model: nn.Module, path: str, A: torch.Tensor, B: torch.Tensor,
            found: dict[str, list[str]]) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(PEFT key path, lora_A, lora_B) of fd-lora's LoRA at `path`, for writing a PEFT folder: 3-D factors back to
    ParamWrapper's lora_A [E*r, K] / lora_B [N, E*r], and the wrapper nesting of the module's targeted parameters
    (`found`, from `targeted_params`) in the key. Module LoRA that is not on a targeted parameter is unchanged."""
    target = experts.param_target(model, path)
    if target is not None:
        module_path, param = path.rpartition(".")[0], target[1]
        E, r, K = A.shape
        A, B = A.reshape(E * r, K), B.permute(1, 2, 0).reshape(B.shape[1], r * E)
    else:
        module_path, param = path, "weight"
    names = found.get(module_path, [])
    if param not in names:
        return path, A, B
    return module_path + BASE_LAYER * (len(names) - 1 - names.index(param)), A, B
