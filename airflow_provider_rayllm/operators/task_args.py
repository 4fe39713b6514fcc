"""The keyword arguments every operator of this package passes up: Airflow's own (``BaseOperator``) and the
Ray job's (``RayJobOperator``), as TypedDicts for ``**kwargs``, so that a type checker and an editor see
each of them and a misspelled one is an error.

``tests/unit/test_declarations.py`` checks that these keys are exactly ``BaseOperator.__init__``'s and
``RayJobOperator.__init__``'s parameters.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from typing_extensions import Required, TypedDict


class BaseOperatorArgs(TypedDict, total=False):
    """``airflow.sdk.BaseOperator``'s keyword arguments."""

    task_id: Required[str]
    owner: str
    email: str | Sequence[str] | None
    email_on_retry: bool
    email_on_failure: bool
    retries: int | None
    retry_delay: timedelta | float
    retry_exponential_backoff: float
    max_retry_delay: timedelta | float | None
    retry_policy: Any
    start_date: datetime | None
    end_date: datetime | None
    depends_on_past: bool
    ignore_first_depends_on_past: bool
    wait_for_past_depends_before_skipping: bool
    wait_for_downstream: bool
    dag: Any
    params: MutableMapping[str, Any] | None
    default_args: dict[str, Any] | None
    priority_weight: int
    weight_rule: Any
    queue: str
    pool: str | None
    pool_slots: int
    sla: timedelta | None
    execution_timeout: timedelta | None
    on_execute_callback: Any
    on_failure_callback: Any
    on_success_callback: Any
    on_retry_callback: Any
    on_skipped_callback: Any
    pre_execute: Any
    post_execute: Any
    trigger_rule: str
    resources: dict[str, Any] | None
    run_as_user: str | None
    map_index_template: str | None
    max_active_tis_per_dag: int | None
    max_active_tis_per_dagrun: int | None
    executor: str | None
    executor_config: dict[str, Any] | None
    do_xcom_push: bool
    multiple_outputs: bool
    inlets: Any
    outlets: Any
    task_group: Any
    doc: str | None
    doc_md: str | None
    doc_json: str | None
    doc_yaml: str | None
    doc_rst: str | None
    task_display_name: str | None
    logger_name: str | None
    allow_nested_operators: bool
    render_template_as_native_obj: bool | None


class RayJobArgs(BaseOperatorArgs, total=False):
    """``RayJobOperator``'s own keyword arguments (how the task reaches the cluster and waits), described in
    ``operators/arguments.py`` ``JobSettings``."""

    ray_conn_id: str
    deferrable: bool | None
    poll_interval: float
    unreachable_timeout: float
    job_runtime_env: dict[str, Any] | None
    ship_package: bool
    aws_conn_id: str | None
    gcp_conn_id: str | None
    hf_conn_id: str | None
    entrypoint_num_cpus: float | None
    entrypoint_resources: dict[str, float] | None


__all__ = ["BaseOperatorArgs", "RayJobArgs"]
