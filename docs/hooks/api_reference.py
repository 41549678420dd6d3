"""MkDocs hook: the API reference page, generated at build time from the public names of the package.

Every name in `fdlora.__all__` gets a section rendered by mkdocstrings from its docstring and signature, headed by
its public name (`fdlora.set_adapters`); the module the object is defined in is looked up when the site is built,
so the page never names an internal module path and follows the code when modules move. A name added to
`__all__` without a group below lands under "More" rather than being missed. `fdlora.errors` and `fdlora.config`
are public modules and are rendered whole. `python docs/hooks/api_reference.py` prints the page.
"""

from __future__ import annotations

PAGE = "reference/api.md"
GROUPS = {
    "Pipelines and models": (
        "Load adapters into a diffusers pipeline (`pipe.load_fd_lora`, added to every `DiffusionPipeline` by "
        "`import fdlora`) or a Transformers model, and scope a request's adapters.",
        ["load_fd_lora", "from_diffusers", "from_peft", "FdLoraModel", "save_peft", "merge_and_unload", "adapters"]),
    "Adapters on any torch model": (
        "The core API (no extra needed): wrap target layers, load adapters into banks, switch and blend them.",
        ["inject", "add_adapter", "set_adapters", "active_adapters", "delete_adapter", "per_sample", "per_row",
         "disable", "enable", "restore", "handle", "FdLoraHandle", "FusedLoraLinear", "FusedLoraConv2d"]),
    "Reading adapters": (
        "Resolve, read and convert LoRA files into canonical adapters without a model.",
        ["load_adapters", "LoadReport", "LoraAdapter", "ModuleLora", "Provenance", "AdapterPool", "AdapterCache"]),
    "Speed: caches, graphs, backends, cold start": (
        "The merged-weight cache, CUDA-graph capture, the kernel backend, and loading while serving.",
        ["set_merge_cache", "merge_cache_bytes", "capture_steps", "release_steps", "set_backend", "use_backend",
         "warmup", "prefetch"]),
    "Training": ("Trainable LoRA on the fused layers; the result saves as a PEFT adapter.",
                 ["add_trainable_adapter", "trainable_parameters", "lora_parameters"]),
    "Configs and the planner": ("Build from a YAML run config; predict the cost of each serving strategy.",
                                ["from_config", "plan"]),
}
SKIP = {"FdLoraError"}  # documented with fdlora.errors


def _target(obj) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    return f"{module}.{qualname}"


def _section(name: str, obj) -> str:
    target = _target(obj)
    if target is None:
        return f"### `fdlora.{name}`\n\n{(getattr(obj, '__doc__', None) or '').strip()}\n"
    return (f"::: {target}\n"
            f"    options:\n"
            f"      heading: \"fdlora.{name}\"\n"
            f"      toc_label: \"fdlora.{name}\"\n"
            f"      show_root_full_path: false\n")


def render() -> str:
    import fdlora

    public = [n for n in fdlora.__all__ if n not in SKIP]
    grouped = {n for _, names in GROUPS.values() for n in names}
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings of the public API: every name in `fdlora.__all__` (import it as",
        "`fdlora.<name>`), then the public modules `fdlora.errors` and `fdlora.config`. Where a name's import needs an",
        "extra (diffusers, transformers, ...), calling it without the extra raises `MissingExtraError` naming it.",
        "",
        "![What the calls below cost at full size](../assets/x_base_nvidia-h100-80gb-hbm3.png){ width=\"560\" }",
        "",
        "*The step cost of the calls below on full-size models (H100); see [performance](../performance.md).*",
        "",
    ]
    more = [n for n in public if n not in grouped]
    groups = list(GROUPS.items()) + ([("More", ("Other public names.", more))] if more else [])
    for title, (intro, names) in groups:
        names = [n for n in names if n in public]
        if not names:
            continue
        lines += [f"## {title}", "", intro, ""]
        for name in names:
            lines += [_section(name, getattr(fdlora, name)), ""]
    lines += ["## Errors: `fdlora.errors`", "",
              "Every error fd-lora raises on purpose; each message says what failed, why and what to do. Fixes: "
              "[troubleshooting](../troubleshooting.md).", "",
              "::: fdlora.errors\n    options:\n      show_root_heading: false\n      heading_level: 3\n", "",
              "## Configs: `fdlora.config`", "",
              "::: fdlora.config\n    options:\n      show_root_heading: false\n      heading_level: 3\n", ""]
    return "\n".join(lines)


def on_files(files, config):  # noqa: D103  (mkdocs hook)
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
