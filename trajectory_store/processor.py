"""The trajectory processor: selected training trees -> packed sequences for the trainer.

DuckDB (sql/05_selection.sql) chooses each execution's trajectories and builds its training tree
(training_nodes). Here the trees become packed sequences: token ids, position ids (= depth),
the index of each token's parent in the same sequence (which defines ancestor-only attention),
the loss mask, per-token weights (1 / policy tokens of the execution's training tree), behaviour
logprobs and the execution's group-relative advantage.

Trees are placed whole when they fit the token budget. A tree larger than the budget is split at
subtree boundaries: each new sequence repeats the ancestors its first subtree needs, as context
only (a policy token is a target exactly once), and the repeated tokens are counted. The loops run
over tree nodes (runs of tokens), never over single tokens.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from trajectory_store.config import PackingConfig


@dataclass
class PackedSequence:
    """One packed sequence; every array has the sequence's length T."""

    token_ids: np.ndarray  # [T] int32
    position_ids: np.ndarray  # [T] int32, depth of the token in its tree
    parent_index: np.ndarray  # [T] int32, index of the previous token on the path; -1 at a root
    loss_mask: np.ndarray  # [T] bool, True where the token is a training target
    weights: np.ndarray  # [T] float32, 0 where not a target
    behaviour_logprobs: np.ndarray  # [T] float32, 0 where not a target
    advantages: np.ndarray  # [T] float32, the execution's advantage on its targets, 0 elsewhere
    policy_versions: np.ndarray  # [T] int32, the policy version that sampled a target, -1 elsewhere
    execution_index: np.ndarray  # [T] int32, index into ``executions``
    executions: list[str]
    leaves: list[tuple[str, int, int]]  # (execution_id, trajectory_id, index of its last token)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PackedBatch:
    sequences: list[PackedSequence]
    advantages: dict[str, float]  # execution_id -> advantage
    n_tokens: int = 0  # tokens in all sequences, repeats included
    n_unique_tokens: int = 0  # tokens of the training trees
    n_target_tokens: int = 0
    n_repeated_tokens: int = 0  # ancestors repeated because a tree was split
    n_shared_tokens: int = 0  # context tokens not placed again: a root's prefix shared with the root before
    skipped: dict[str, str] = field(default_factory=dict)  # execution_id -> why it is not trained


def group_advantages(rewards: dict[str, tuple[str, float]], estimator: str, eps: float) -> dict[str, float]:
    """Group-relative advantages from {execution_id: (group_id, reward)}."""
    groups: dict[str, list[str]] = defaultdict(list)
    for execution_id, (group, _) in rewards.items():
        groups[group].append(execution_id)
    advantages = {}
    for members in groups.values():
        values = np.array([rewards[m][1] for m in members], dtype=np.float64)
        mean = values.mean()
        for member, value in zip(members, values, strict=True):
            if estimator in ("grpo", "positive"):
                advantage = float((value - mean) / (values.std() + eps))
                advantages[member] = max(advantage, 0.0) if estimator == "positive" else advantage
            elif estimator == "mean":
                advantages[member] = float(value - mean)
            elif estimator == "rloo":
                n = len(values)
                advantages[member] = float(value - (values.sum() - value) / (n - 1)) if n > 1 else 0.0
            else:
                raise ValueError(
                    f"unknown advantage estimator {estimator!r}; expected grpo, positive, mean or rloo"
                )
    return advantages


@dataclass
class _Tree:
    execution_id: str
    node_ids: np.ndarray
    parents: np.ndarray  # index into the tree's nodes, -1 at a root
    depths: np.ndarray
    starts: np.ndarray  # offsets into tokens
    lengths: np.ndarray
    policy: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray  # aligned with tokens; 0 on context
    versions: np.ndarray  # per node: the policy version of the call that generated it, -1 on context
    n_targets: int

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def preorder(self) -> list[int]:
        children: dict[int, list[int]] = defaultdict(list)
        for i, parent in enumerate(self.parents.tolist()):
            children[parent].append(i)
        order, stack = [], sorted(children[-1], key=lambda i: self.node_ids[i], reverse=True)
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(sorted(children[node], key=lambda i: self.node_ids[i], reverse=True))
        return order


class _SequenceBuilder:
    def __init__(self) -> None:
        self.pieces: dict[str, list[np.ndarray]] = defaultdict(list)
        self.length = 0
        self.executions: list[str] = []
        self.leaves: list[tuple[str, int, int]] = []
        self.placed: dict[tuple[str, int], int] = {}  # (execution, node index) -> index of its last token
        # the last root placed: its tokens and where each sits. Everything placed since is in its
        # subtree (preorder), so a new root may branch off any of its tokens and stay in preorder
        self.last_root: tuple[np.ndarray, np.ndarray] | None = None

    def add_root(self, tree: _Tree, node: int, share: bool) -> tuple[int, int]:
        """Places a root node; a context root shares its longest common prefix with the last root.
        Returns (index of its last token, tokens shared)."""
        start, n = int(tree.starts[node]), int(tree.lengths[node])
        tokens = tree.tokens[start : start + n]
        shared, parent_at = 0, -1
        if share and self.last_root is not None and not tree.policy[node]:
            last_tokens, last_at = self.last_root
            m = min(n, len(last_tokens))
            differs = np.flatnonzero(last_tokens[:m] != tokens[:m])
            shared = int(differs[0]) if len(differs) else m
            if shared:
                parent_at = int(last_at[shared - 1])
        first = self.length
        end = self.add_node(tree, node, parent_at, targets=True, weight=0.0, advantage=0.0, skip=shared)
        if tree.policy[node]:
            self.last_root = None  # never shared: a policy token is a target of its own execution
        else:
            here = np.arange(first, first + n - shared, dtype=np.int64)
            earlier = self.last_root[1][:shared] if shared else np.zeros(0, np.int64)
            self.last_root = (tokens, np.concatenate([earlier, here]))
        return end, shared

    def execution_slot(self, execution_id: str) -> int:
        if not self.executions or self.executions[-1] != execution_id:
            self.executions.append(execution_id)
        return len(self.executions) - 1

    def add_node(
        self,
        tree: _Tree,
        node: int,
        parent_at: int,
        targets: bool,
        weight: float,
        advantage: float,
        skip: int = 0,
    ) -> int:
        """Places the node's tokens after its first ``skip`` (already in the sequence, ending at
        ``parent_at``); returns the index of its last token."""
        n = int(tree.lengths[node]) - skip
        start = int(tree.starts[node]) + skip
        if n == 0:
            self.placed[(tree.execution_id, node)] = parent_at
            return parent_at
        first = self.length
        policy = bool(tree.policy[node]) and targets
        self.pieces["token_ids"].append(tree.tokens[start : start + n])
        depth = int(tree.depths[node]) + skip
        self.pieces["position_ids"].append(np.arange(depth, depth + n, dtype=np.int32))
        parents = np.arange(first - 1, first + n - 1, dtype=np.int32)
        parents[0] = parent_at
        self.pieces["parent_index"].append(parents)
        self.pieces["loss_mask"].append(np.full(n, policy))
        self.pieces["weights"].append(np.full(n, weight if policy else 0.0, dtype=np.float32))
        logprobs = tree.logprobs[start : start + n] if policy else np.zeros(n, dtype=np.float32)
        self.pieces["behaviour_logprobs"].append(logprobs)
        self.pieces["advantages"].append(np.full(n, advantage if policy else 0.0, dtype=np.float32))
        self.pieces["policy_versions"].append(
            np.full(n, tree.versions[node] if policy else -1, dtype=np.int32)
        )
        self.pieces["execution_index"].append(
            np.full(n, self.execution_slot(tree.execution_id), dtype=np.int32)
        )
        self.length += n
        self.placed[(tree.execution_id, node)] = self.length - 1
        return self.length - 1

    def build(self) -> PackedSequence:
        def cat(name: str, dtype: Any) -> np.ndarray:
            parts = self.pieces[name]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        return PackedSequence(
            token_ids=cat("token_ids", np.int32),
            position_ids=cat("position_ids", np.int32),
            parent_index=cat("parent_index", np.int32),
            loss_mask=cat("loss_mask", bool),
            weights=cat("weights", np.float32),
            behaviour_logprobs=cat("behaviour_logprobs", np.float32),
            advantages=cat("advantages", np.float32),
            policy_versions=cat("policy_versions", np.int32),
            execution_index=cat("execution_index", np.int32),
            executions=list(self.executions),
            leaves=list(self.leaves),
        )


def _trees(nodes: pa.Table) -> list[_Tree]:
    """Splits training_nodes rows (sorted by execution_id, depth) into one _Tree per execution."""
    if nodes.num_rows == 0:
        return []
    execution_ids = nodes.column("execution_id").to_numpy(zero_copy_only=False)
    node_ids = nodes.column("node_id").to_numpy()
    parent_ids = nodes.column("parent_node_id").to_numpy(zero_copy_only=False)
    depths = nodes.column("depth").to_numpy()
    policy = nodes.column("is_policy").to_numpy(zero_copy_only=False)
    token_lists = nodes.column("token_ids").combine_chunks()
    tokens = token_lists.flatten().to_numpy()
    offsets = token_lists.offsets.to_numpy()
    lengths = np.diff(offsets)
    logprob_lists = nodes.column("behaviour_logprobs").to_pylist()
    versions = nodes.column("policy_version").fill_null(-1).to_numpy()
    trees = []
    bounds = np.flatnonzero(execution_ids[1:] != execution_ids[:-1]) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(execution_ids)], strict=True):
        ids = node_ids[lo:hi]
        position = {int(n): i for i, n in enumerate(ids)}
        parents = np.array(
            [-1 if p is None or np.isnan(p) else position[int(p)] for p in parent_ids[lo:hi]], dtype=np.int64
        )
        starts = offsets[lo:hi] - offsets[lo]
        tree_tokens = tokens[offsets[lo] : offsets[hi]]
        logprobs = np.zeros(len(tree_tokens), dtype=np.float32)
        for i in range(hi - lo):
            if policy[lo + i]:
                logprobs[starts[i] : starts[i] + lengths[lo + i]] = logprob_lists[lo + i]
        trees.append(
            _Tree(
                execution_id=str(execution_ids[lo]),
                node_ids=ids,
                parents=parents,
                depths=depths[lo:hi],
                starts=starts,
                lengths=lengths[lo:hi],
                policy=policy[lo:hi].astype(bool),
                tokens=tree_tokens,
                logprobs=logprobs,
                versions=versions[lo:hi],
                n_targets=int(lengths[lo:hi][policy[lo:hi].astype(bool)].sum()),
            )
        )
    return trees


def pack(
    con: duckdb.DuckDBPyConnection,
    packing: PackingConfig | None = None,
    *,
    step: int | None = None,
    exclude: dict[str, str] | None = None,
) -> PackedBatch:
    """Packs the training trees of one step (or of all steps) into sequences of <= token_budget.

    ``exclude`` (execution id -> reason) leaves executions out (they join ``skipped`` with the reason);
    advantages are computed over the executions that stay."""
    packing = packing or PackingConfig()
    step_filter = "" if step is None else f"WHERE e.step = {int(step)}"
    executions = con.sql(
        f"SELECT execution_id, coalesce(group_id, problem_id, execution_id) AS grp, reward, status "
        f"FROM executions e {step_filter} ORDER BY execution_id"
    ).fetchall()
    trainable = {
        row[0] for row in con.sql("SELECT DISTINCT execution_id FROM selected_trajectories").fetchall()
    }
    skipped: dict[str, str] = {}
    rewards: dict[str, tuple[str, float]] = {}
    for execution_id, group, reward, status in executions:
        if exclude and execution_id in exclude:
            skipped[execution_id] = exclude[execution_id]
        elif execution_id not in trainable:
            skipped[execution_id] = f"status {status}: nothing selected"
        elif reward is None:
            skipped[execution_id] = "no reward"
        else:
            rewards[execution_id] = (group, float(reward))
    advantages = group_advantages(rewards, packing.advantage, packing.advantage_eps)
    con.register("packing_executions", pa.table({"execution_id": pa.array(sorted(rewards), pa.string())}))
    nodes = con.sql(
        "SELECT n.execution_id, n.node_id, n.parent_node_id, n.depth, n.token_ids, n.is_policy, "
        "n.behaviour_logprobs, n.policy_version "
        "FROM training_nodes n JOIN packing_executions USING (execution_id) ORDER BY n.execution_id, n.depth, n.node_id"
    ).arrow()
    if isinstance(nodes, pa.RecordBatchReader):  # DuckDB 2 streams Arrow results
        nodes = nodes.read_all()
    con.unregister("packing_executions")
    leaves = con.sql(
        "SELECT execution_id, trajectory_id, leaf_node_id FROM selected_trajectories ORDER BY execution_id, rank"
    ).fetchall()
    leaves_by_execution: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for execution_id, trajectory_id, leaf in leaves:
        leaves_by_execution[execution_id].append((trajectory_id, leaf))
    return _pack_trees(
        _trees(nodes), advantages, leaves_by_execution, packing.token_budget, skipped, packing.share_prefixes
    )


def _pack_trees(
    trees: list[_Tree],
    advantages: dict[str, float],
    leaves: dict[str, list[tuple[int, int]]],
    budget: int,
    skipped: dict[str, str],
    share: bool = False,
) -> PackedBatch:
    batch = PackedBatch(sequences=[], advantages=advantages, skipped=skipped)
    current = _SequenceBuilder()

    def close() -> None:
        nonlocal current
        if current.length:
            batch.sequences.append(current.build())
        current = _SequenceBuilder()

    for tree in trees:
        longest = int((tree.depths + tree.lengths).max())
        if longest > budget:
            raise ValueError(
                f"execution {tree.execution_id!r}: a selected trajectory has {longest} tokens, more than the "
                f"token budget {budget}; a packed sequence must hold a whole path (raise token_budget)"
            )
        weight = 1.0 / tree.n_targets if tree.n_targets else 0.0
        advantage = advantages[tree.execution_id]
        if current.length + tree.n_tokens > budget:
            close()  # start the tree in a fresh sequence; split it only if it is larger than a sequence
        leaf_of = {int(node_id): i for i, node_id in enumerate(tree.node_ids)}
        wanted = {leaf_of[leaf]: trajectory for trajectory, leaf in leaves.get(tree.execution_id, [])}
        for node in tree.preorder():
            parent = int(tree.parents[node])
            key = (tree.execution_id, parent)
            if parent >= 0 and key not in current.placed:
                raise AssertionError("preorder placed a child before its parent")
            if current.length + int(tree.lengths[node]) > budget:
                close()
                # repeat the ancestors this subtree needs, as context only
                chain = []
                ancestor = parent
                while ancestor >= 0:
                    chain.append(ancestor)
                    ancestor = int(tree.parents[ancestor])
                at = -1
                for ancestor in reversed(chain):
                    at = current.add_node(tree, ancestor, at, targets=False, weight=0.0, advantage=0.0)
                    batch.n_repeated_tokens += int(tree.lengths[ancestor])
            if parent < 0 and not tree.policy[node]:  # a context root: no weight or advantage to place
                end, shared = current.add_root(tree, node, share)
                batch.n_shared_tokens += shared
            else:
                parent_at = current.placed[(tree.execution_id, parent)] if parent >= 0 else -1
                end = current.add_node(
                    tree, node, parent_at, targets=True, weight=weight, advantage=advantage
                )
                if parent < 0:
                    current.last_root = None
            if node in wanted:
                current.leaves.append((tree.execution_id, wanted[node], end))
        batch.n_unique_tokens += tree.n_tokens
        batch.n_target_tokens += tree.n_targets
    close()
    batch.n_tokens = sum(len(s) for s in batch.sequences)
    return batch


def ancestor_mask(sequence: PackedSequence) -> np.ndarray:
    """[T, T] bool: entry (i, j) is True when token j is i itself or one of its ancestors."""
    n = len(sequence)
    mask = np.zeros((n, n), dtype=bool)
    parent = sequence.parent_index
    for i in range(n):
        mask[i, i] = True
        if parent[i] >= 0:
            mask[i] |= mask[parent[i]]
    return mask


def path_to(sequence: PackedSequence, index: int) -> np.ndarray:
    """Token ids from the root to ``index`` by following parent indices."""
    path = []
    while index >= 0:
        path.append(int(sequence.token_ids[index]))
        index = int(sequence.parent_index[index])
    return np.array(path[::-1], dtype=np.int32)


BATCH_COLUMNS = {
    "token_ids": pa.int32(),
    "position_ids": pa.int32(),
    "parent_index": pa.int32(),
    "loss_mask": pa.bool_(),
    "weights": pa.float32(),
    "behaviour_logprobs": pa.float32(),
    "advantages": pa.float32(),
    "policy_versions": pa.int32(),
    "execution_index": pa.int32(),
}


def batch_to_table(batch: PackedBatch, step: int) -> pa.Table:
    """One row per packed sequence (list columns), the form the trainer reads from storage."""
    columns: dict[str, Any] = {
        "step": pa.array([step] * len(batch.sequences), pa.int32()),
        "sequence_index": pa.array(range(len(batch.sequences)), pa.int32()),
    }
    for name, kind in BATCH_COLUMNS.items():
        columns[name] = pa.array([getattr(s, name) for s in batch.sequences], pa.list_(kind))
    columns["executions"] = pa.array([s.executions for s in batch.sequences], pa.list_(pa.string()))
    columns["leaves"] = pa.array(
        [
            [{"execution_id": e, "trajectory_id": t, "index": i} for e, t, i in s.leaves]
            for s in batch.sequences
        ],
        pa.list_(
            pa.struct([("execution_id", pa.string()), ("trajectory_id", pa.int32()), ("index", pa.int32())])
        ),
    )
    return pa.table(columns)


def table_to_sequences(table: pa.Table) -> list[PackedSequence]:
    sequences = []
    for row in table.to_pylist():
        arrays = {
            name: np.asarray(row[name], dtype=kind.to_pandas_dtype()) for name, kind in BATCH_COLUMNS.items()
        }
        leaves = [(leaf["execution_id"], leaf["trajectory_id"], leaf["index"]) for leaf in row["leaves"]]
        sequences.append(PackedSequence(**arrays, executions=row["executions"], leaves=leaves))
    return sequences
