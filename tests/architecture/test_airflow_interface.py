"""Airflow is used only through its public interface: the Task SDK (`airflow.sdk`), providers, the plugin and
auth-manager interfaces, its configuration, and the REST API (ui/airflow_api.py). No ORM model, DB session or
private attribute: those change between releases (3.4 moved `airflow.models.taskinstancehistory`) and the
report pages would break on an upgrade. tests/contract/test_airflow_contract.py runs the pages on 3.3 and 3.4.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "include").rglob("*.py"), *(ROOT / "plugins").glob("*.py"), *(ROOT / "dags").glob("*.py")])
PUBLIC = ("airflow.sdk", "airflow.providers.", "airflow.plugins_manager", "airflow.configuration",
          "airflow.api_fastapi.app",  # get_auth_manager: the auth manager, whose interface is public
          "airflow.api_fastapi.auth.managers.",  # the auth manager interface
          "airflow.api_fastapi.core_api.security")  # get_user, requires_access_dag: a plugin app's authentication
NEVER = ("sqlalchemy",)  # no query of Airflow's metadata DB


def _public(module: str) -> bool:
    return any(module.startswith(p) if p.endswith(".") else module == p or module.startswith(p + ".")
               for p in PUBLIC)


def violations(source: str) -> list[str]:
    """What `source` uses of Airflow beyond its public interface: a module outside PUBLIC, SQLAlchemy, or a
    private attribute (`_name`) of anything imported from Airflow."""
    found, airflow_names = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom | ast.Import):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in modules:
                if module.split(".")[0] in NEVER:
                    found.append(f"line {node.lineno}: imports {module}")
                elif module.split(".")[0] == "airflow":
                    if not _public(module):
                        found.append(f"line {node.lineno}: imports {module}, not public")
                    airflow_names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in airflow_names:
                found.append(f"line {node.lineno}: {root.id}...{node.attr}, a private attribute of Airflow's")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_airflow_is_used_through_its_public_interface_only(path):
    assert not violations(path.read_text()), (path, violations(path.read_text()))


def test_the_check_finds_the_orm_the_db_and_a_private_attribute():
    """What the plugin did before: Airflow's models, a DB session, DagRun._state."""
    cut = """
from airflow.models.dagrun import DagRun
from airflow.utils.session import create_session
from sqlalchemy import select
import airflow.models.taskinstancehistory
with create_session() as session:
    session.execute(select(DagRun._state))
"""
    found = violations(cut)
    assert any("airflow.models.dagrun" in f for f in found)
    assert any("airflow.utils.session" in f for f in found)
    assert any("sqlalchemy" in f for f in found)
    assert any("airflow.models.taskinstancehistory" in f for f in found)
    assert any("_state" in f for f in found)
    assert not violations("from airflow.sdk import dag\nfrom airflow.plugins_manager import AirflowPlugin\n")
