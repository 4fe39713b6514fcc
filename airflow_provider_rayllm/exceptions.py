"""Errors the Airflow half raises; Airflow sees them as task failures with our message. Those a retry
cannot fix (bad settings, refused credentials) are ``AirflowFailException``: the task fails at once instead
of spending its retries; a cluster that is away or a job that failed stays retryable."""

from airflow.sdk.exceptions import AirflowException, AirflowFailException


class RayLLMError(AirflowException):
    """Base class for this provider's errors."""


class RayJobFailed(RayLLMError):
    """The Ray job ended FAILED or STOPPED; carries Ray's message and the job's own error line."""


class RayJobLost(RayLLMError):
    """The Ray cluster no longer knows a job we submitted (the head restarted or the job was deleted)."""


class InvalidSpec(RayLLMError, AirflowFailException):
    """The operator's settings cannot make a valid job spec; raised before anything is submitted."""


class RayJobRefused(RayJobFailed, AirflowFailException):
    """The job refused to run as it was set (settings, input or the cluster's hardware), before any engine
    started: a retry would fail the same way."""
