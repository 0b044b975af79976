"""Helpers for tests that run the whole DAG with dag.test()."""

from pathlib import Path


def states(dag_run) -> dict[str, str]:
    """Task id -> state; a mapped task's state is the set of its instances' states."""
    got: dict[str, set] = {}
    for ti in dag_run.get_task_instances():
        got.setdefault(ti.task_id, set()).add(ti.state)
    return {task: ",".join(sorted(s)) for task, s in got.items()}


def layout_of(conf, dag_run):
    """The RunLayout of a dag.test() run."""
    from dflash_regen.config import safe_run_id
    from dflash_regen.layout import RunLayout

    return RunLayout.of(Path(conf["output_root"]), safe_run_id(dag_run.run_id))


def run_dir_of(conf, dag_run) -> Path:
    return layout_of(conf, dag_run).run_dir


