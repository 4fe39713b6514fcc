import logging
import os
import sys

from airflow_provider_rayllm.job.entrypoint import main

code = main(sys.argv[1:])
# The job's last line is printed and its own clean-up done. Ray's disconnect (what its exit hook does) runs
# here, as it would at exit; what is skipped is the interpreter's teardown of ray.data, pyarrow and pandas,
# which took about 1 s of every job between its last line and the Jobs API reporting it ended (measured on a
# local cluster, 2 cores: 1.3 s from the last line to the job's end, 0.3 s this way).
if "ray" in sys.modules:
    import ray

    if ray.is_initialized():
        ray.shutdown()
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
