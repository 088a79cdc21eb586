"""Prefect tasks: thin, typed, retry-safe wrappers over the layers below (flows call only these)."""
