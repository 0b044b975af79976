"""The GPU node's Celery queue (env DFLASH_WORKER_QUEUE, read when the DAG is parsed) routes every task of a run."""

from pathlib import Path

import pytest
from airflow.configuration import conf
from airflow.dag_processing.dagbag import DagBag

DAGS = Path(__file__).resolve().parents[2] / "dags"


def parse(monkeypatch, queue: str | None):
    if queue is None:
        monkeypatch.delenv("DFLASH_WORKER_QUEUE", raising=False)
    else:
        monkeypatch.setenv("DFLASH_WORKER_QUEUE", queue)
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag.dags["dflash_regen"]


def test_every_task_goes_to_the_node_queue_when_set(monkeypatch):
    dag = parse(monkeypatch, "gpu-node-2")
    assert {t.task_id: t.queue for t in dag.tasks} == {t.task_id: "gpu-node-2" for t in dag.tasks}


@pytest.mark.parametrize("queue", [None, ""])
def test_unset_queue_keeps_airflows_default_queue(monkeypatch, queue):
    dag = parse(monkeypatch, queue)
    assert {t.queue for t in dag.tasks} == {conf.get("operators", "default_queue")}
