"""Prefect flows (wiring only) and the campaign config."""
