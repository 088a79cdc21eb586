"""The scheduled campaigns (prefect.yaml) and what registers them with a Prefect server."""
