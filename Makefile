# Two commands for a new user: `make demo` runs the main job on the embedded stack, `make test` the tests.
VENV ?= .venv
# pytest-xdist workers for `make test` (tests/conftest.py says how the tests are shared between them).
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python

.PHONY: setup demo ui test test-unit bench clean-local

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m airflow_provider_rayllm.local demo

# Airflow's UI over the demo's database (its run, logs and report link) on http://127.0.0.1:8080; Ctrl-C stops it.
ui: setup
	$(PY) -m airflow_provider_rayllm.local ui

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest tests -m "not gpu" -v -p no:cacheprovider --timeout=1800 -ra --durations=30 \
		-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-unit: setup
	$(PY) -m pytest tests/unit -v -p no:cacheprovider

clean-local:
	$(PY) -m airflow_provider_rayllm.local stop || true

# Benchmarks write benchmarks/results/<date>*.json and docs/PERFORMANCE.md; not part of `make test`.
bench: setup
	$(PY) benchmarks/engine_bench.py
	$(PY) benchmarks/http_bench.py
	$(PY) benchmarks/scale_bench.py
	$(PY) benchmarks/scale_bench.py --window-mb 16 --sizes 100000,1000000
	$(PY) benchmarks/load_bench.py
	$(PY) benchmarks/prefix_bench.py
	$(PY) benchmarks/report.py

# The lent H200 machine: builds .gpu/ (git-ignored; skipped when complete and up to date) and prints the calls
# to send. It runs nothing on a GPU; benchmarks/gpu/plan.md says how the results come back.
.PHONY: bench-gpu
bench-gpu: setup
	bash benchmarks/gpu/build_site.sh
	@cat benchmarks/gpu/plan.md
	@echo; echo "Measured carry per call (this build):"; cat .gpu/scripts/calls.txt
