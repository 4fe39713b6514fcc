"""Extra links from a task to its job in the Ray dashboard and to its output in a cloud console."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink, BaseXCom

from airflow_provider_rayllm.contract.spec import uri_scheme

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

OUTPUT_URL_XCOM = "output_console_url"


class RayJobLink(BaseOperatorLink):
    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return BaseXCom.get_value(ti_key=ti_key, key="ray_job_url") or ""


class OutputLink(BaseOperatorLink):
    """The published output folder in the AWS or Google Cloud console (none for local paths)."""

    name = "Output"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return BaseXCom.get_value(ti_key=ti_key, key=OUTPUT_URL_XCOM) or ""


def output_browser_url(uri: str, custom_endpoint: bool = False) -> str | None:
    """A console page for an S3 or GCS folder; None for local paths and for buckets behind a custom
    endpoint (MinIO, an emulator), which no public console shows."""
    scheme = uri_scheme(uri)
    if custom_endpoint or scheme not in ("s3", "gs", "gcs"):
        return None
    bucket, _, prefix = uri.split("://", 1)[1].partition("/")
    prefix = prefix.strip("/")
    if scheme == "s3":
        folder = f"{prefix}/" if prefix else ""
        return f"https://s3.console.aws.amazon.com/s3/buckets/{quote(bucket)}?prefix={quote(folder, safe='')}"
    return f"https://console.cloud.google.com/storage/browser/{quote(bucket)}/{quote(prefix)}"
