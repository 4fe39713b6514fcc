"""hf://datasets/ input: the dataset repo checked on the Hub before any file is listed.

Through HfFileSystem a gated dataset without a token, a private one and a misspelt one all read as "no such
file"; asking the Hub for the repo first tells them apart, so the job fails before any engine starts with
what is wrong and what to do.
"""

from __future__ import annotations

import os
from typing import Mapping

from airflow_provider_rayllm.contract.spec import hf_dataset
from airflow_provider_rayllm.contract.storage import hub_endpoint, hub_token
from airflow_provider_rayllm.job.errors import JobError

NO_TOKEN = "the job has no Hugging Face token: give hf_conn_id (a connection whose password is a token with access)"


def check_dataset(uri: str, env: Mapping[str, str] | None = None) -> None:
    """A JobError naming ``uri`` when its dataset repo or revision cannot be read with the job's token."""
    try:
        from huggingface_hub import HfApi, get_token
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise JobError(
            f"input_uri {uri!r}: reading hf:// needs huggingface_hub on the cluster (this package's `hf` extra)"
        ) from None

    env = os.environ if env is None else env
    repo_id, revision, _ = hf_dataset(uri)
    endpoint = hub_endpoint(env)
    # As HfFileSystem will find it: the job's secret, else a token stored on the node.
    token = hub_token(env) or (get_token() if env is os.environ else None)
    where = f"input_uri {uri!r}: dataset {repo_id!r} on {endpoint}"
    try:
        info = HfApi(endpoint=endpoint, token=token or False).dataset_info(repo_id, revision=revision, timeout=30)
    except GatedRepoError:
        if not token:
            raise JobError(f"{where} is gated and {NO_TOKEN}") from None
        raise JobError(f"{where} is gated and the job's token (hf_conn_id) has no access to it") from None
    except RevisionNotFoundError:
        raise JobError(f"{where} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        hint = f"; if it is private, {NO_TOKEN}" if not token else ", or the job's token (hf_conn_id) cannot see it"
        raise JobError(f"{where} does not exist{hint}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise JobError(f"{where} cannot be read: {exc}") from None
    # The Hub shows a gated dataset's card to anyone and refuses its files: say so before listing them.
    if getattr(info, "gated", False) and not token:
        raise JobError(f"{where} is gated and {NO_TOKEN}")
