"""The package version, one place for the Airflow half, the job half and the provider info."""

__version__ = "0.1.0"
