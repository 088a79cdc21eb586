"""The gateway load benchmark, small: 32 concurrent multi-turn sessions for 10 s against the real stack
lose and duplicate no call in the store, and every execution is recorded."""

from __future__ import annotations

import pytest

from bench.load_gateway import gateway_load


@pytest.mark.slow
def test_gateway_load_loses_and_duplicates_no_call(tmp_path):
    sessions = 32

    figures = gateway_load(sessions=sessions, seconds=10, root=str(tmp_path))

    assert figures["errors"]["count"] == 0, figures["errors"]
    assert figures["lost"] == 0
    assert figures["duplicated"] == 0
    assert figures["calls"] > sessions  # multi-turn really happened
    assert figures["stored_calls"] == figures["calls"]
    assert figures["executions_recorded"] == sessions
    assert figures["survived"] == 1
    assert figures["latency_p99_s"] >= figures["latency_p50_s"] > 0
    assert figures["gateway_overhead_p99_s"] >= figures["gateway_overhead_p50_s"] >= 0
