"""ModelUploadOperator: cache model weights in S3 or GCS, verified, then serve batch jobs from there."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

from airflow_provider_rayllm.contract.spec import RunSpec, is_local_path, uri_scheme
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.base import RayJobOperator
from airflow_provider_rayllm.operators.task_args import RayJobArgs

if TYPE_CHECKING:
    from airflow.sdk import Context


class ModelUploadOperator(RayJobOperator):
    """Upload a model (Hugging Face id or a folder on the cluster) to ``bucket_uri`` as a Ray job.

    Every file is read back and compared (name, size, sha256) before the model manifest
    (``rayllm-model-manifest.json``) is written; the same content already there is skipped. Returns the
    manifest: bucket URI, files, bytes, checksum and whether it was skipped. Use the bucket URI as
    ``model_source`` of VLLMBatchOperator (pass it through XCom: ``"{{ ti.xcom_pull(task_ids='upload', key='model_uri') }}"``).
    """

    arguments = arguments.operator_arguments("upload")

    def __init__(
        self,
        *,
        model_source: str,
        bucket_uri: str,
        revision: str | None = None,
        allow_patterns: list[str] | None = None,
        ignore_patterns: list[str] | None = None,
        overwrite: bool = False,
        **kwargs: Unpack[RayJobArgs],
    ) -> None:
        super().__init__(**kwargs)
        self.take_arguments(locals())

    def resolve_output_uri(self, run: RunSpec) -> str:
        return str(self.bucket_uri)

    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        return {"kind": "upload", **self.section("upload")}

    def lineage_inputs(self) -> list[str]:
        # A Hugging Face id is not a location; a folder or bucket is.
        source = str(self.model_source)
        return [source] if uri_scheme(source) != "file" or is_local_path(source) else []

    def publish(self, context: Context, manifest: dict[str, Any]) -> None:
        context["ti"].xcom_push(key="model_uri", value=manifest["output_uri"])
        self.log.info(
            "%s %s: %d files, %d bytes, checksum %s",
            "Already there" if manifest["skipped"] else "Uploaded",
            manifest["output_uri"],
            manifest["file_count"],
            manifest["bytes"],
            manifest["checksum"][:16],
        )
