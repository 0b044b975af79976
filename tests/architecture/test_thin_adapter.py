"""The adapter stays thin and the README stays a front door (docs/architecture.md): each Airflow task body, in the
DAG file and in tasks.py, takes its values, calls its stage's library function and returns its value."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_BODY_LINES = 10
MAX_README_LINES = 150


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _length(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its body's lines, its docstring left out; a function defined inside counts one line (it is measured on its
    own)."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if not body:
        return 0
    lines = set(range(body[0].lineno, body[-1].end_lineno + 1))
    for inner in (n for n in ast.walk(fn) if n is not fn and isinstance(n, FUNCTIONS)):
        start = min([inner.lineno, *(d.lineno for d in inner.decorator_list)])
        lines -= set(range(start + 1, inner.end_lineno + 1))
    return len(lines)


def _bodies(source: str) -> dict[str, int]:
    """Every function's body length in lines: top-level, private, nested and methods (callbacks, decorators'
    wrappers, the DAG's wiring), named by where they sit (`outer.inner`, `Class.method`)."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, FUNCTIONS):
                out[name] = _length(child)
            visit(child, f"{name}." if isinstance(child, (*FUNCTIONS, ast.ClassDef)) else prefix)

    visit(ast.parse(source), "")
    return out


def _long(bodies: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in bodies.items() if n > MAX_BODY_LINES}


def test_every_function_of_the_adapter_is_a_few_lines():
    tasks = _bodies((ROOT / "include" / "dflash_regen" / "tasks.py").read_text())
    dag = _bodies((ROOT / "dags" / "dflash_regen.py").read_text())
    # Private, nested and methods are measured too.
    assert {"generate", "fail_fast.wrapper", "leave_out_node.wrapper", "GenerateRetries.evaluate"} <= tasks.keys()
    assert {"dflash_regen", "per_shard.shard_tasks", "fleet_setups", "gpu_node", "publish"} <= dag.keys()
    bodies = {f"tasks.py {name}": n for name, n in tasks.items()} | {f"DAG {name}": n for name, n in dag.items()}
    assert not _long(bodies), f"bodies over {MAX_BODY_LINES} lines (move the logic to its stage's package): " \
                              f"{_long(bodies)}"


def test_a_long_body_is_found_wherever_it_sits():
    eleven = "\n".join(f"        x{i} = {i}" for i in range(11))
    source = f"class Notifier:\n    def notify(self):\n{eleven}\n\ndef outer():\n    def _inner():\n{eleven}\n"
    assert _long(_bodies(source)) == {"Notifier.notify": 11, "outer._inner": 11}


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the details belong in docs/"
