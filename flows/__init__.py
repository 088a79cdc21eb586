"""Prefect flows (wiring only), the campaign config and the `gyre` command line."""
