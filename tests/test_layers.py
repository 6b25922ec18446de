"""The package's layers flow one way: no module imports a layer above it, and none imports an entry point.

0  the package root, config, exits, network, liveness, run_length, argtypes
1  dist, data, models, observe, checkpoint (stores, commit protocol, fencing), metrics, debug, holds,
   compile; prep (offline preparation: it builds the feature cache that data, the training-time input
   side, opens; data never imports prep)
2  train_state, optim, evaluation, export, output_paths, report (what a run did, drawn: it reads observe's
   logs)
3  elastic (control plane, session, signals, watchdog), loop (the trainer's parts: model, step, scoring)
4  trainer
5  entry points: train, cli, ckpt, bench, chaos, launcher, api, serve (who may use whom: ENTRY_USES; none of
   them is imported by anything below, but for the package root's lazy re-export of the Python API:
   `elastic_qa.fit` is `elastic_qa.api.fit`)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO

LAYERS = {
    "elastic_qa": 0, "config": 0, "config_changes": 0, "run_qa_recipe": 0, "exits": 0, "network": 0,
    "liveness": 0, "run_length": 0, "argtypes": 0,
    "dist": 1, "data": 1, "models": 1, "observe": 1, "checkpoint": 1, "metrics": 1, "debug": 1,
    "step_holds": 1, "compile": 1,
    "prep": 1,
    "train_state": 2, "optim": 2, "evaluation": 2, "export": 2, "output_paths": 2, "report": 2,
    "elastic": 3, "loop": 3, "session": 3,
    "trainer": 4,
    "train": 5, "cli": 5, "ckpt": 5, "bench": 5, "chaos": 5, "launcher": 5, "api": 5,
    "serve": 5, "replica": 5,
}  # fmt: skip
# Among the entry points, who may use whom (a subprocess is not an import).
ENTRY_USES = {
    "cli": {"train", "ckpt", "bench", "chaos", "launcher", "serve", "replica"},
    "replica": {"launcher"},  # the loopback stores and process helpers its launcher shares
    "bench": {"chaos", "launcher", "replica"},
    "chaos": {"launcher", "replica"},  # chaos/replicas.py drives `elastic-qa replicas`, judges its ledger
    "launcher": {"train"},  # launcher/warm_start.py: the forkserver imports the worker for its forks
    "api": {"train", "launcher"},
}
FACADE = {("elastic_qa", "api")}  # the package root re-exports the Python API, imported on first use


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports() -> dict[str, set[str]]:
    """unit -> the units it imports (only imports of elastic_qa itself)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in (REPO / "elastic_qa").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "elastic_qa":
                names = (
                    [f"elastic_qa.{a.name}" for a in node.names]
                    if node.module == "elastic_qa"
                    else [node.module]
                )
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "elastic_qa"]
            else:
                continue
            for name in names:
                if (
                    unit(name) != unit(module)
                    and unit(name) in LAYERS
                    and (unit(module), unit(name)) not in FACADE
                ):
                    found[unit(module)].add(unit(name))
    return found


def test_every_unit_of_the_package_has_a_layer() -> None:
    units = {
        unit(".".join(p.relative_to(REPO).with_suffix("").parts)) for p in (REPO / "elastic_qa").rglob("*.py")
    }
    units.discard("__init__")
    assert units - set(LAYERS) == set(), "give the new module a layer in this test and in docs/layout.md"


def test_the_layout_page_names_every_module_and_package() -> None:
    """docs/layout.md lists the package's parts: each top-level module (name.py) and package (name/)."""
    layout = (REPO / "docs" / "layout.md").read_text()
    parts = [
        p.name + ("/" if p.is_dir() else "")
        for p in (REPO / "elastic_qa").iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    ]
    assert parts, "no modules found"
    assert [p for p in parts if p not in layout] == [], "name them in docs/layout.md"


def layout_entries() -> dict[str, str]:
    """docs/layout.md's tree: each entry (`  name.py`, `  name/`) -> its text, continuation lines included."""
    block = (REPO / "docs" / "layout.md").read_text().split("```")[1]
    entries: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            current = line.split()[0]
        if current:
            entries[current] = entries.get(current, "") + line + "\n"
    return entries


def test_the_layout_page_names_every_module_under_its_package() -> None:
    """Every module of a package of elastic_qa is named in that package's entry of docs/layout.md: a new
    module without its line, or a line left for a module that is gone, fails here."""
    entries = layout_entries()
    modules = sorted(
        p.relative_to(REPO / "elastic_qa")
        for p in (REPO / "elastic_qa").rglob("*.py")
        if p.name != "__init__.py" and len(p.relative_to(REPO / "elastic_qa").parts) > 1
    )
    assert len(modules) > 50, modules
    unnamed = [str(m) for m in modules if m.name not in entries.get(f"{m.parts[0]}/", "")]
    assert unnamed == [], "name each in its package's entry of docs/layout.md"
    named = {
        (top, word.strip("(),;`+"))
        for top, text in entries.items()
        if top.endswith("/")
        for word in text.split()
        if word.strip("(),;`+").endswith(".py")
    }
    stale = sorted(
        f"{top}{name}"
        for top, name in named
        if (REPO / "elastic_qa" / top).is_dir() and not list((REPO / "elastic_qa" / top).rglob(name))
    )
    assert stale == [], "docs/layout.md names modules that do not exist"


def test_no_module_imports_a_layer_above_it_or_an_entry_point() -> None:
    wrong = []
    for source, targets in imports().items():
        for target in targets:
            if LAYERS[target] > LAYERS[source]:
                wrong.append(f"{source} -> {target} (layer {LAYERS[source]} imports layer {LAYERS[target]})")
            elif LAYERS[target] == 5 and target not in ENTRY_USES.get(source, set()):
                wrong.append(f"{source} -> {target} (an entry point)")
    assert wrong == []


def test_no_import_cycles_between_units() -> None:
    graph = imports()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ())
        )

    cycles = sorted(unit for unit in graph if reaches(unit, unit, {unit}))
    assert cycles == []


def test_only_the_entry_points_live_outside_the_package() -> None:
    """launch/ and chaos/ at the top of the repository are thin shells over the package."""
    for shim in ("launch", "chaos"):
        for path in (REPO / shim).glob("*.py"):
            assert len(path.read_text().splitlines()) <= 40, f"{path} holds logic; move it into elastic_qa/"


def module_name(path: Path) -> str:
    """The dotted name of a module file inside its top package (the outermost folder with __init__.py)."""
    parts = list(path.with_suffix("").parts)
    top = len(parts) - 1
    while (Path(*parts[:top]) / "__init__.py").exists():
        top -= 1
    name = ".".join(parts[top:])
    return name.removesuffix(".__init__")


def cycles(package_dir: Path) -> list[list[str]]:
    """The import circles among the modules of a package (its subpackages included): every `import` and
    `from ... import`, at module level or inside a function, counts. Each circle is a sorted list of
    the modules in it (a strongly connected component); none: []."""
    files = {module_name(path): path for path in sorted(package_dir.rglob("*.py"))}

    def target(module: str, imported: str, name: str | None) -> str | None:
        for candidate in ([f"{imported}.{name}"] if name else []) + [imported]:
            if candidate in files and candidate != module:
                return candidate
        return None

    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 packages
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                pairs = [(base, alias.name) for alias in node.names]
            else:
                continue
            graph[module].update(t for imported, name in pairs if (t := target(module, imported, name)))
    # Tarjan's strongly connected components; a component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return sorted(found)


def test_cycles_finds_a_circle_made_by_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n")
    (package / "c.py").write_text("from . import a\n")
    assert cycles(package) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("B = 1\n")
    assert cycles(package) == []


@pytest.mark.parametrize("package", ["checkpoint", "data", "prep", "report", "observe"])
def test_no_import_circles_among_the_modules_of_a_package(package: str) -> None:
    assert cycles(REPO / "elastic_qa" / package) == []


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports, anywhere in its body (`from X import Y` counts as X and X.Y)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def test_only_open_store_knows_the_checkpoint_backends() -> None:
    """store.py is the backends' abstract base and imports none of them; backends.py (open_store) does."""
    checkpoint = REPO / "elastic_qa" / "checkpoint"
    users = {
        path.stem
        for path in checkpoint.glob("*.py")
        if {"elastic_qa.checkpoint.store_rename", "elastic_qa.checkpoint.store_manifest"}
        & set(imported_modules(path))
    }
    assert users == {"backends"}


def prep_imports(path: Path) -> list[str]:
    """Each import of elastic_qa.prep in a module (any level): `from MODULE import NAME`, `import MODULE`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "elastic_qa":
                found += [f"from elastic_qa import {a.name}" for a in node.names if a.name == "prep"]
            elif node.module.split(".")[:2] == ["elastic_qa", "prep"]:
                found += [f"from {node.module} import {a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [
                f"import {a.name}" for a in node.names if a.name.split(".")[:2] == ["elastic_qa", "prep"]
            ]
    return found


def test_the_training_time_input_never_imports_the_preparation() -> None:
    """elastic_qa.data opens a published cache; building one (elastic_qa.prep) is never pulled in by it."""
    wrong = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "elastic_qa" / "data").rglob("*.py"))
        if (found := prep_imports(path))
    }
    assert wrong == {}


def test_training_reaches_the_preparation_only_through_prepare() -> None:
    """The worker entry point builds the cache at start through `prepare`, the preparation's entry point;
    the loop and the evaluation read the prepared data and import nothing of the preparation."""
    allowed = {"train.py": ["from elastic_qa.prep import prepare"], "trainer.py": [], "evaluation.py": []}
    found = {name: prep_imports(REPO / "elastic_qa" / name) for name in allowed}
    assert found == allowed


def test_the_training_loop_reads_in_one_sitting() -> None:
    """trainer.py is the loop and nothing else (its parts live in loop/, session/, observe/): at most 300
    lines, so that the whole of it is read at once."""
    lines = len((REPO / "elastic_qa" / "trainer.py").read_text().splitlines())
    assert lines <= 300, f"trainer.py has {lines} lines: move a part out (loop/, session/)"


def test_torchft_is_imported_by_one_module_of_the_product() -> None:
    """A young dependency behind one module (replica/ft.py), pinned there; the benchmark's torchft side runs
    torchft's own recipe, the comparison it measures against, and imports it for that alone."""
    allowed = {
        "elastic_qa/replica/ft.py",
        "elastic_qa/bench/torchft_side.py",
        "elastic_qa/bench/goodput.py",  # whether the torchft side can run (the reason it is skipped)
    }
    found = set()
    for path in (REPO / "elastic_qa").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name.split(".")[0] == "torchft" for name in names):
                found.add(str(path.relative_to(REPO)))
    assert found <= allowed, sorted(found - allowed)
    assert "elastic_qa/replica/ft.py" in found
