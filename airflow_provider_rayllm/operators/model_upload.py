"""ModelUploadOperator: cache model weights in S3 or GCS, verified, then serve batch jobs from there."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from airflow_provider_rayllm.operators.base import RayLLMBatchBaseOperator
from airflow_provider_rayllm.spec import RunSpec, is_local_path, uri_scheme

if TYPE_CHECKING:
    from airflow.sdk import Context


class ModelUploadOperator(RayLLMBatchBaseOperator):
    """Upload a model (Hugging Face id or a folder on the cluster) to ``bucket_uri`` as a Ray job.

    Every file is read back and compared (name, size, sha256) before the model manifest
    (``rayllm-model-manifest.json``) is written; the same content already there is skipped. Returns the
    manifest: bucket URI, files, bytes, checksum and whether it was skipped. Use the bucket URI as
    ``model_source`` of VLLMBatchOperator (pass it through XCom: ``"{{ ti.xcom_pull('upload')['output_uri'] }}"``).
    """

    template_fields: Sequence[str] = ("model_source", "bucket_uri", "revision")

    def __init__(
        self,
        *,
        model_source: str,
        bucket_uri: str,
        revision: str | None = None,
        allow_patterns: list[str] | None = None,
        ignore_patterns: list[str] | None = None,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.model_source = model_source
        self.bucket_uri = bucket_uri
        self.revision = revision
        self.allow_patterns = allow_patterns
        self.ignore_patterns = ignore_patterns
        self.overwrite = overwrite

    def resolve_output_uri(self, run: RunSpec) -> str:
        return str(self.bucket_uri)

    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        return {
            "kind": "upload",
            "model_source": self.model_source,
            "bucket_uri": self.bucket_uri,
            "revision": self.revision,
            "allow_patterns": self.allow_patterns,
            "ignore_patterns": self.ignore_patterns,
            "overwrite": self.overwrite,
        }

    def lineage_inputs(self) -> list[str]:
        # A Hugging Face id is not a location; a folder or bucket is.
        source = str(self.model_source)
        return [source] if uri_scheme(source) != "file" or is_local_path(source) else []

    def _publish(self, context: Context, manifest: dict[str, Any]) -> None:
        context["ti"].xcom_push(key="output_uri", value=manifest["output_uri"])
        self.log.info(
            "%s %s: %d files, %d bytes, checksum %s",
            "Already there" if manifest["skipped"] else "Uploaded",
            manifest["output_uri"],
            manifest["file_count"],
            manifest["bytes"],
            manifest["checksum"][:16],
        )
