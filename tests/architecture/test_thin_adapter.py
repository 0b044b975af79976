"""The adapter stays thin and the README stays a front door (docs/architecture.md): each Airflow task body, in the
DAG file and in tasks.py, takes its values, calls its stage's library function and returns its value."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_BODY_LINES = 10
MAX_README_LINES = 150


def _bodies(path: Path, decorated: str = "") -> dict[str, int]:
    """Each public top-level function's body length in lines, its docstring left out; with `decorated`, only the
    functions under that decorator (the DAG's tasks, not its wiring). A function that defines one inside is a
    decorator (Airflow's plumbing), not a task body."""
    out = {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        nested = any(isinstance(n, ast.FunctionDef) for n in ast.walk(node) if n is not node)
        marks = {ast.unparse(d).split("(")[0] for d in getattr(node, "decorator_list", [])}
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and not nested \
                and (not decorated or decorated in marks) and (decorated or node in tree.body):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body:
                out[node.name] = body[-1].end_lineno - body[0].lineno + 1
    return out


def test_every_task_body_is_a_few_lines():
    tasks = _bodies(ROOT / "include" / "dflash_regen" / "tasks.py")
    dag = _bodies(ROOT / "dags" / "dflash_regen.py", decorated="task")
    assert {"generate", "autotune_fleet", "calibrate", "publish_dataset"} <= tasks.keys()
    assert {"generate", "autotune", "publish"} <= dag.keys()
    bodies = {f"tasks.py {name}": n for name, n in tasks.items()} | {f"DAG {name}": n for name, n in dag.items()}
    long = {name: n for name, n in bodies.items() if n > MAX_BODY_LINES}
    assert not long, f"task bodies over {MAX_BODY_LINES} lines (move the logic to its stage's package): {long}"


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the details belong in docs/"
