"""`make ui`'s choices before it becomes the API server: which run it points at, which port, which database."""

from __future__ import annotations

import json
import os
import socket
import time

from airflow_provider_rayllm.contract.names import MANIFEST_NAME
from airflow_provider_rayllm.local import ui


def _manifest(work, run_id: str, at: float) -> None:
    path = work / "output" / ui.DEMO_DAG / run_id / ui.DEMO_TASK / MANIFEST_NAME
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"run": {"run_id": run_id}, "report_uri": str(path.with_name("_report.html"))}))
    os.utime(path, (at, at))


def test_the_newest_demo_run_is_the_one_shown(tmp_path):
    assert ui.latest_demo_manifest(tmp_path) is None
    now = time.time()
    _manifest(tmp_path, "manual__new", now)
    _manifest(tmp_path, "manual__old", now - 3600)
    assert ui.latest_demo_manifest(tmp_path)["run"]["run_id"] == "manual__new"


def test_a_taken_port_gives_way_to_a_free_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = ui.port_or_free(port)
        assert other != port
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", other)) != 0, "the port chosen is free"


def test_without_a_demo_run_it_says_to_run_the_demo_first(tmp_path, capsys):
    assert ui.serve(home=tmp_path / "airflow", work=tmp_path) == 1
    assert "make demo" in capsys.readouterr().err


def test_the_demo_home_is_served_with_its_own_database_and_no_login(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite:////elsewhere.db")
    env = ui.ui_env(tmp_path)
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == f"sqlite:///{tmp_path / 'airflow.db'}"
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] == "True"
    assert ui.ui_env(None)["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == "sqlite:////elsewhere.db"
