class JobError(Exception):
    """A failure the job reports in one line (printed with the RAYLLM_ERROR prefix)."""


class JobRefused(JobError):
    """A job that cannot run as it is set: its settings, its input or the cluster's hardware refuse it, so a
    retry would fail the same way (found before any engine starts)."""
