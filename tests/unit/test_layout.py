"""The package's layout: no import circles, the job half and the contract import without Airflow, the Airflow
half imports neither the job half nor the heavy libraries, and each engine is imported only for its kind."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap
import typing

import airflow_provider_rayllm
from airflow_provider_rayllm.contract.spec import JobSpec

PACKAGE = "airflow_provider_rayllm"
ROOT = pathlib.Path(airflow_provider_rayllm.__file__).parent.parent


def modules(root: pathlib.Path = ROOT) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module of the package: its dotted name -> (its file, whether it is a package's __init__)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _owner(name: str, known: dict) -> str | None:
    """The module that defines ``name`` (a module, or an attribute of one)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file (inside functions too): ``import a.b``,
    ``from a import b`` (module ``a.b`` if there is one, else ``a``), relative imports resolved."""
    known = modules(root)
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, is_package) in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in targets:
                if target.split(".")[0] == PACKAGE:
                    owner = _owner(target, known)
                    if owner is not None and owner != name:
                        edges[name].add(owner)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of the graph (one per strongly connected part), as the path that goes round it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = set()
            while True:
                member = stack.pop()
                part.add(member)
                if member == node:
                    break
            if len(part) > 1:
                parts.append(part)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_round(edges, part) for part in parts]


def _round(edges: dict[str, set[str]], part: set[str]) -> list[str]:
    """A path from the part's first module back to it, through the part."""
    start = min(part)
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(edges[path[-1]] & part):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    raise AssertionError(f"no circle in {sorted(part)}")


def test_the_package_has_no_import_circle():
    edges = import_graph()
    assert len(edges) > 50 and f"{PACKAGE}.job.driver" in edges, "the walk found the package's modules"
    assert f"{PACKAGE}.job.publish.publisher" in edges[f"{PACKAGE}.job.driver"]
    found = circles(edges)
    assert not found, "import circle(s): " + "; ".join(" -> ".join(c) for c in found)


def test_a_circle_is_found_and_named(tmp_path):
    """The walk itself: a circle through a function's import and a relative import is seen."""
    package = tmp_path / PACKAGE
    (package / "job").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "job" / "__init__.py").write_text("")
    (package / "job" / "a.py").write_text("def f():\n    from airflow_provider_rayllm.job import b\n")
    (package / "job" / "b.py").write_text("from . import c\n")
    (package / "job" / "c.py").write_text("from .a import f\n")
    found = circles(import_graph(tmp_path))
    assert found == [[f"{PACKAGE}.job.a", f"{PACKAGE}.job.b", f"{PACKAGE}.job.c", f"{PACKAGE}.job.a"]]


def _run(script: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_job_half_and_the_contract_import_without_airflow():
    """Every module of ``job/`` and ``contract/``, with Airflow made unimportable. ``job.__main__`` is the
    job's command (importing it runs a job), so it is left out; ``job.entrypoint`` is what it runs."""
    done = _run(
        """
        import importlib, importlib.abc, pkgutil, sys

        class NoAirflow(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path=None, target=None):
                if fullname == "airflow" or fullname.startswith("airflow."):
                    raise ImportError(f"airflow is blocked: {fullname}")
                return None

        sys.meta_path.insert(0, NoAirflow())
        names = []
        for room in ("airflow_provider_rayllm.job", "airflow_provider_rayllm.contract"):
            package = importlib.import_module(room)
            names += [room] + [m.name for m in pkgutil.walk_packages(package.__path__, room + ".")]
        failed = []
        for name in names:
            if name == "airflow_provider_rayllm.job.__main__":
                continue
            try:
                importlib.import_module(name)
            except ImportError as exc:
                failed.append(f"{name}: {exc}")
        print("imported", len(names))
        print("failed", failed)
        print("airflow in sys.modules", sorted(m for m in sys.modules if m.split(".")[0] == "airflow"))
        """
    )
    assert "failed []" in done.stdout, done.stdout
    assert "airflow in sys.modules []" in done.stdout, done.stdout
    assert int(done.stdout.split("imported ")[1].split()[0]) > 40, done.stdout


def test_the_airflow_half_imports_neither_the_job_half_nor_heavy_libraries():
    done = _run(
        """
        import importlib, pkgutil, sys

        names = ["airflow_provider_rayllm.links"]
        for room in ("operators", "hooks", "triggers", "contract"):
            package = importlib.import_module(f"airflow_provider_rayllm.{room}")
            names += [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
        for name in names:
            importlib.import_module(name)
        heavy = ("ray", "vllm", "numpy", "torch", "pyarrow")
        found = sorted(
            {m.split(".")[0] for m in sys.modules if m.split(".")[0] in heavy}
            | {m for m in sys.modules if m.startswith("airflow_provider_rayllm.job")}
        )
        print("imported", len(names))
        print("found", found)
        """
    )
    assert "found []" in done.stdout, done.stdout
    assert int(done.stdout.split("imported ")[1].split()[0]) > 10, done.stdout


def test_each_kind_has_an_engine_and_an_http_job_never_imports_vllm():
    from airflow_provider_rayllm.job.engines import ENGINES

    assert set(ENGINES) == set(typing.get_args(JobSpec.model_fields["kind"].annotation))
    done = _run(
        """
        import sys
        from airflow_provider_rayllm.contract.spec import parse_spec
        from airflow_provider_rayllm.job.engines import open_engine

        spec = parse_spec({
            "source": {"uris": ["/in.jsonl"]},
            "prompt": {"prompt_column": "q"},
            "kind": "http",
            "http": {"base_url": "http://127.0.0.1:1/v1", "model": "m"},
            "sink": {"uri": "/out"},
        })
        print("engine", type(open_engine(spec, ".")).__name__)
        print("vllm", sorted(m for m in sys.modules if m.split(".")[0] == "vllm" or ".engines.vllm" in m))
        """
    )
    assert "engine HttpEngine" in done.stdout, done.stdout
    assert "vllm []" in done.stdout, done.stdout
