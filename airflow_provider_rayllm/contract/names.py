"""Names both halves must agree on: files in the job package, environment variables that carry secrets,
the prefixes of the log lines the job prints for the operator, and the columns the job adds to every row."""

from __future__ import annotations

SPEC_VERSION = 1
MANIFEST_VERSION = 1
# The published output's layout under output_uri: data files at the top level (``part-*``), everything else
# under names that folder readers (pyarrow, pandas, Spark, Athena, DuckDB) skip, as they begin with "_".
MANIFEST_NAME = "_manifest.json"
# The run's report page (contract/report.py), written just before the manifest that names it.
REPORT_NAME = "_report.html"
SUCCESS_MARKER = "_SUCCESS"  # empty, written after the manifest (the Hadoop/Spark convention)
ERRORS_DIR = "_errors"  # the published error rows
GENERATIONS_DIR = "_generations"  # attempts in flight, one folder each

# Files in the job package (the Ray job's working_dir).
SPEC_FILE = "spec.json"
# What the operator submits: the job half's command, run in the folder that holds SPEC_FILE.
ENTRYPOINT = f"python -m airflow_provider_rayllm.job {SPEC_FILE}"
# The job ``on_kill`` submits after a stop (the stopped job's submission id follows).
SWEEP_ENTRYPOINT = "python -m airflow_provider_rayllm.job --sweep-after"
SECRETS_FILE = "secrets.json"
# Beside it: which submission the package belongs to (no secret), so a later job can tell a leftover.
JOB_FILE = "rayllm-job.json"
# Every worker process of a job runs this first: it loads the secrets file into its own environment.
SETUP_HOOK = "airflow_provider_rayllm.job.worker_setup.setup"
# In an engine actor's runtime_env: the bucket prefix its vLLM cache is copied from and saved to (the hook starts it).
COMPILE_CACHE_ENV = "RAYLLM_COMPILE_CACHE"

# Secrets, as environment variables of the job's processes (loaded from the secrets file).
SQL_URI_ENV = "RAYLLM_SQL_URI"  # the source database, with its password
SINK_SQL_URI_ENV = "RAYLLM_SINK_SQL_URI"  # the output table's database
HTTP_API_KEY_ENV = "RAYLLM_HTTP_API_KEY"  # the OpenAI-compatible endpoint's key
HTTP_USERINFO_ENV = "RAYLLM_HTTP_USERINFO"  # user:password from the endpoint's URL
GCP_KEYFILE_JSON = "RAYLLM_GCP_KEYFILE_JSON"  # a service-account key as JSON text
# A secret-looking engine setting travels as RAYLLM_ENGINE_SECRET_<NAME>; the spec holds SECRET_MARKER.
ENGINE_SECRET_ENV = "RAYLLM_ENGINE_SECRET_"
SECRET_MARKER = "$secret"

# Lines the job prints for the operator to read from its log.
MANIFEST_LOG_PREFIX = "RAYLLM_MANIFEST "
ERROR_LOG_PREFIX = "RAYLLM_ERROR "
# Printed alone just before the error line when a retry cannot help (the settings, the input or the cluster's
# hardware refuse the job): the operator then fails the task without spending its retries.
REFUSED_LOG_LINE = "RAYLLM_REFUSED"
PROGRESS_LOG_PREFIX = "RAYLLM_PROGRESS "

# Columns our job adds to every output row; input columns with these names are refused.
OUTPUT_TOKENS_IN = "num_input_tokens"
OUTPUT_TOKENS_OUT = "num_generated_tokens"
ERROR_COLUMN = "error"
# A hash of the request a row was answered for (its rendered prompt or messages, sampling, model, task): a
# saved answer is reused on resume only while its id and this key both match the current input's.
REQUEST_KEY_COLUMN = "_request_key"
