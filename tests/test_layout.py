"""The package's layout holds: imports flow one way, folders stay small, nothing is loaded behind the reader's back.

Every `import` / `from ... import` in fdlora/, at any depth (function-level ones too: a lazy import is still a
dependency), is read with ast and resolved to a module of the package. Checked:
- no cycle between modules;
- the top-level packages import only packages of a lower rank (RANKS), and the subpackages of one package form no
  loop (a package loop is a cycle between folders, even where no two files import each other);
- no folder holds more than 12 modules;
- `importlib.import_module` only where a module is chosen at run time (ALLOWED_IMPORT_MODULE), each with a comment.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import defaultdict
from pathlib import Path

import pytest

import fdlora

ROOT = Path(fdlora.__file__).parent

# top-level packages and modules by rank: each imports only from lower ranks (or its own package)
RANKS = [
    {"fdlora.errors"},
    {"fdlora.env", "fdlora.extras", "fdlora.steps", "fdlora.testing", "fdlora.quiet"},
    {"fdlora.kernels", "fdlora.hub"},
    {"fdlora.layers"},
    {"fdlora.runtime"},
    {"fdlora.api"},
    {"fdlora.integrations"},
    {"fdlora.fixtures"},
    {"fdlora.config"},
    {"fdlora.plan", "fdlora.training", "fdlora.serve"},
    {"fdlora"},
    {"fdlora.apps"},
    {"fdlora.__main__"},
]
RANK = {name: i for i, names in enumerate(RANKS) for name in names}

# the places that load a module whose name is decided at run time, and why
ALLOWED_IMPORT_MODULE = {
    "fdlora/__init__.py",  # integration entry points load on first use: each needs an optional extra
    "fdlora/hub/__init__.py",  # huggingface_hub and diffusers load only when a source is resolved
    "fdlora/serve/__init__.py",  # Ray Serve and FastAPI load only when a deployment is made
    "fdlora/kernels/registry.py",  # a backend's ops module loads when that backend is first chosen
    "fdlora/hub/worker.py",  # the reader process imports the converters a worker will need
    "fdlora/extras.py",  # an optional extra's module, named by the caller, with the install line if missing
    "fdlora/apps/cli.py",  # a subcommand's module loads only when that subcommand runs (start-up time)
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("fdlora", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The fdlora modules that module `name` imports (a package's own __init__ when no submodule is named)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fdlora")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fdlora":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.update(subs or [target])
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _top(name: str) -> str:
    parts = name.split(".")
    return name if len(parts) == 1 else ".".join(parts[:2])


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)) is not None:
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None


def test_no_module_imports_itself_back():
    # a package's __init__ importing its own submodules is how a package shows its face: leave those edges out
    graph = {a: {b for b in bs if a not in _ancestors(b)} for a, bs in GRAPH.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_every_top_level_package_has_a_rank():
    assert {_top(m) for m in MODULES} <= set(RANK), sorted({_top(m) for m in MODULES} - set(RANK))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down(name: str):
    here = _top(name)
    up = sorted(m for m in GRAPH[name] if _top(m) != here and RANK[_top(m)] >= RANK[here])
    assert not up, f"{name} (rank {RANK[here]}) imports {up}: move the shared piece down instead"


def test_no_package_loops():
    """Between the subpackages (and modules) of any one package, folder-level imports form no cycle."""
    for parent in sorted({m for m in MODULES if _is_package(m)}):
        depth = parent.count(".") + 2
        edges: dict[str, set[str]] = defaultdict(set)
        for a, bs in GRAPH.items():
            if not a.startswith(parent + "."):
                continue
            for b in bs:
                if not b.startswith(parent + "."):
                    continue
                pa, pb = ".".join(a.split(".")[:depth]), ".".join(b.split(".")[:depth])
                if pa != pb:
                    edges[pa].add(pb)
        assert _cycle(edges) is None, f"inside {parent}: " + " -> ".join(_cycle(edges))


def test_folders_stay_small():
    big = {}
    for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
        if n > 12:
            big[str(folder.relative_to(ROOT.parent))] = n
    assert not big, f"folders of more than 12 modules (split them by role): {big}"


def test_import_module_only_where_a_module_is_chosen_at_run_time():
    found = set()
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if re.search(r"\bimport_module\(|__import__\(", text):
            found.add(str(path.relative_to(ROOT.parent)))
    assert found <= ALLOWED_IMPORT_MODULE, sorted(found - ALLOWED_IMPORT_MODULE)


def test_lower_layers_never_import_integrations_or_apps():
    lower = ("fdlora.kernels", "fdlora.layers", "fdlora.hub", "fdlora.runtime")
    for name, targets in GRAPH.items():
        if name.startswith(lower):
            bad = [t for t in targets if t.startswith(("fdlora.integrations", "fdlora.apps"))]
            assert not bad, f"{name} imports {bad}"


def test_public_names_resolve():
    for name in fdlora.__all__:
        assert getattr(fdlora, name) is not None, name


@pytest.mark.parametrize("a,b", list(itertools.combinations(["fdlora.layers", "fdlora.kernels", "fdlora.hub"], 2)))
def test_library_core_packages_do_not_depend_on_each_other_both_ways(a: str, b: str):
    ab = any(_top(t) == b for m, ts in GRAPH.items() if _top(m) == a for t in ts)
    ba = any(_top(t) == a for m, ts in GRAPH.items() if _top(m) == b for t in ts)
    assert not (ab and ba), f"{a} and {b} import each other"
