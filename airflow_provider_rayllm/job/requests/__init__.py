"""Rows -> requests: the first step after the read, declaratively or with the user's callable.

Every row leaves this step with three columns: the input columns it keeps, with its request's key
(``KEPT_INPUT``), its request as JSON (``REQUEST``) and, for a row that cannot be prompted, why
(``PRE_ERROR``; the engines pass such a row through untouched, so it reaches the sink as an error row in
the same stream). The columns are named in ``job.stream``.

    callables  the user's preprocess and postprocess, loaded on the cluster
    prompts    one row -> its request (template, chat messages, the user's preprocess)
    images     image cells and the guide's image parts as data: URLs
    sampling   sampling params in vLLM's current form
    lora       which model (the base or a LoRA adapter) a row asks for
    keys       each request's key: a hash of the rendered request and the model that answers it
    ids        the id column: each id once, and the rows an earlier attempt answered for the same request skipped
    stage      the Ray Data stage that runs all of the above over the stream
"""

from __future__ import annotations

from airflow_provider_rayllm.job.requests.callables import load_callable
from airflow_provider_rayllm.job.requests.ids import IdGate
from airflow_provider_rayllm.job.requests.images import guide_image_parts, image_data_url, image_url
from airflow_provider_rayllm.job.requests.lora import LoraRouting
from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
from airflow_provider_rayllm.job.requests.sampling import normalize_sampling_params
from airflow_provider_rayllm.job.requests.stage import RequestStage

__all__ = [
    "IdGate",
    "LoraRouting",
    "RequestBuilder",
    "RequestStage",
    "guide_image_parts",
    "image_data_url",
    "image_url",
    "load_callable",
    "normalize_sampling_params",
]
