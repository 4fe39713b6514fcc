"""Submission ids and output prefixes: deterministic per task instance, distinct across instances."""

from airflow_provider_rayllm.operators.base import default_output_uri, submission_base_id


def test_same_task_instance_same_id():
    a = submission_base_id("dag", "scheduled__2026-01-01", "answer", -1, "h1")
    assert a == submission_base_id("dag", "scheduled__2026-01-01", "answer", -1, "h1")
    assert a.startswith("rayllm-dag-answer-")


def test_any_difference_changes_the_id():
    base = ("dag", "scheduled__2026-01-01", "answer", -1, "h1")
    variants = [
        ("dag2", *base[1:]),
        (base[0], "scheduled__2026-01-02", *base[2:]),
        (*base[:2], "other", *base[3:]),
        (*base[:3], 0, base[4]),
        (*base[:4], "h2"),
    ]
    ids = {submission_base_id(*v) for v in variants}
    assert len(ids) == len(variants)
    assert submission_base_id(*base) not in ids


def test_ids_use_safe_characters_only():
    sid = submission_base_id("my dag/with:odd chars", "manual__2026-11-30T18:19:05+00:00", "t.1", 3, "h")
    assert all(c.isalnum() or c in "-_" for c in sid)


def test_default_output_prefix_per_run_task_and_map_index():
    base = "s3://bucket/llm/"
    plain = default_output_uri(base, "d", "scheduled__2026-01-01T00:00:00+00:00", "t", -1)
    mapped = default_output_uri(base, "d", "scheduled__2026-01-01T00:00:00+00:00", "t", 2)
    other_day = default_output_uri(base, "d", "scheduled__2026-01-02T00:00:00+00:00", "t", -1)
    assert plain == "s3://bucket/llm/d/scheduled__2026-01-01T00_00_00_00_00/t"
    assert mapped == plain + "/map_2"
    assert len({plain, mapped, other_day}) == 3
