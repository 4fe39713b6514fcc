"""The run's spending as answers arrive, and the budgets that stop it (``max_tokens_budget``, ``max_cost``).

``progress.AnswerCounter`` (a stage right after the engine, or the HTTP callers themselves as they answer)
adds each answered batch's tokens to the job's counts and asks ``Budget.check`` about the totals: a run that passed a budget stops there, with a
``JobRefused`` (a retry would spend again), and since nothing is published before the stream ends, the
prefix keeps what it had. What is spent before the stop is what was in flight: one batch per caller or
engine replica at most.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_provider_rayllm.job.errors import JobRefused


@dataclass(frozen=True)
class Prices:
    """How an engine's spending grows: per 1000 tokens (an endpoint), or per second of engine time (all the
    engine's replicas together, counted from ``since``: when the plan asked for the engines)."""

    per_1k_input: float = 0.0
    per_1k_output: float = 0.0
    per_second: float = 0.0
    since: float | None = None

    def cost(self, tokens_in: int, tokens_out: int, now: float) -> float:
        engine_s = max(0.0, now - self.since) if self.since is not None else 0.0
        return (
            tokens_in / 1000 * self.per_1k_input + tokens_out / 1000 * self.per_1k_output + engine_s * self.per_second
        )


class BudgetExceeded(JobRefused):
    """The run passed ``max_tokens_budget`` or ``max_cost``; it stopped, and nothing was published."""


@dataclass(frozen=True)
class Budget:
    max_tokens: int | None
    max_cost: float | None
    prices: Prices

    @property
    def active(self) -> bool:
        return self.max_tokens is not None or self.max_cost is not None

    def check(self, tokens_in: int, tokens_out: int, now: float) -> None:
        tokens = tokens_in + tokens_out
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise BudgetExceeded(
                f"budget: {tokens} tokens ({tokens_in} in, {tokens_out} out) passed max_tokens_budget={self.max_tokens}; "
                "the run stopped and nothing was published"
            )
        if self.max_cost is not None:
            cost = self.prices.cost(tokens_in, tokens_out, now)
            if cost > self.max_cost:
                raise BudgetExceeded(
                    f"budget: estimated cost {cost:.6f} ({tokens_in} tokens in, {tokens_out} out) passed "
                    f"max_cost={self.max_cost}; the run stopped and nothing was published"
                )
