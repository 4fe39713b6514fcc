"""The Ray half: a plain Ray driver program. Never imports Airflow."""
