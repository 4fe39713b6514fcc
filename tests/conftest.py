"""Shared test set-up.

Airflow reads its configuration when first imported, so the test Airflow home (SQLite, our DAG
bundles, no examples) is put in the environment here, before any test module imports Airflow.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "tests" / "artifacts"
_HOME = Path(os.environ.get("RAYLLM_TEST_HOME") or tempfile.mkdtemp(prefix="rayllm-tests-"))

if os.environ.get("PYTEST_XDIST_WORKER") or "AIRFLOW_HOME" not in os.environ:
    # Each pytest-xdist worker has a home of its own (it would otherwise inherit the controller's).
    os.environ["AIRFLOW_HOME"] = str(_HOME / "airflow")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_HOME / 'airflow' / 'airflow.db'}"
os.environ["AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST"] = json.dumps(
    [
        {
            "name": "examples",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(REPO / "dags_examples")},
        },
        {
            "name": "tests",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(REPO / "tests" / "dags")},
        },
    ]
)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags_examples")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Tests talk to loopback endpoints only: cloud clients must never fall back to a metadata server.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "True")
Path(os.environ["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)


# `make test` runs two pytest-xdist workers on this machine's two cores: a vLLM job keeps them about 60 % busy
# (its processes import torch and vLLM one after another, and wait on each other), so a second test beside it
# fills the rest. Each worker starts its own Ray head, services and Airflow database (the session fixtures).
# A test module runs whole on one worker, so its module fixtures start once; the modules that use a session
# fixture that runs a job share one worker, so that job runs once.
SHARED_SESSION_JOBS = ("quickstart_run",)
SHARED_GROUP = "shared-session-jobs"


@functools.cache
def _sharing_modules() -> frozenset[str]:
    """Test files (paths from the repository root, as in node ids) that name a shared session job. Read from
    the source, because pytest-xdist's controller schedules by node id and never sees a test's fixtures."""
    names = re.compile(r"\b(" + "|".join(SHARED_SESSION_JOBS) + r")\b")
    return frozenset(
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if names.search(path.read_text(encoding="utf-8"))
    )


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, with a test file as the scope and the files that share a session
    job as one. (Its `--dist loadgroup` marks groups in node ids, which pytest 9.2's node ids no longer take.)"""
    from xdist.scheduler import LoadScopeScheduling

    sharing = _sharing_modules()

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_GROUP if path in sharing else path

    return ModuleScheduling(config, log)


# The longest of the other integration modules, longest first (their summed test times in a CI run's JUnit file:
# reliability about 800 s, multi_node and serve_deployment about 380 s each, backfill 250 s; the others 200 s or
# less). Taken first, they leave the short modules to even out the two workers' ends: in alphabetical order,
# serve_deployment came last and ran alone for four minutes.
LONG_MODULES = ("test_reliability.py", "test_multi_node.py", "test_serve_deployment.py", "test_backfill.py")
# The same for the unit modules, which come after every integration module: the ones that start a Ray cluster or
# a fresh interpreter importing vLLM (sql_reads about 67 s, progress 60, compat 30, operator_logic 25) first, so
# that both workers end on quick modules instead of one of them running these alone in the last minute.
LONG_UNIT_MODULES = ("test_sql_reads.py", "test_progress.py", "test_compat.py", "test_operator_logic.py")


def _scope_order(path: str) -> tuple:
    name = path.rsplit("/", 1)[-1]
    longest_first = LONG_MODULES if "integration" in path else LONG_UNIT_MODULES
    long_rank = longest_first.index(name) if name in longest_first else len(longest_first)
    return (path not in _sharing_modules(), "integration" not in path, long_rank)


def pytest_collection_modifyitems(config, items):
    # Workers take scopes in collection order (`--no-loadscope-reorder`): the shared group first, being the
    # longest, then the other integration modules, longest first, then the unit modules, longest first, whose
    # quick ones even out the workers' ends. (The sort is stable: a module's tests keep their order.)
    items.sort(key=lambda item: _scope_order(item.location[0]))


@pytest.fixture(scope="session")
def test_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated SQLite metadata database for dag.test()."""
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=dict(os.environ))
    return os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from airflow_provider_rayllm.local.models import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def ray_cluster(test_home):
    """One real local Ray head (token auth, free ports) for the whole session."""
    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from tests.gpu.jobs import gpu_count

    # On a GPU machine the cluster offers its GPUs (the gpu-marked tests' engines need them); elsewhere none.
    cluster = LocalRayCluster(state_dir=test_home / "ray", num_cpus=2, num_gpus=gpu_count())
    info = cluster.start()
    yield info
    cluster.stop()


@pytest.fixture(scope="session")
def ray_conn(ray_cluster, test_home):
    """`ray_default` points at the local cluster; outputs default under the test home."""
    output_base = test_home / "outputs"
    os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = ray_cluster.airflow_conn_uri(output_base=str(output_base))
    return {"info": ray_cluster, "output_base": output_base}


@pytest.fixture(scope="session")
def quickstart_run(ray_conn, airflow_db, smollm2) -> dict:
    """dags_examples/example_vllm_batch.py as shipped, once per session (one engine start): the guide's
    quickstart test checks it, and the bucket-model tests compare their answers with it (hence the
    reproducible engine settings)."""
    from tests.integration.helpers import (
        REPRODUCIBLE_ENGINE,
        load_dag,
        read_rows,
        task_state,
        utc,
        xcom,
    )

    dag = load_dag("dags_examples", "example_vllm_batch", "example_vllm_batch")
    conf = {"model_source": str(smollm2), "max_tokens": 24, "engine_kwargs": REPRODUCIBLE_ENGINE}
    dag_run = dag.test(logical_date=utc(2026, 3, 2), run_conf=conf)
    succeeded = task_state(dag_run, "answer") == "success"  # the tests say why not: assert_succeeded(dag_run, ...)
    manifest = xcom(dag.dag_id, dag_run.run_id, "answer", "return_value") if succeeded else None
    rows = read_rows(manifest["output_files"]) if manifest else []
    return {"dag_run": dag_run, "manifest": manifest, "rows": rows}


@pytest.fixture(scope="session")
def service_logs(test_home) -> Path:
    path = test_home / "service-logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def s3_endpoint(service_logs):
    from tests.integration.services import s3_server

    with s3_server(service_logs) as url:
        yield url


@pytest.fixture(scope="session")
def gcs_endpoint(service_logs):
    from tests.integration.services import gcs_server

    with gcs_server(service_logs) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """The PostgreSQL server on the machine. Missing: a skip for a user, a failure in CI."""
    dsn = os.environ.get("RAYLLM_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    try:
        import psycopg2

        psycopg2.connect(dsn, connect_timeout=5).close()
    except Exception as exc:
        message = f"no PostgreSQL at {dsn}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI requires it)")
        pytest.skip(message)
    return dsn


@pytest.fixture(scope="session")
def mysql_uri() -> str:
    """The MariaDB/MySQL server on the machine. Missing: a skip for a user, a failure in CI."""
    uri = os.environ.get("RAYLLM_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")
    try:
        import urllib.parse

        import pymysql

        parts = urllib.parse.urlsplit(uri)
        pymysql.connect(
            host=parts.hostname,
            port=parts.port or 3306,
            user=parts.username or "",
            password=parts.password or "",
            database=parts.path.lstrip("/"),
            connect_timeout=5,
        ).close()
    except Exception as exc:
        message = f"no MySQL/MariaDB at {uri}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI requires it)")
        pytest.skip(message)
    return uri


# Native libraries this process loads (Ray's core worker for the in-process Ray tests, grpc, torch) can crash
# while the interpreter tears itself down after the last test (CI saw "Segmentation fault" printed after a
# complete summary, turning the run's exit status into 139). Once pytest has reported, the outcome is
# decided: leave with pytest's own exit status and skip that teardown.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if not _EXIT_STATUS:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
