"""The xLong workload (bench/xlong.py) through the real stack, at a size a test can afford: every shape
of an xLong execution recorded, the stages that read it, and piecewise training equal to one piece."""

from __future__ import annotations

import asyncio
import os
import random

import duckdb
import pytest

from bench import xlong
from engines.model.loading import load_tokenizer
from stack.stack import local_stack
from trajectory_store import db
from trajectory_store.storage import Store, StoreConfig


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A group recorded by the real gateway and engine: the xLong execution (a branch every turn) and
    its sibling."""
    work = str(tmp_path_factory.mktemp("xlong"))
    policy = xlong.policy_copy(os.path.join(work, "policy"))
    store = StoreConfig(data_root=os.path.join(work, "store"), campaign="xlong")
    with local_stack(policy, store, threads=1, dtype="float32") as stack:
        logs = asyncio.run(
            xlong.run_group(
                stack.gateway_url, stack.admin_token, 6000, load_tokenizer(policy), seed=3, branch_every=1
            )
        )
    return work, logs


def test_the_harness_makes_every_shape_of_an_xlong_execution(recorded):
    work, logs = recorded
    log = logs["xlong"]
    assert log.touched >= 6000
    assert log.touched == log.prompt_tokens + log.completion_tokens
    assert {"main", "sub", "main_summary"} <= set(log.roles)
    assert log.summaries >= 1 and log.branches >= 1 and len(log.agents) >= 2
    con = db.connect(Store(StoreConfig(data_root=os.path.join(work, "store"), campaign="xlong")))
    calls = dict(con.execute("SELECT execution_id, count(*) FROM calls GROUP BY ALL").fetchall())
    assert calls == {"xlong": log.calls, "sibling": logs["sibling"].calls}  # every call recorded, once
    roles = dict(
        con.execute("SELECT role, count(*) FROM calls WHERE execution_id = 'xlong' GROUP BY ALL").fetchall()
    )
    assert roles == dict(log.roles)
    # the prompts the engine saw add up to what the harness was told it touched
    prompts = con.execute("SELECT sum(prompt_len) FROM calls WHERE execution_id = 'xlong'").fetchall()
    assert prompts[0][0] == log.prompt_tokens
    # a branch: two calls with the same context (the same prompt ids)
    siblings = con.execute(
        "SELECT max(n) FROM (SELECT count(*) AS n FROM calls WHERE execution_id = 'xlong' GROUP BY context_hash)"
    ).fetchall()[0][0]
    assert siblings >= 2
    con.close()


def test_the_stages_read_it_under_a_memory_limit_and_pieces_train_as_one(recorded):
    work, _ = recorded
    tree = xlong.stage_tree(work)  # DuckDB with memory_limit and a spill folder set
    assert tree["unique_tokens"] > 0 and tree["training_tokens"] > 0 and tree["selected_trajectories"] >= 2
    figures = xlong.stage_piecewise(work)
    assert figures["one_piece_sequences"] == 1 < figures["pieces"]
    assert figures["repeated_tokens"] > 0  # the pieces repeat the ancestors they need, as context only
    assert figures["loss_rel_diff"] <= 1e-5
    assert figures["grad_rel_diff"] <= 1e-5


def test_growth_exponents_are_log_log_slopes():
    small = {"tokens_touched": 1000, "stages": {"tree": {"s": 1.0, "peak_rss_gb": 1.0}}}
    large = {"tokens_touched": 4000, "stages": {"tree": {"s": 4.0, "peak_rss_gb": 2.0}}}
    assert xlong.growth([small, large]) == {"tree": {"time_exponent": 1.0, "memory_exponent": 0.5}}
    assert xlong.growth([small]) == {}


def test_tool_outputs_have_the_tokens_asked_for():
    texts = xlong.Texts(load_tokenizer(xlong.POLICY), random.Random(0))
    for tokens in (50, 700):
        made = len(texts.tokenizer.encode(texts.make(tokens, "file"), add_special_tokens=False))
        assert tokens <= made <= tokens + 40  # whole lines: at most one line over


def test_duckdb_spills_past_the_store_memory_limit(tmp_path):
    spill = tmp_path / "spill"
    config = StoreConfig(
        data_root=str(tmp_path / "store"), duckdb_memory_limit="48MB", duckdb_temp_directory=str(spill)
    )
    con = db.connect(Store(config))
    assert con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0].endswith("MiB")
    # a sort of ~250 MB of rows: more than the limit, so it must go to disk
    big_sort = (
        "SELECT sum(i * r) FROM (SELECT i, random() AS r FROM range(8000000) t(i) ORDER BY r LIMIT 7000000)"
    )
    assert not spill.exists()
    assert con.execute(big_sort).fetchall()[0][0] > 0
    assert spill.is_dir()  # DuckDB makes its spill folder when it first spills
    con.close()
    # the same query under the same limit with spilling off runs out of memory
    bare = duckdb.connect(":memory:", config={"memory_limit": "48MB", "temp_directory": ""})
    with pytest.raises(duckdb.OutOfMemoryException):
        bare.execute(big_sort).fetchall()
    bare.close()
    with pytest.raises(ValueError, match="duckdb_memory_limit"):
        StoreConfig(duckdb_memory_limit="lots")


def test_the_snapshot_stage_stores_and_restores_a_workspace(tmp_path):
    figures = xlong.stage_snapshot(str(tmp_path), 2 << 20)
    assert figures["workspace_bytes"] >= 2 << 20 and figures["files"] >= 8
    assert not (tmp_path / "workspace").exists() and not (tmp_path / "restored").exists()
