"""Property tests: the delta encoding, the DuckDB trees, selection and packing against a Python trie."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.train.tree_attention import subtree_sizes
from tests.trees import Trie, random_execution
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.interchange import rebuild_sequences
from trajectory_store.processor import ancestor_mask, pack, path_to
from trajectory_store.recorder import Recorder
from trajectory_store.schema import ROLES
from trajectory_store.storage import Store, StoreConfig

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def record(tmp_path, executions: dict[str, list[dict]], rewards: dict[str, float] | None = None) -> Store:
    store = Store(StoreConfig(data_root=str(tmp_path / f"d{len(list(tmp_path.iterdir()))}"), campaign="t"))
    recorder = Recorder(store, step=0, flush_calls=7)  # small batches: many parts and manifests
    for execution_id, calls in executions.items():
        for call in calls:
            recorder.record_call_dict(call)
        reward = (rewards or {}).get(execution_id, float(len(calls) % 3) / 2)
        recorder.record_execution(execution_id, "completed", reward=reward, group_id="g")
    recorder.close()
    return store


executions_strategy = st.dictionaries(
    keys=st.sampled_from(["a", "b", "c"]),
    values=st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 14), st.integers(2, 6)),
    min_size=1,
)


def build(spec: dict) -> dict[str, list[dict]]:
    return {e: random_execution(seed, n, vocab, e) for e, (seed, n, vocab) in spec.items()}


@SETTINGS
@given(spec=executions_strategy)
def test_prompts_rebuild_exactly_and_trie_counts_match(tmp_path, spec):
    executions = build(spec)
    store = record(tmp_path, executions)
    calls = store.read_table("calls")
    con = connect(store)
    for execution_id, originals in executions.items():
        trie = Trie(originals)
        mine = calls.filter(calls.column("execution_id").to_numpy(zero_copy_only=False) == execution_id)
        rebuilt = {row["call_id"]: seq for row, seq in rebuild_sequences(mine)}
        for call in originals:
            np.testing.assert_array_equal(
                rebuilt[call["call_id"]], np.concatenate([call["prompt_ids"], call["output_ids"]])
            )
        sql_prompts = dict(
            con.execute(
                "SELECT call_id, prompt_ids FROM call_prompts WHERE execution_id = ?", [execution_id]
            ).fetchall()
        )
        for call in originals:
            assert sql_prompts[call["call_id"]] == call["prompt_ids"].tolist()

        nodes = trie.nodes()
        stored_tokens = sum(len(x) for x in mine.column("new_ids").to_pylist())
        assert stored_tokens == len(nodes)  # storage grows with unique tokens only
        n_tokens, n_policy = con.execute(
            "SELECT sum(n_tokens), coalesce(sum(n_tokens) FILTER (WHERE is_policy), 0) FROM tree_nodes "
            "WHERE execution_id = ?",
            [execution_id],
        ).fetchall()[0]
        assert n_tokens == len(nodes)
        assert n_policy == sum(n.policy for n in nodes)

        # the tree_nodes rebuild the same trie: every root-to-leaf token path, with policy flags
        rows = con.execute(
            "SELECT node_id, parent_node_id, token_ids, is_policy FROM tree_nodes WHERE execution_id = ?",
            [execution_id],
        ).fetchall()
        by_id = {r[0]: r for r in rows}
        parents = {r[1] for r in rows}
        sql_paths = set()
        for node_id, *_ in rows:
            if node_id in parents:
                continue
            tokens, flags, at = [], [], node_id
            while at is not None:
                _, parent, ids, policy = by_id[at]
                tokens[:0] = ids
                flags[:0] = [policy] * len(ids)
                at = parent
            sql_paths.add((tuple(tokens), tuple(flags)))
        trie_paths = {(tuple(n.token for n in p), tuple(n.policy for n in p)) for _, p in trie.leaves()}
        assert sql_paths == trie_paths

        # trajectories: one per leaf, with the policy tokens on its path
        trajectories = con.execute(
            "SELECT trajectory_id, role, n_tokens, n_policy_tokens FROM trajectories WHERE execution_id = ?",
            [execution_id],
        ).fetchall()
        assert len(trajectories) == len(trie.leaves())
        for trajectory_id, role, length, n_policy_tokens in trajectories:
            path = trie.path_of(trajectory_id)
            assert not path[-1].children  # it ends at a leaf
            assert role == trie.calls[trajectory_id]["role"]
            assert length == len(path)
            assert n_policy_tokens == sum(n.policy for n in path)


@SETTINGS
@given(spec=executions_strategy, j_max=st.integers(1, 6), seed=st.integers(0, 5), data=st.data())
def test_selection_respects_priority_and_weights_sum_to_one(tmp_path, spec, j_max, seed, data):
    executions = build(spec)
    store = record(tmp_path, executions)
    priority = data.draw(
        st.permutations(ROLES).map(list).flatmap(lambda p: st.integers(1, 4).map(lambda k: p[:k]))
    )
    selection = SelectionConfig(role_priority=priority, j_max=j_max, seed=seed)
    con = connect(store, selection)
    selected = con.execute(
        "SELECT execution_id, trajectory_id, role, rank FROM selected_trajectories ORDER BY execution_id, rank"
    ).fetchall()
    again = (
        connect(store, selection)
        .execute(
            "SELECT execution_id, trajectory_id, role, rank FROM selected_trajectories ORDER BY execution_id, rank"
        )
        .fetchall()
    )
    assert selected == again  # seeded and reproducible
    candidates = con.execute(
        "SELECT execution_id, trajectory_id, role FROM trajectories WHERE n_policy_tokens > 0"
    ).fetchall()
    for execution_id in executions:
        mine = [s for s in selected if s[0] == execution_id]
        pool = [c for c in candidates if c[0] == execution_id and c[2] in priority]
        assert len(mine) == min(j_max, len(pool))
        assert [s[3] for s in mine] == list(range(1, len(mine) + 1))
        ranks = [priority.index(s[2]) for s in mine]
        assert ranks == sorted(ranks)  # role priority order
        if mine:
            worst = max(ranks)
            chosen = {s[1] for s in mine}
            # every candidate of a strictly better role was taken before a worse one
            assert all(c[1] in chosen for c in pool if priority.index(c[2]) < worst)

    # training tokens: each policy token of the union of the selected paths, once, weights sum to 1
    trie_by_execution = {e: Trie(c) for e, c in executions.items()}
    expected: dict[str, dict[int, float]] = {}
    for execution_id, trajectory_id, *_ in selected:
        for node in trie_by_execution[execution_id].path_of(trajectory_id):
            if node.policy:
                expected.setdefault(execution_id, {})[id(node)] = node.logprob
    rows = con.execute(
        "SELECT execution_id, count(*), sum(weight), sum(behaviour_logprob) FROM training_tokens GROUP BY ALL"
    ).fetchall()
    assert {r[0] for r in rows} == set(expected)
    for execution_id, count, weight_sum, logprob_sum in rows:
        assert count == len(expected[execution_id])
        assert weight_sum == pytest.approx(1.0, abs=1e-9)
        assert logprob_sum == pytest.approx(sum(expected[execution_id].values()), abs=1e-4)


@SETTINGS
@given(spec=executions_strategy, budget_slack=st.integers(0, 30))
def test_packing_recovers_every_selected_trajectory(tmp_path, spec, budget_slack):
    executions = build(spec)
    store = record(tmp_path, executions)
    con = connect(store)
    longest = con.execute("SELECT coalesce(max(n_tokens), 1) FROM selected_trajectories").fetchall()[0][0]
    budget = max(16, int(longest) + budget_slack)
    batch = pack(con, PackingConfig(token_budget=budget, advantage="mean"))
    selected = con.execute("SELECT execution_id, trajectory_id FROM selected_trajectories").fetchall()
    found = {}
    for sequence in batch.sequences:
        assert len(sequence) <= budget
        assert np.all(sequence.parent_index < np.arange(len(sequence)))  # parents come first
        subtree_sizes(sequence.parent_index)  # preorder, shared prefixes too: raises if a subtree is split
        # position ids are depths: a root is at 0 and each token sits one below its parent
        roots = sequence.parent_index < 0
        assert np.all(sequence.position_ids[roots] == 0)
        assert np.all(
            sequence.position_ids[~roots] == sequence.position_ids[sequence.parent_index[~roots]] + 1
        )
        for execution_id, trajectory_id, index in sequence.leaves:
            found[(execution_id, trajectory_id)] = path_to(sequence, index)
    assert set(found) == set(selected)
    for (execution_id, trajectory_id), tokens in found.items():
        call = executions[execution_id][trajectory_id]
        np.testing.assert_array_equal(tokens, np.concatenate([call["prompt_ids"], call["output_ids"]]))
    # every training token is a target exactly once; weights per execution sum to 1
    n_training = con.execute("SELECT count(*) FROM training_tokens").fetchall()[0][0]
    assert sum(int(s.loss_mask.sum()) for s in batch.sequences) == n_training == batch.n_target_tokens
    totals: dict[str, float] = {}
    for sequence in batch.sequences:
        for slot, execution_id in enumerate(sequence.executions):
            mine = sequence.execution_index == slot
            totals[execution_id] = totals.get(execution_id, 0.0) + float(sequence.weights[mine].sum())
            advantage = batch.advantages[execution_id]
            assert np.allclose(sequence.advantages[mine & sequence.loss_mask], advantage)
    assert all(abs(total - 1.0) < 1e-5 for total in totals.values())
    assert batch.n_tokens == batch.n_unique_tokens + batch.n_repeated_tokens - batch.n_shared_tokens


def test_split_trees_repeat_ancestors_as_context_only(tmp_path):
    # one long shared prefix with many branches: a small budget must split it at subtree boundaries
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 50, 40).astype(np.int32)
    calls = []
    for i in range(6):
        prompt = np.concatenate([trunk, rng.integers(0, 50, 5)]).astype(np.int32)
        output = rng.integers(0, 50, 8).astype(np.int32)
        calls.append(
            {
                "execution_id": "e",
                "call_id": i,
                "agent_id": "main",
                "role": "main",
                "prompt_ids": prompt,
                "output_ids": output,
                "output_logprobs": np.full(8, -0.5, np.float32),
                "policy_version": 0,
            }
        )
    store = record(tmp_path, {"e": calls})
    con = connect(store, SelectionConfig(j_max=6))
    whole = pack(con, PackingConfig(token_budget=1000))
    split = pack(con, PackingConfig(token_budget=60))
    assert len(whole.sequences) == 1 and whole.n_repeated_tokens == 0
    assert len(split.sequences) > 1 and split.n_repeated_tokens >= 40
    assert split.n_target_tokens == whole.n_target_tokens == 6 * 8
    for sequence in split.sequences:
        mask = ancestor_mask(sequence)
        # every target attends to a full path from a root: its position id + 1 tokens
        targets = np.flatnonzero(sequence.loss_mask)
        assert np.all(mask[targets].sum(axis=1) == sequence.position_ids[targets] + 1)
    with pytest.raises(ValueError, match="token budget"):
        pack(con, PackingConfig(token_budget=30))


def test_advantages_are_group_relative():
    from trajectory_store.processor import group_advantages

    rewards = {"a": ("g", 1.0), "b": ("g", 0.0), "c": ("g", 0.5), "d": ("h", 2.0)}
    grpo = group_advantages(rewards, "grpo", 1e-6)
    assert grpo["a"] == pytest.approx(0.5 / np.std([1.0, 0.0, 0.5]), rel=1e-5)
    assert grpo["d"] == 0.0
    assert group_advantages(rewards, "mean", 1e-6)["b"] == pytest.approx(-0.5)
    assert group_advantages(rewards, "rloo", 1e-6)["a"] == pytest.approx(1.0 - 0.25)
    positive = group_advantages(rewards, "positive", 1e-6)
    assert positive["a"] == grpo["a"] > 0 and positive["b"] == 0.0 > grpo["b"] and positive["c"] == 0.0
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(rewards, "ppo", 1e-6)
