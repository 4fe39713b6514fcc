"""The HTTP engine: requests to an OpenAI-compatible endpoint, from a pool of Ray actors."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from typing import Any, Callable

import pyarrow as pa

from airflow_provider_rayllm.contract.names import HTTP_API_KEY_ENV, HTTP_USERINFO_ENV
from airflow_provider_rayllm.contract.secrets import redact
from airflow_provider_rayllm.contract.spec import HttpProcessorSpec, JobSpec
from airflow_provider_rayllm.job.budget import Prices
from airflow_provider_rayllm.job.engines.base import Engine
from airflow_provider_rayllm.job.engines.http_client import EndpointClient
from airflow_provider_rayllm.job.engines.loop_thread import LoopDeadline, LoopThread
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.failpoints import failpoint
from airflow_provider_rayllm.job.progress import AnswerCounter, column_sum
from airflow_provider_rayllm.job.shaping import Shaper
from airflow_provider_rayllm.job.stream import ACTOR_RETRIES, ERROR, KEPT_INPUT, LIGHT, PRE_ERROR, REQUEST, count

API_KEY_ENV = HTTP_API_KEY_ENV


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
    if "messages" not in request:
        raise ValueError(f"the {endpoint} endpoint needs messages; this request has {sorted(request)}")
    return {"model": model, "messages": request["messages"], **params}


def extract(body: dict[str, Any], endpoint: str) -> Any:
    """The answer in an OpenAI-style response body: text, or the embedding."""
    if endpoint == "embeddings":
        return body["data"][0]["embedding"]
    choice = body["choices"][0]
    return choice["message"]["content"] if endpoint == "chat/completions" else choice["text"]


class HttpCaller:
    """A Ray Data actor: one event loop on a thread of its own, one aiohttp session, many requests in flight.

    Ray Data runs several calls of one actor at once (``batches_in_flight``); each hands its batch's
    requests to the one loop and waits for its own answers, so requests flow across batch boundaries: a
    slow row holds only its own batch back, and the next batch's requests fill the free slots meanwhile.
    Each answered row carries the endpoint's whole JSON body (as text), its status and the attempts it
    took; a row that could not be prompted is passed on with its reason, unsent.
    """

    def __init__(self, http_json: str, tap: AnswerCounter | None = None):
        failpoint("caller_start", "an HTTP caller actor")
        # Each answered batch counted here as it is given (no stage after the callers for it: one task process
        # fewer per job, and one hop fewer for every block).
        self.tap = tap
        self.http = HttpProcessorSpec.model_validate_json(http_json)
        self.client = EndpointClient(
            url=self.http.url,
            api_key=os.environ.get(API_KEY_ENV),
            userinfo=os.environ.get(HTTP_USERINFO_ENV),
            max_in_flight=self.http.max_in_flight,
            qps=self.http.qps_per_actor(),
            max_retries=self.http.max_retries,
            max_total_wait_s=self.http.max_total_wait_s,
            timeout_s=self.http.timeout_s,
            backoff_base_s=self.http.backoff_base_s,
            backoff_max_s=self.http.backoff_max_s,
        )
        self.loop = LoopThread("rayllm-http-caller")
        self.loop.run(self.client.__aenter__(), timeout_s=SESSION_START_S)
        self.batch_deadline_s = batch_deadline_s(self.http)

    def close(self) -> None:
        if self.loop.loop.is_closed():
            return
        if self.loop.thread.is_alive():  # at interpreter exit the loop's thread may already be gone
            try:
                self.loop.run(self.client.__aexit__(None, None, None), timeout_s=CLOSE_S)
            except Exception:
                pass
        self.loop.close(timeout_s=CLOSE_S)

    def __del__(self) -> None:
        self.close()

    async def _row(self, body_json: str, error: str) -> tuple[str, int, int, str, int, int]:
        """(response body as JSON text, status, attempts, error, completion tokens, prompt tokens). The request
        comes as the endpoint's body already (``HttpEngine.wire_body``): it is sent as it is."""
        if error:
            return "", 0, 0, error, 0, 0
        result = await self.client.call(body_json.encode())
        if not result.ok:
            message = f"HTTP {result.status}: {result.error}" if result.status else result.error
            return "", result.status or 0, result.attempts, message, 0, 0
        body = result.body or {}
        return (
            result.text,
            result.status,
            result.attempts,
            "",
            count((body.get("usage") or {}).get("completion_tokens")),
            count((body.get("usage") or {}).get("prompt_tokens")),
        )

    async def _batch(self, requests: list[Any], errors: list[Any]) -> list[tuple[str, int, int, str, int, int]]:
        return await asyncio.gather(*(self._row(r or "", e or "") for r, e in zip(requests, errors)))

    def __call__(self, batch: pa.Table) -> pa.Table:
        """One Arrow batch in, one out: the kept input columns pass through as they came (no Python value per
        row for them), and only the requests become Python strings, as the endpoint needs them."""
        try:
            answers = self.loop.run(
                self._batch(batch.column(REQUEST).to_pylist(), batch.column(PRE_ERROR).to_pylist()),
                self.batch_deadline_s,
            )
        except LoopDeadline:
            raise JobError(
                f"HTTP caller: a batch of {batch.num_rows} rows got no answer within "
                f"{self.batch_deadline_s:.1f} s, the most its rows' own limits allow "
                f"(max_total_wait_s={self.http.max_total_wait_s!r}, timeout_s={self.http.timeout_s!r})"
            ) from None
        texts, statuses, attempts, errors, tokens_out, tokens_in = list(zip(*answers)) or [()] * 6
        if self.tap is not None:
            self.tap.count(len(answers), sum(1 for e in errors if e), sum(tokens_out), sum(tokens_in))
        return pa.table(
            {
                KEPT_INPUT: batch.column(KEPT_INPUT),
                RESPONSE: pa.array(texts, pa.string()),
                "http_status": pa.array(statuses, pa.int64()),
                "attempts": pa.array(attempts, pa.int64()),
                ERROR: pa.array(errors, pa.string()),
                TOKENS_OUT: pa.array(tokens_out, pa.int64()),
                TOKENS_IN: pa.array(tokens_in, pa.int64()),
            }
        )


# Opening (or closing) an aiohttp session does no I/O; a loop that cannot do it this fast is stuck.
SESSION_START_S = 30.0
# Closing is best effort (the actor is going away): never hold its exit longer than this.
CLOSE_S = 5.0


def batches_in_flight(http: HttpProcessorSpec) -> int:
    """Batches one actor works on at once: enough queued rows that the in-flight slots never wait for the
    next batch to arrive (twice ``max_in_flight``), at least 2, at most 16."""
    return max(2, min(16, -(-2 * http.max_in_flight // http.batch_size)))


def batch_deadline_s(http: HttpProcessorSpec) -> float:
    """The longest a batch can take when every row ahead of it uses all of its own limits.

    A row is given up after ``max_total_wait_s`` (retries and backoff included) plus the attempt running
    then; the actor's rows go through ``max_in_flight`` slots, and a qps cap spaces their starts.
    """
    row_s = http.max_total_wait_s + http.backoff_max_s + http.timeout_s
    rows = batches_in_flight(http) * http.batch_size
    waves = -(-rows // http.max_in_flight)
    spacing_s = rows / qps if (qps := http.qps_per_actor()) else 0.0
    return waves * row_s + spacing_s + 60.0


RESPONSE = "__rayllm_http_response"
TOKENS_OUT = "__rayllm_tokens_out"
TOKENS_IN = "__rayllm_tokens_in"


class HttpShaper(Shaper):
    """The endpoint's answer (text, or the embedding) and its usage; the guide's postprocess sees the body
    as ``http_response``."""

    def __init__(self, spec: JobSpec, package_dir: str):
        super().__init__(spec, package_dir)
        assert spec.http is not None
        self.endpoint = spec.http.endpoint
        # The last answer's text and its parsed body: ``view`` follows ``answer`` for the same row and reads it
        # again only if the text is another one.
        self._parsed: tuple[Any, dict[str, Any]] | None = None

    def _body(self, text: Any) -> dict[str, Any]:
        if self._parsed is None or self._parsed[0] is not text:
            self._parsed = (text, json.loads(text))
        return self._parsed[1]

    def answer(self, row: dict[str, Any]) -> tuple[Any, int, int, dict[str, Any]]:
        body = self._body(row[RESPONSE])
        usage = body.get("usage") or {}
        value = extract(body, self.endpoint)
        extra: dict[str, Any] = {"attempts": count(row.get("attempts"))}
        choices = body.get("choices") or []
        if len(choices) > 1:  # n > 1: every sample is kept, the first also as the output column
            extra["samples"] = [c["message"]["content"] if "message" in c else c.get("text") for c in choices]
        if choices and choices[0].get("logprobs") is not None:
            extra["logprobs"] = choices[0]["logprobs"]
        return value, count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")), extra

    def view(self, row: dict[str, Any], kept: dict[str, Any], value: Any) -> dict[str, Any]:
        return {
            **kept,
            "http_response": self._body(row[RESPONSE]),
            "http_status": count(row.get("http_status")),
            self.output_column: value,
        }


class HttpEngine(Engine):
    """Requests to an OpenAI-compatible endpoint from a pool of Ray actors."""

    def __init__(self, spec: JobSpec, package_dir: str):
        super().__init__(spec, package_dir)
        assert spec.http is not None
        self.http = spec.http

    def wire_body(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return functools.partial(openai_body, endpoint=self.http.endpoint, model=self.http.model)

    def check(self) -> None:
        if self.http.qps and self.http.qps < self.http.concurrency * 0.01:
            raise JobError(f"qps={self.http.qps} is too low for {self.http.concurrency} actor(s)")

    def describe(self) -> str:
        h = self.http
        return f"endpoint {redact(h.url)}, model {h.model}; {h.concurrency} actor(s) x {h.max_in_flight} in flight; qps cap {h.qps}"

    def block_rows(self) -> int:
        return self.http.batch_size

    def actor_name(self) -> str:
        return "HttpCaller"

    def reserved_cpus(self) -> float:
        return self.http.concurrency * LIGHT["num_cpus"]

    def replicas(self) -> int:
        return self.http.concurrency

    def apply(self, ds: Any) -> Any:
        return call_endpoint(ds, self.http)

    def answer(self, ds: Any, tap: AnswerCounter) -> Any:
        """The callers count each batch as they answer it (``HttpCaller.tap``): no tap stage after them."""
        return call_endpoint(ds, self.http, tap)

    def shaper(self) -> Shaper:
        return HttpShaper(self.spec, self.package_dir)

    def tokens_out(self) -> Callable[[Any], int]:
        return column_sum(TOKENS_OUT)

    def tokens_in(self) -> Callable[[Any], int]:
        return column_sum(TOKENS_IN)

    def prices(self) -> Prices:
        return Prices(self.http.price_per_1k_input_tokens or 0.0, self.http.price_per_1k_output_tokens or 0.0)

    def details(self, totals: dict[str, Any]) -> dict[str, Any]:
        return {
            "endpoint": redact(self.http.url),
            "estimated_cost": cost(self.http, totals["input_tokens"], totals["output_tokens"]),
        }

    def versions(self) -> dict[str, str]:
        import aiohttp

        return {"aiohttp": aiohttp.__version__}


def call_endpoint(ds: Any, http: HttpProcessorSpec, tap: AnswerCounter | None = None) -> Any:
    """The dataset's requests answered by a pool of HttpCaller actors (rows keep their order per batch), each
    answered batch counted by ``tap`` in the actor that answered it."""
    import ray.data

    in_flight = batches_in_flight(http)
    return ds.map_batches(
        HttpCaller,
        fn_constructor_kwargs={"http_json": http.model_dump_json(), "tap": tap},
        batch_size=http.batch_size,
        # Several calls per actor at once, on Ray's threads, each waiting on the actor's one loop; without
        # enable_true_multi_threading Ray Data would run them one after another. As many batches again wait
        # on the actor, so a call that ends starts the next at once, not when the executor next looks.
        compute=ray.data.ActorPoolStrategy(
            size=http.concurrency,
            max_tasks_in_flight_per_actor=2 * in_flight,
            max_concurrent_calls_per_actor=in_flight,
            enable_true_multi_threading=True,
        ),
        num_cpus=LIGHT["num_cpus"],
        batch_format="pyarrow",
        **ACTOR_RETRIES,
    )


def cost(http: HttpProcessorSpec, input_tokens: int, output_tokens: int) -> float | None:
    if http.price_per_1k_input_tokens is None and http.price_per_1k_output_tokens is None:
        return None
    return round(
        input_tokens / 1000 * (http.price_per_1k_input_tokens or 0)
        + output_tokens / 1000 * (http.price_per_1k_output_tokens or 0),
        6,
    )
