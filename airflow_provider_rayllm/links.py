"""Extra link from a task to its job in the Ray dashboard."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink, BaseXCom

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator


class RayJobLink(BaseOperatorLink):
    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return BaseXCom.get_value(ti_key=ti_key, key="ray_job_url") or ""
