"""vLLM's answers as output rows: generated text (with its logprobs), embeddings, or a classifier's probabilities
and label."""

from __future__ import annotations

from typing import Any

from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.shaping import Shaper
from airflow_provider_rayllm.job.stream import count, to_python


def logprob_records(logprobs: Any) -> list[list[dict[str, Any]]]:
    """vLLM's per-token ``{token_id: {logprob, rank, decoded_token}}`` as records a table can hold: for each
    generated token, its candidates with their token id."""
    out = []
    for position in to_python(logprobs) or []:
        out.append(
            [{"token_id": int(token), **(info or {})} for token, info in (position or {}).items() if info is not None]
        )
    return out


class VLLMShaper(Shaper):
    """vLLM's answer: ``generated_text`` (generate) or ``embeddings`` (embed, classify, score)."""

    def __init__(self, spec: JobSpec, package_dir: str, labels: list[str] | None = None):
        super().__init__(spec, package_dir)
        self.generate = spec.task_type == "generate"
        self.labels = labels

    def answer(self, row: dict[str, Any]) -> tuple[Any, int, int, dict[str, Any]]:
        value = row.get("generated_text") if self.generate else to_python(row.get("embeddings"))
        extra = {"logprobs": logprob_records(row["logprobs"])} if self.generate and row.get("logprobs") else {}
        if self.labels and isinstance(value, list) and len(value) == len(self.labels):
            # classify: the class probabilities in output_column, and the likeliest class by its name.
            extra["label"] = self.labels[max(range(len(value)), key=value.__getitem__)]
        return value, count(row.get("num_input_tokens")), count(row.get("num_generated_tokens")), extra

    def view(self, row: dict[str, Any], kept: dict[str, Any], value: Any) -> dict[str, Any]:
        view = {k: to_python(v) for k, v in row.items() if not k.startswith("__")}
        view.update(kept)
        if not self.generate:
            view["embeddings"] = value
        return view
