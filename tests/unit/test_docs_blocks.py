"""Every code block in README.md and docs/ is either run by a test or marked as an excerpt, and the README's
operator block builds a job spec as written.

A block is run when the line before its fence says `<!-- run: PATH -->` and PATH (a test or script) names the
page, or when it sits in README's first-dag section (tests/integration/test_first_dag.py runs that section as
written). `<!-- excerpt: why -->` marks a block that is part of a larger file and cannot run alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```")
MARK = re.compile(r"<!-- (run|excerpt): ([^>]*?) -->")


def blocks(page: Path) -> list[tuple[int, str | None, bool]]:
    """(line number, the marker before the fence, inside the first-dag section) for each block of a page."""
    found, inside, in_first_dag = [], False, False
    lines = page.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        in_first_dag = (in_first_dag or "<!-- first-dag:start" in line) and "<!-- first-dag:end" not in line
        if not FENCE.match(line):
            continue
        if not inside:
            before = next((lines[i] for i in range(number - 2, max(number - 4, -1), -1) if lines[i].strip()), "")
            mark = MARK.search(before)
            found.append((number, mark.group(0) if mark else None, in_first_dag))
        inside = not inside
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_run_by_a_test_or_marked_an_excerpt(page):
    unmarked, broken = [], []
    for number, mark, in_first_dag in blocks(page):
        if in_first_dag:
            continue
        if mark is None:
            unmarked.append(number)
            continue
        kind, what = MARK.search(mark).groups()  # type: ignore[union-attr]
        if kind == "run":
            runner = REPO / what.split()[0]
            if not runner.is_file() or page.name not in runner.read_text(encoding="utf-8"):
                broken.append(f"line {number}: {what!r} does not exist or never names {page.name}")
    assert not unmarked, f"{page.name}: blocks at lines {unmarked} are neither run by a test nor marked excerpts"
    assert not broken, broken


def test_the_readme_operator_block_builds_a_job_spec(tmp_path, monkeypatch):
    from airflow.sdk import DAG

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## One operator in a DAG", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", '{"conn_type": "ray", "host": "http://127.0.0.1:8265"}')
    scope: dict = {}
    with DAG(dag_id="readme"):
        exec(compile(code, "README.md", "exec"), scope)
    op = scope["answer"]
    op.output_uri = str(tmp_path / "out")

    class Ti:
        dag_id, run_id, task_id, map_index, try_number = "readme", "manual__1", "answer", -1, 1

    spec = op.build_spec({"ti": Ti()}, tmp_path)
    assert spec.source.uris == ["/data/questions/*.parquet"]
    assert spec.prompt.prompt_column == "prompt" and spec.prompt.system_prompt == "Answer in one sentence."
    assert spec.processor is not None and spec.processor.model_source == "unsloth/Llama-3.1-8B-Instruct"
    assert spec.processor.engine_kwargs["max_model_len"] == 4096
