class JobError(Exception):
    """A failure the job reports in one line (printed with the RAYLLM_ERROR prefix)."""
