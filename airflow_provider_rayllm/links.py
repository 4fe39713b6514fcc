"""Extra links from a task to its job in the Ray dashboard, to its output in a cloud console, and to the
run's report page."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink, BaseXCom

from airflow_provider_rayllm.contract.spec import uri_scheme

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

OUTPUT_URL_XCOM = "output_console_url"
REPORT_URL_XCOM = "report_url"


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


class ReportLink(BaseOperatorLink):
    """The run's report page (``_report.html`` beside the manifest), at an address a browser can open."""

    name = "Report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return BaseXCom.get_value(ti_key=ti_key, key=REPORT_URL_XCOM) or ""


def report_browser_url(uri: str, s3_endpoint: str | None = None, gcs_endpoint: str | None = None) -> str:
    """Where a browser can open a report stored at ``uri``:

    - a local path: its ``file://`` URL, which a browser on the same machine opens when it is pasted or
      opened directly (browsers do not follow a ``file://`` link from an http page);
    - s3:// behind an endpoint (MinIO, a test server): the object's path-style URL on that endpoint, which
      shows the page where the bucket lets the browser read without signing;
    - s3:// on AWS: the object's page in the AWS console ("Open" shows the page);
    - gs:// behind an emulator: the object's media URL there; on GCS, the authenticated browser URL, which
      shows the page to a signed-in user who may read the object.
    """
    scheme = uri_scheme(uri)
    if scheme == "file":
        path = uri[len("file://") :] if uri.startswith("file://") else uri
        return "file://" + quote(os.path.abspath(path))
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    if scheme == "s3":
        if s3_endpoint:
            return f"{s3_endpoint.rstrip('/')}/{quote(bucket)}/{quote(key)}"
        return f"https://s3.console.aws.amazon.com/s3/object/{quote(bucket)}?prefix={quote(key, safe='')}"
    if gcs_endpoint:
        base = gcs_endpoint if "://" in gcs_endpoint else f"http://{gcs_endpoint}"
        return f"{base.rstrip('/')}/storage/v1/b/{quote(bucket)}/o/{quote(key, safe='')}?alt=media"
    return f"https://storage.cloud.google.com/{quote(bucket)}/{quote(key)}"
