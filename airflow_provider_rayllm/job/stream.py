"""What the stream's stages share: the columns the job carries through Ray's stages."""

from __future__ import annotations

import math
from typing import Any

# Columns the job carries through Ray's stages; input columns are stashed so the engine's own
# output columns (``prompt``, ``messages``...) cannot overwrite them.
STASH = "__rayllm_in"
REQUEST = "__rayllm_request"
PRE_ERROR = "__rayllm_pre_error"


def is_empty(value: Any) -> bool:
    # A JSON null or an empty CSV cell can arrive as None or as NaN, depending on the reader.
    return value is None or (isinstance(value, float) and math.isnan(value))
