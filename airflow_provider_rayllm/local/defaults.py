"""Where the embedded stack keeps its model and sample data (paths only: nothing heavy at import)."""

from pathlib import Path

from airflow_provider_rayllm.local.models import LORA_ADAPTER, MODELS_DIR, TINY_VLM

DEMO_MODEL = MODELS_DIR / "SmolLM2-135M-Instruct"
DEMO_LORA_DIR = MODELS_DIR / "lora"
DEMO_LORA_ADAPTER = LORA_ADAPTER
DATA = Path(__file__).resolve().parent / "data"
DEMO_INPUT = DATA / "questions.jsonl"
DEMO_SENTENCES = DATA / "sentences.jsonl"
DEMO_EXTRACTION = DATA / "extraction.jsonl"
DEMO_IMAGES = DATA / "images.jsonl"
DEMO_VLM = MODELS_DIR / TINY_VLM


def embed_model() -> str:
    """all-MiniLM-L6-v2 as shipped in its PyPI package (a path lookup, no import of the model)."""
    from airflow_provider_rayllm.local.models import minilm_path

    try:
        return str(minilm_path())
    except RuntimeError:
        return "sentence-transformers/all-MiniLM-L6-v2"
