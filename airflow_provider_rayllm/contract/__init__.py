"""The contract: the only thing the Airflow half and the Ray half share.

- ``spec``: the job spec models (what the operator asks the job to do), validated on both sides.
- ``manifest``: what a finished job published, written last and returned through XCom.
- ``names``: files in the job package, secret environment variables, log line prefixes, output columns.
- ``progress``: the progress line the job prints and the operator reads.
- ``report``: the run's report page, made from a manifest's body (the job writes it beside the manifest).
- ``secrets``: which settings are secrets, and how they are kept out of what Ray shows.
- ``storage``: paths and buckets through pyarrow filesystems (the operator reads the manifest with it).

Nothing here imports Airflow, Ray or numpy at module load: the scheduler parses DAGs that import it, and
the job imports it on a cluster without Airflow.
"""
