"""The docs stay true to the code: every error class has a troubleshooting row, every public name an API section,
every training key a reference row; the README stays short and free of development history; the charts render from
the committed results; the pictures the commands save carry their caption rows."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HISTORY = re.compile(r"\b[Ss]ession \d+|_s\d+[a-z]?\.json|\bsessions? \d+")


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_error_class_has_a_troubleshooting_row():
    tree = ast.parse((ROOT / "fdlora" / "errors.py").read_text())
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    page = (DOCS / "troubleshooting.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)`", page, re.M))
    assert classes and not [c for c in classes if c not in rows], "add a row to docs/troubleshooting.md"


def test_api_reference_covers_fdlora_all_by_public_name():
    import fdlora

    page = _hook("api_reference").render()
    missing = [n for n in fdlora.__all__ if n != "FdLoraError" and f'heading: "fdlora.{n}"' not in page
               and f"`fdlora.{n}`" not in page]
    assert not missing
    assert "::: fdlora.errors" in page and "::: fdlora.config" in page


def test_training_reference_lists_every_schema_key():
    pytest.importorskip("peft")
    from fdlora.training import schema

    page = _hook("training_reference").render()
    for section, keys in schema.KEYS.items():
        assert f"## `{section}`" in page
        for key in keys:
            assert f"| `{key}` |" in page, f"{section}.{key}"


def test_readme_is_short_and_speaks_of_the_project_not_its_making():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert not HISTORY.findall(readme)
    assert "bash scripts/quickstart.sh" in readme and "bash scripts/test.sh" in readme
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert (ROOT / image).is_file(), image


def test_docs_prose_has_no_development_history_and_images_exist():
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        assert not HISTORY.findall(text), page
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
            assert (page.parent / image).resolve().is_file(), f"{page}: {image}"


def test_plot_renders_every_chart_from_the_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "benchmarks" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    sys.modules["bench_plot"] = plot
    spec.loader.exec_module(plot)
    assert plot.main(["--out", str(tmp_path)]) == 0
    written = {p.name for p in tmp_path.iterdir()}
    committed = {p.name for p in (DOCS / "assets").iterdir() if p.is_file()}
    assert written and written <= committed, "run `python benchmarks/plot.py` and commit docs/assets"
    for name in ("x_base_nvidia-h100-80gb-hbm3", "x_base_h200_alone", "load_latency", "train_step", "memory"):
        assert f"{name}.png" in written and f"{name}.svg" in written


def test_captions_name_adapters_and_weights_and_measure_colour():
    pytest.importorskip("PIL")
    import torch

    try:  # the quickstart as a package (captions.py in it), or as modules beside each other
        from fdlora.apps.quickstart.captions import blend_sweep_grid, captioned_image, describe
    except ImportError:
        from fdlora.apps.quickstart_captions import blend_sweep_grid, captioned_image, describe

    assert describe({"warm": 0.75, "cool": 0.25}) == "warm 0.75 + cool 0.25"
    assert describe(None) == "no adapter" and describe("pixel") == "pixel 1"
    red, blue = torch.zeros(3, 8, 8), torch.zeros(3, 8, 8)
    red[0], blue[2] = 1.0, 1.0
    grid, stats = blend_sweep_grid([red, blue], [{"warm": 1.0}, {"cool": 1.0}], title="t")
    assert stats[0][0] == pytest.approx(1.0) and stats[0][2] == pytest.approx(0.0)
    assert stats[1][2] == pytest.approx(1.0)
    assert grid.height > 160 + 40  # tiles plus caption lines and colour bars
    image = captioned_image(red, {"warm": 0.8}, prompt="a castle", extra="4 steps, seed 0", tile_px=64)
    assert image.width >= 64 and image.height > 64 + 3 * 14  # three caption lines under the image
    # the caption row is white with dark text: the rows under the image are not the image's colour
    below = image.crop((0, 64 + 12, image.width, image.height)).convert("RGB")
    assert (255, 255, 255) in [c for _, c in below.getcolors(1 << 16)]
