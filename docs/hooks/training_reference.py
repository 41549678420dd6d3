"""MkDocs hook: the training YAML reference page, generated from fdlora/training/schema.py at build time.

The keys come from the schema's `KEYS`; each key's default from validating a minimal config (`TrainConfig`); what is
allowed from the schema's own error for a bad value (the same one-line ConfigError a user gets), so the page cannot
drift from the validator. `python docs/hooks/training_reference.py` prints the page.
"""

from __future__ import annotations

from typing import Any

PAGE = "reference/training-yaml.md"
MINIMAL = {"model": {"name": "tiny-vit"}, "lora": {"r": 8}}
# key -> TrainConfig attribute holding its value after validation (None: not kept as one attribute)
FIELDS = {"model.name": "model", "model.task": "task", "lora.alpha": "alpha", "data.source": "data",
          "output.dir": "output", "output.push_to_hub": "push_to_hub", "quantization.enabled": None,
          "quantization.method": "quant_method"}
QUANT_FIELDS = {"quantization.type": "type", "quantization.compute_dtype": "compute_dtype",
                "quantization.double_quant": "double_quant", "quantization.skip_modules": "skip_modules"}


class _Bad:
    """A value no check accepts (not a str, number, bool, list or mapping)."""

    def __repr__(self) -> str:
        return "<bad value>"


def _config(section: str, key: str, value: Any) -> dict:
    cfg = {"model": dict(MINIMAL["model"]), "lora": dict(MINIMAL["lora"])}
    if section == "quantization":
        cfg["quantization"] = {"enabled": True, key: value} if key != "enabled" else {"enabled": value}
    elif section in ("data", "output"):
        cfg[section] = {"source" if section == "data" else "dir": "x", key: value}
    else:
        cfg.setdefault(section, {})[key] = value
    return cfg


def _allowed(schema, section: str, key: str) -> tuple[str, str]:
    """(allowed, fix) from the schema's error for a bad value of section.key; ("any string", "") if none."""
    from fdlora.errors import ConfigError

    for bad in (_Bad(), "", -1, "__not_a_choice__"):
        try:
            schema.validate(_config(section, key, bad), "<config>")
        except ConfigError as e:
            msg = str(e)
            if f"{section}.{key}" not in msg and not (section == "model" and "model." in msg):
                continue
            allowed = msg.split("; allowed: ", 1)[1].split("; fix: ", 1)[0] if "; allowed: " in msg else ""
            fix = msg.split("; fix: ", 1)[1] if "; fix: " in msg else ""
            if allowed:
                return allowed, fix
        except Exception:  # a check that needs more than the schema (bitsandbytes, a model): no line from it
            continue
    return "any string", ""


def _default(schema, cfg, section: str, key: str) -> str:
    path = f"{section}.{key}"
    if path in QUANT_FIELDS:  # QuantSpec's own defaults (what an enabled section without the key gets)
        import dataclasses

        from fdlora.training.quant import QuantSpec

        f = {f.name: f for f in dataclasses.fields(QuantSpec)}[QUANT_FIELDS[path]]
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        return str(value).lower() if isinstance(value, bool) else str(value)
    if path == "quantization.enabled":
        return "true when the section is given (off when it is absent)"
    if path in ("model.name", "lora.r"):
        return "required"
    if path == "model.task":
        return "from the model for tiny-*; required otherwise"
    if path == "lora.alpha":
        return "r"
    attr = FIELDS.get(path, key)
    if attr is None or not hasattr(cfg, attr):
        return "—"
    value = getattr(cfg, attr)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def render() -> str:
    import dataclasses
    import textwrap

    from fdlora.training import schema

    cfg = schema.validate(MINIMAL, "<config>")
    lines = [
        "# Training YAML reference",
        "",
        "Generated from `fdlora/training/schema.py` when the docs are built: the sections and keys `fdlora train`",
        "accepts, each key's default, and what the validator allows (the same text its one-line error prints).",
        "Unknown keys are refused with a *did you mean*. The schema's own summary:",
        "",
        "```text",
        textwrap.dedent(schema.__doc__.split("\n\n")[1]).rstrip(),
        "```",
        "",
    ]
    for section in schema.SECTIONS:
        lines += [f"## `{section}`", "", "| key | default | allowed | fix on error |", "|---|---|---|---|"]
        for key in schema.KEYS[section]:
            allowed, fix = _allowed(schema, section, key)
            default = _default(schema, cfg, section, key)
            cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines.append(f"| `{key}` | {cell(default)} | {cell(allowed)} | {cell(fix)} |")
        lines.append("")
    shorthand = ("`data: <source>` is short for `data: {source: <source>}`, `output: <dir>` for "
                 "`output: {dir: <dir>}`.")
    fields = ", ".join(f"`{f.name}`" for f in dataclasses.fields(schema.TrainConfig))
    lines += ["## Notes", "", shorthand, "",
              f"`fdlora.training.schema.load(path)` returns a `TrainConfig` with the fields {fields}.", ""]
    return "\n".join(lines)


def on_files(files, config):  # noqa: D103  (mkdocs hook)
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
