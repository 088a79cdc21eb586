"""The prefix index of one execution: finds, for a new call, the earlier call to delta-encode against.

Every call's sequence (prompt + output) is stored as ``sequence(parent)[:prefix_len] + new_ids``.
The index is a radix tree whose edges are the calls' own segments: call ``c`` owns the tokens at
depths ``[prefix_len(c), prefix_len(c) + len(new_ids(c)))``. The parent of a new call is the owner of
the deepest token its sequence shares with anything recorded before, so every stored token is a
new trie node and nothing is stored twice.

Insertion walks one root-to-leaf path, comparing whole segments with numpy: the cost is the new
sequence's length (which hashing the prompt pays anyway), never a scan of earlier calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ROOT = -1


@dataclass(frozen=True)
class Attachment:
    parent_call_id: int | None  # None: the call starts a new root
    prefix_len: int  # tokens shared with the parent's sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._segments: dict[int, np.ndarray] = {}
        self._starts: dict[int, int] = {}
        # (owner call, depth where the child's first token sits, that token) -> child call
        self._children: dict[tuple[int, int, int], int] = {}
        self.n_tokens = 0  # unique tokens stored so far

    def __contains__(self, call_id: int) -> bool:
        return call_id in self._segments

    def find(self, sequence: np.ndarray) -> Attachment:
        """The longest-prefix attachment of ``sequence`` (int32 array) to the recorded calls."""
        owner, depth = _ROOT, 0
        n = len(sequence)
        while depth < n:
            child = self._children.get((owner, depth, int(sequence[depth])))
            if child is None:
                break
            owner = child
            segment = self._segments[child]
            start = self._starts[child]
            # segment[depth - start] == sequence[depth] by construction; compare the rest at once
            offset = depth - start
            span = min(len(segment) - offset, n - depth)
            diff = np.flatnonzero(segment[offset : offset + span] != sequence[depth : depth + span])
            matched = int(diff[0]) if diff.size else span
            depth += matched
            # Stopped at the end of the segment or where it diverges: only a child attached at
            # exactly this depth can continue (children attached earlier diverge from the owner
            # where the sequence agrees with it), and the next lookup finds it.
        return Attachment(None if owner == _ROOT else owner, depth)

    def insert(self, call_id: int, sequence: np.ndarray) -> tuple[Attachment, np.ndarray]:
        """Records a call; returns where it attaches and the new token ids it adds."""
        if call_id in self._segments:
            raise KeyError(f"call {call_id} is already in the index")
        attachment = self.find(sequence)
        new_ids = sequence[attachment.prefix_len :]
        self._segments[call_id] = new_ids
        self._starts[call_id] = attachment.prefix_len
        if len(new_ids):
            owner = _ROOT if attachment.parent_call_id is None else attachment.parent_call_id
            self._children[(owner, attachment.prefix_len, int(new_ids[0]))] = call_id
        self.n_tokens += len(new_ids)
        return attachment, new_ids
