"""TaskFlow decorators: ``@task.vllm_batch`` and ``@task.http_llm_batch`` (registered in the provider info).

The decorated function returns the task's input: a path, bucket URI or glob (or a list of them), a SQL
SELECT (run on ``sql_conn_id``), or a small list of rows (dicts or plain values, as Ray's ``from_items``
takes them). Every other operator argument goes to the decorator, so a DAG reads like Airflow 3 code and
``.expand()`` maps the function over shards, one job and one output prefix per map index.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Collection, Mapping, Sequence

from airflow.sdk.bases.decorator import DecoratedOperator, task_decorator_factory
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION

from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.bases.decorator import TaskDecorator

_SQL = re.compile(r"^\s*(select|with)\b", re.IGNORECASE)


def input_arguments(value: Any) -> dict[str, Any]:
    """The decorated function's return value as the operator's input argument."""
    if isinstance(value, str):
        if not value.strip():
            raise TypeError("the TaskFlow function returned an empty string; return a URI, a SELECT or a list of rows")
        return {"sql": value} if _SQL.match(value) else {"input_uri": value}
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, str) for v in value) and all("/" in v or "://" in v for v in value):
            return {"input_uri": list(value)}
        return {"input_rows": list(value)}
    raise TypeError(
        f"the TaskFlow function returned {type(value).__name__}; return a URI (or a list of them), a SELECT "
        "statement, or a non-empty list of rows"
    )


def _decorated(operator: type) -> type:
    class _Decorated(DecoratedOperator, operator):  # type: ignore[misc, valid-type]
        template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *operator.template_fields)
        template_fields_renderers: ClassVar[dict[str, str]] = {
            **DecoratedOperator.template_fields_renderers,
            **operator.template_fields_renderers,
        }
        custom_operator_name = f"@task.{'vllm_batch' if operator is VLLMBatchOperator else 'http_llm_batch'}"

        def __init__(
            self,
            *,
            python_callable: Callable,
            op_args: Collection[Any] | None = None,
            op_kwargs: Mapping[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            kwargs.setdefault("input_uri", SET_DURING_EXECUTION)
            super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs, **kwargs)

        def execute(self, context: Context) -> Any:
            from airflow.sdk.bases.decorator import determine_kwargs
            from airflow.sdk.definitions.context import context_merge

            context_merge(context, self.op_kwargs)
            value = self.python_callable(*self.op_args, **determine_kwargs(self.python_callable, self.op_args, context))
            self.input_uri = self.sql = self.input_rows = None
            for name, given in input_arguments(value).items():
                setattr(self, name, given)
            return operator.execute(self, context)

    _Decorated.__name__ = _Decorated.__qualname__ = f"_{operator.__name__}Decorated"
    return _Decorated


_VLLM = _decorated(VLLMBatchOperator)
_HTTP = _decorated(HttpLLMBatchOperator)


def vllm_batch_task(python_callable: Callable | None = None, **kwargs: Any) -> TaskDecorator:
    """``@task.vllm_batch(model_source=..., prompt_column=..., ...)``: VLLMBatchOperator over what the function returns."""
    return task_decorator_factory(python_callable=python_callable, decorated_operator_class=_VLLM, **kwargs)


def http_llm_batch_task(python_callable: Callable | None = None, **kwargs: Any) -> TaskDecorator:
    """``@task.http_llm_batch(model=..., http_conn_id=..., ...)``: HttpLLMBatchOperator over what the function returns."""
    return task_decorator_factory(python_callable=python_callable, decorated_operator_class=_HTTP, **kwargs)
