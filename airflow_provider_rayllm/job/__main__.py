import sys

from airflow_provider_rayllm.job.entrypoint import main

sys.exit(main(sys.argv[1:]))
