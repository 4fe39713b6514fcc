"""Where the embedded stack keeps its model and sample data (paths only: nothing heavy at import)."""

from pathlib import Path

from airflow_provider_rayllm.local.models import MODELS_DIR

DEMO_MODEL = MODELS_DIR / "SmolLM2-135M-Instruct"
DEMO_INPUT = Path(__file__).resolve().parent / "data" / "questions.jsonl"
