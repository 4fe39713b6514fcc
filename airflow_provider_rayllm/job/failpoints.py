"""Failpoints: a test sets ``RAYLLM_FAILPOINT=<step>`` in the job's runtime_env, and the process reaching that
step ends at once (``os._exit``: no cleanup, as a crash), to show what the job does about it."""

from __future__ import annotations

import os
import sys

FAILPOINT_ENV = "RAYLLM_FAILPOINT"


def failpoint(step: str, who: str = "the driver") -> None:
    if os.environ.get(FAILPOINT_ENV) == step:
        print(f"failpoint {step}: {who} ends here", flush=True)
        sys.stdout.flush()
        os._exit(1)
