"""The embedded default stack: a local Ray head and the models prepared from PyPI packages."""
