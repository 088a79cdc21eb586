"""Environments: the built-in agent harness, problem suites + graders, sandbox, workspace snapshots."""
