"""What ``airflow providers list`` and the connection form know about this package."""

from airflow_provider_rayllm.version import __version__


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-provider-rayllm",
        "name": "Ray LLM batch inference",
        "description": "LLM batch inference with Ray Data (vLLM engines or OpenAI-compatible endpoints) as Ray jobs.",
        "versions": [__version__],
        "integrations": [
            {"integration-name": "Ray", "external-doc-url": "https://docs.ray.io/", "tags": ["compute"]},
        ],
        "operators": [
            {
                "integration-name": "Ray",
                "python-modules": [
                    "airflow_provider_rayllm.operators.vllm_batch",
                    "airflow_provider_rayllm.operators.http_batch",
                    "airflow_provider_rayllm.operators.model_upload",
                ],
            },
        ],
        "task-decorators": [
            {"name": "vllm_batch", "class-name": "airflow_provider_rayllm.decorators.vllm_batch_task"},
            {"name": "http_llm_batch", "class-name": "airflow_provider_rayllm.decorators.http_llm_batch_task"},
        ],
        "hooks": [{"integration-name": "Ray", "python-modules": ["airflow_provider_rayllm.hooks.ray_job"]}],
        "triggers": [{"integration-name": "Ray", "python-modules": ["airflow_provider_rayllm.triggers.ray_job"]}],
        "extra-links": [
            "airflow_provider_rayllm.links.RayJobLink",
            "airflow_provider_rayllm.links.OutputLink",
            "airflow_provider_rayllm.links.ReportLink",
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_provider_rayllm.hooks.ray_job.RayJobHook",
                "hook-name": "Ray",
                "connection-type": "ray",
                "conn-fields": {
                    "verify": {
                        "label": "Verify TLS certificate",
                        "schema": {"type": ["boolean", "null"], "default": True},
                    },
                    "ca_bundle": {
                        "label": "CA bundle path",
                        "schema": {"type": ["string", "null"]},
                        "description": "PEM file that signs the dashboard's certificate (overrides Verify TLS).",
                    },
                    "headers": {
                        "label": "Extra HTTP headers (JSON object)",
                        "schema": {"type": ["object", "null"]},
                    },
                    "output_base": {
                        "label": "Default output base",
                        "schema": {"type": ["string", "null"]},
                        "description": "Folder or bucket prefix under which each task run gets its own output prefix.",
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "port"],
                    "relabeling": {"host": "Ray dashboard URL", "password": "Ray auth token"},
                    "placeholders": {
                        "host": "http://127.0.0.1:8265 or https://ray.example.internal",
                        "password": "token printed by `ray get-auth-token` (leave empty if auth is off)",
                    },
                },
            }
        ],
    }
