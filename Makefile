# Two commands for a new user: `make demo` runs the main job on the embedded stack, `make test` the tests.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-unit bench clean-local

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m airflow_provider_rayllm.local demo

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest tests -m "not gpu" -v -p no:cacheprovider --timeout=1800 -ra --durations=30

test-unit: setup
	$(PY) -m pytest tests/unit -v -p no:cacheprovider

clean-local:
	$(PY) -m airflow_provider_rayllm.local stop || true

# Benchmarks write benchmarks/results/<date>*.json and docs/PERFORMANCE.md; not part of `make test`.
bench: setup
	$(PY) benchmarks/engine_bench.py
	$(PY) benchmarks/http_bench.py
	$(PY) benchmarks/scale_bench.py
	$(PY) benchmarks/load_bench.py
	$(PY) benchmarks/report.py
