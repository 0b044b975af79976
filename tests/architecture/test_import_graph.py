"""The package's import graph: stages import only earlier stages, and no module imports itself in a circle.

The stages, in the order the pipeline runs them (docs/architecture.md draws the same list):
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "include" / "dflash_regen"
FOUNDATION = ("errors", "atomic", "layout", "schemas", "tables", "payloads")
# A stage imports its own package and the stages before it (or beside it), never one after it.
STAGES = [FOUNDATION, ("settings",), ("sglang",), ("chat",), ("prompts",), ("fleet",), ("capacity",), ("generate",),
          ("training",), ("quality",), ("publish",), ("demo", "ui"), ("notify",), ("notifiers",), ("tasks",)]
STANDALONE = ("emulator",)  # SGLang's stand-in: a separate process that imports nothing of ours


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(("dflash_regen", *parts))
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of ours that `name` imports, at the top, inside functions or for type checking only."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dflash_regen")}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import (the package imports by absolute name)"
            base = node.module or ""
            if not base.startswith("dflash_regen"):
                continue
            for alias in node.names:  # `from pkg import module`: the module; `from module import name`: the module
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in out if m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _stage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _rank(stage: str) -> int:
    return next(i for i, group in enumerate(STAGES) if stage in group)


def test_every_module_belongs_to_a_stage():
    stages = {_stage(m) for m in MODULES} - {""}
    assert stages - set(STANDALONE) <= {s for group in STAGES for s in group}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_no_import_against_the_stage_order(module):
    """`__main__` modules are command lines: they sit above every stage (they may launch the demo fleet)."""
    stage = _stage(module)
    if stage in STANDALONE:
        assert not {m for m in GRAPH[module] if _stage(m) not in STANDALONE}, "the emulator imports nothing of ours"
        return
    late = sorted(m for m in GRAPH[module] if _rank(_stage(m)) > _rank(stage))
    assert not late, f"{module} (stage {stage!r}) imports later stages: {late}"


def test_no_import_circle():
    """A module is imported with its package's `__init__`, so that edge counts too."""
    edges = {m: set(targets) for m, targets in GRAPH.items()}
    for m in MODULES:
        parent = m.rpartition(".")[0]
        if parent in MODULES and parent != "dflash_regen":
            edges[m].add(parent)
    for m in list(edges):
        edges[m] = {t for t in edges[m] if t != m and not m.startswith(t + ".")}  # a package's own modules need it
    seen, on_path, circles = set(), [], []

    def visit(m):
        if m in on_path:
            circles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for t in sorted(edges.get(m, ())):
            visit(t)
        on_path.pop()

    for m in sorted(edges):
        visit(m)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# Private names another module still takes, left to the parts of issue 36 that own those files.
PRIVATE_IMPORTS_LEFT = {("dflash_regen.emulator.faults", "dflash_regen.emulator.versions._key"),
                        ("dflash_regen.prompts.planning", "dflash_regen.chat.template._with_parsed_arguments")}


def test_no_module_imports_another_modules_private_names():
    """A name one module shares with others is public (ui/files.py's readers, ui/progress.py's model): a leading
    underscore says nothing outside the module depends on it."""
    taken = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_regen"):
                taken |= {(name, f"{node.module}.{a.name}") for a in node.names if a.name.startswith("_")}
    new = sorted(taken - PRIVATE_IMPORTS_LEFT)
    assert not new, f"private names taken from another module (give them a public name): {new}"


REPO = PACKAGE.parents[1]
TRANSPORT = "dflash_regen.sglang.http"


def _imports_in(path: Path) -> set[str]:
    """Every module `path` imports (of ours or not), by absolute name, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


def test_sglang_api_is_the_only_door_to_a_server():
    """`sglang/api.Api` is the one door: its transport (sglang/http.py) and the HTTP client library it uses are
    imported by no other module of the package, DAG, plugin or script; only the transport's own unit tests
    (tests/unit/sglang) reach past the door. Tests and benchmarks may talk HTTP to a server themselves; the one other
    module with an HTTP client is Airflow's door, ui/airflow_api.py."""
    own = PACKAGE / "sglang"
    files = [p for top in ("include", "dags", "plugins", "scripts", "bench", "tests")
             for p in (REPO / top).rglob("*.py")]
    assert len(files) > 100
    breaches = []
    for path in files:
        imported = _imports_in(path)
        transport = any(m == TRANSPORT or m.startswith(TRANSPORT + ".") for m in imported)
        if transport and path != own / "api.py" and (REPO / "tests" / "unit" / "sglang") not in path.parents:
            breaches.append(f"{path.relative_to(REPO)} imports {TRANSPORT}")
        client = {m.partition(".")[0] for m in imported} & {"httpx", "requests"}
        in_package = PACKAGE in path.parents and (PACKAGE / "emulator") not in path.parents
        if client and in_package and path.parent != own and path != AIRFLOW_DOOR:
            breaches.append(f"{path.relative_to(REPO)} imports {sorted(client)}: ask sglang.api.Api instead")
    assert not breaches, "past sglang.api:\n" + "\n".join(breaches)


AIRFLOW_DOOR = PACKAGE / "ui" / "airflow_api.py"


def test_ui_airflow_api_is_the_only_door_to_airflows_rest_api():
    """The package asks Airflow's REST API in one module; the plugin only gives it a client."""
    callers = [p.relative_to(REPO) for top in ("include", "plugins") for p in (REPO / top).rglob("*.py")
               if "/api/v2" in p.read_text() and p != AIRFLOW_DOOR]
    assert callers == [], callers
