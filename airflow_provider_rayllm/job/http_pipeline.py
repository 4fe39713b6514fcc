"""The HTTP pipeline: rows -> requests to an OpenAI-compatible endpoint, from a pool of Ray actors."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import numpy as np

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.http_client import EndpointClient
from airflow_provider_rayllm.job.progress import ProgressLog, infer_rows
from airflow_provider_rayllm.job.prompts import REQUEST, STASH
from airflow_provider_rayllm.spec import OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT, HttpProcessorSpec

API_KEY_ENV = "RAYLLM_HTTP_API_KEY"
CALL_ERROR = "__rayllm_call_error"


def payload_for(request: dict[str, Any], http: HttpProcessorSpec) -> dict[str, Any]:
    """Our request (messages/prompt + sampling params) as the endpoint's JSON body."""
    return openai_body(request, http.endpoint, http.model)


def openai_body(request: dict[str, Any], endpoint: str, model: str) -> dict[str, Any]:
    """Our request as an OpenAI-style body for ``endpoint`` (chat/completions, completions, embeddings)."""
    if "payload" in request:  # the guide's preprocess returns dict(payload=...)
        return {"model": model, **request["payload"]}
    params = {k: v for k, v in (request.get("sampling_params") or {}).items() if k != "structured_outputs"}
    structured = (request.get("sampling_params") or {}).get("structured_outputs")
    if structured:  # vLLM's OpenAI server reads these names
        if "json" in structured:
            params["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(structured["json"])},
            }
        if "choice" in structured:
            params["structured_outputs"] = {"choice": structured["choice"]}
        if "regex" in structured:
            params["structured_outputs"] = {"regex": structured["regex"]}
    if endpoint == "embeddings":
        return {"model": model, "input": request.get("prompt", "")}
    if endpoint == "completions":
        prompt = request.get("prompt")
        if prompt is None:
            prompt = "\n\n".join(str(m.get("content", "")) for m in request.get("messages", []))
        return {"model": model, "prompt": prompt, **params}
    return {"model": model, "messages": request["messages"], **params}


def extract(body: dict[str, Any], endpoint: str) -> Any:
    """The answer in an OpenAI-style response body: text, or the embedding."""
    if endpoint == "embeddings":
        return body["data"][0]["embedding"]
    choice = body["choices"][0]
    return choice["message"]["content"] if endpoint == "chat/completions" else choice["text"]


class HttpCaller:
    """A Ray Data actor: one aiohttp session and event loop, many requests in flight."""

    def __init__(self, http_json: str, output_column: str):
        self.http = HttpProcessorSpec.model_validate_json(http_json)
        self.output_column = output_column
        self.loop = asyncio.new_event_loop()
        self.client = EndpointClient(
            url=self.http.url,
            api_key=os.environ.get(API_KEY_ENV),
            max_in_flight=self.http.max_in_flight,
            qps=self.http.qps_per_actor(),
            max_retries=self.http.max_retries,
            max_total_wait_s=self.http.max_total_wait_s,
            timeout_s=self.http.timeout_s,
            backoff_base_s=self.http.backoff_base_s,
            backoff_max_s=self.http.backoff_max_s,
        )
        self.loop.run_until_complete(self.client.__aenter__())

    def __del__(self) -> None:
        try:
            self.loop.run_until_complete(self.client.__aexit__(None, None, None))
        except Exception:
            pass

    async def _row(self, stash: dict[str, Any], request_json: str) -> dict[str, Any]:
        payload = payload_for(json.loads(request_json), self.http)
        result = await self.client.call(payload)
        row: dict[str, Any] = {
            STASH: stash,
            "http_status": result.status,
            "attempts": result.attempts,
            OUTPUT_TOKENS_IN: 0,
            OUTPUT_TOKENS_OUT: 0,
            self.output_column: None,
            CALL_ERROR: "",
        }
        if not result.ok:
            row[CALL_ERROR] = f"HTTP {result.status}: {result.error}" if result.status else result.error
            return row
        try:
            value = extract(result.body or {}, self.http.endpoint)
        except (KeyError, IndexError, TypeError) as exc:
            row[CALL_ERROR] = f"unparsable response: missing {exc!r} in {json.dumps(result.body)[:200]}"
            return row
        usage = (result.body or {}).get("usage") or {}
        row[OUTPUT_TOKENS_IN] = int(usage.get("prompt_tokens") or 0)
        row[OUTPUT_TOKENS_OUT] = int(usage.get("completion_tokens") or 0)
        row[self.output_column] = json.dumps(value) if self.http.endpoint == "embeddings" else value
        return row

    async def _batch(self, stashes: Any, requests: Any) -> list[dict[str, Any]]:
        return await asyncio.gather(*(self._row(dict(s), str(r)) for s, r in zip(stashes, requests)))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        # Ray Data may call from another thread than the constructor's; the loop is ours either way.
        rows = self.loop.run_until_complete(self._batch(batch[STASH], batch[REQUEST]))
        return {key: [r[key] for r in rows] for key in rows[0]} if rows else {}


def check(http: HttpProcessorSpec) -> None:
    if http.qps and http.qps < http.concurrency * 0.01:
        raise JobError(f"qps={http.qps} is too low for {http.concurrency} actor(s)")


def infer(
    good: Any,
    rows: int,
    http: HttpProcessorSpec,
    output_column: str,
    light: dict[str, Any],
    progress: ProgressLog,
    checkpoint_uri: str | None = None,
) -> tuple[Any, Any]:
    """(output rows, error rows), each with its own schema; finished rows saved under checkpoint_uri if given."""

    def output(row: dict[str, Any]) -> dict[str, Any]:
        value = row[output_column]
        if http.endpoint == "embeddings":
            value = json.loads(value)
        return {
            **dict(row[STASH] or {}),
            output_column: value,
            OUTPUT_TOKENS_IN: int(row[OUTPUT_TOKENS_IN]),
            OUTPUT_TOKENS_OUT: int(row[OUTPUT_TOKENS_OUT]),
            "attempts": int(row["attempts"]),
        }

    def call(rows: Any) -> Any:
        return rows.map_batches(
            HttpCaller,
            fn_constructor_kwargs={"http_json": http.model_dump_json(), "output_column": output_column},
            batch_size=http.batch_size,
            concurrency=http.concurrency,
            num_cpus=light["num_cpus"],
            batch_format="numpy",
        )

    return infer_rows(good, rows, http.batch_size, call, progress, CALL_ERROR, OUTPUT_TOKENS_OUT, output, light, checkpoint_uri)


def cost(http: HttpProcessorSpec, input_tokens: int, output_tokens: int) -> float | None:
    if http.price_per_1k_input_tokens is None and http.price_per_1k_output_tokens is None:
        return None
    return round(
        input_tokens / 1000 * (http.price_per_1k_input_tokens or 0)
        + output_tokens / 1000 * (http.price_per_1k_output_tokens or 0),
        6,
    )


