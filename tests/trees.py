"""Random branched executions and a plain Python trie: the reference the store is checked against."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trajectory_store.schema import ROLES


def random_execution(seed: int, n_calls: int, vocab: int, execution_id: str = "e0") -> list[dict]:
    """Calls whose prompts continue, branch from, or restart earlier sequences, with retries that
    regenerate an earlier output's opening. A small vocab also makes accidental shared prefixes."""
    rng = np.random.default_rng(seed)
    sequences: list[np.ndarray] = []
    calls = []
    for call_id in range(n_calls):
        kind = rng.integers(0, 5) if sequences else 0
        if kind == 0:  # a fresh context (a new sub-agent, or a context rebuilt after a summary)
            prompt = rng.integers(0, vocab, rng.integers(1, 8))
        elif kind in (1, 2):  # continue an earlier call's whole sequence with a tool result
            base = sequences[rng.integers(len(sequences))]
            prompt = np.concatenate([base, rng.integers(0, vocab, rng.integers(0, 5))])
        else:  # branch from inside an earlier sequence (a retry from an earlier context)
            base = sequences[rng.integers(len(sequences))]
            cut = int(rng.integers(1, len(base) + 1))
            prompt = np.concatenate([base[:cut], rng.integers(0, vocab, rng.integers(0, 3))])
        if len(prompt) == 0:
            prompt = rng.integers(0, vocab, 1)
        output = rng.integers(0, vocab, rng.integers(0, 6))
        # a retry regenerating an opening another call already produced from the same prompt
        for other in sequences:
            if (
                rng.random() < 0.3
                and len(other) > len(prompt)
                and np.array_equal(other[: len(prompt)], prompt)
            ):
                k = int(rng.integers(1, len(other) - len(prompt) + 1))
                output = np.concatenate([other[len(prompt) : len(prompt) + k], output])
                break
        sequences.append(np.concatenate([prompt, output]))
        calls.append(
            {
                "type": "call",
                "execution_id": execution_id,
                "call_id": call_id,
                "agent_id": "main",
                "role": ROLES[int(rng.integers(len(ROLES)))],
                "prompt_ids": prompt.astype(np.int32),
                "output_ids": output.astype(np.int32),
                "output_logprobs": -rng.random(len(output)).astype(np.float32),
                "policy_version": int(rng.integers(0, 3)),
            }
        )
    return calls


@dataclass
class TrieNode:
    token: int
    depth: int
    children: dict[int, TrieNode] = field(default_factory=dict)
    policy: bool = False
    generated_by: int | None = None  # the first call whose output holds this token
    logprob: float | None = None
    ends: list[int] = field(default_factory=list)  # calls whose sequence ends here


class Trie:
    def __init__(self, calls: list[dict]):
        self.root = TrieNode(-1, -1)
        self.calls = {c["call_id"]: c for c in calls}
        for call in calls:
            node = self.root
            prompt_len = len(call["prompt_ids"])
            for i, token in enumerate(np.concatenate([call["prompt_ids"], call["output_ids"]]).tolist()):
                node = node.children.setdefault(token, TrieNode(token, i))
                if i >= prompt_len:
                    node.policy = True
                    if node.generated_by is None:
                        node.generated_by = call["call_id"]
                        node.logprob = float(call["output_logprobs"][i - prompt_len])
            node.ends.append(call["call_id"])

    def nodes(self) -> list[TrieNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def leaves(self) -> list[tuple[TrieNode, list[TrieNode]]]:
        """(leaf, path from the root) for every leaf."""
        found = []

        def walk(node: TrieNode, path: list[TrieNode]) -> None:
            if not node.children:
                found.append((node, path))
            for child in node.children.values():
                walk(child, [*path, child])

        for child in self.root.children.values():
            walk(child, [child])
        return found

    def path_of(self, call_id: int) -> list[TrieNode]:
        call = self.calls[call_id]
        node, path = self.root, []
        for token in np.concatenate([call["prompt_ids"], call["output_ids"]]).tolist():
            node = node.children[token]
            path.append(node)
        return path
