"""KV storage: preallocated per-layer buffers holding some rows (sessions), handed to the HF model as
its ``cache``, plus the 4D additive attention masks that go with them.

    KVRows.allocate(rows, capacity, like)   empty buffers [rows, kv_heads, capacity, head_dim] per layer
    KVRows.gather(sources, capacity)        a new batch from rows of other KVRows (the rebuild on a
                                            batch-composition change: one copy per row and layer)
    kv.reserve(n)                           grow capacity (by an eighth at least) so every row can hold n tokens
    model(..., cache=kv)                    the model's attention layers call kv.update(k, v, layer):
                                            row r's new keys land at columns lengths[r]..lengths[r]+q-1
    kv.advance(q)                           after the forward: every row holds q more tokens

Rows are right-padded: row r is valid on columns [0, lengths[r]). A decode step writes each row at its
own column and masks every column past it, so rows of different lengths decode in one forward with
per-row position ids. The masks are float (0 / dtype min), which both the eager and the sdpa attention
paths apply correctly; a boolean mask would be silently wrong on the eager path (DESIGN.md section 5).
Only full-attention layers are supported (no sliding windows, no linear attention): the engine checks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _RowsLayer(CacheLayerMixin):
    """Answers the few questions HF's generic code asks a cache layer; the data live in KVRows."""

    is_sliding = False

    def __init__(self, owner: KVRows):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):  # never called: KVRows.update owns writes
        raise NotImplementedError

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.span

    def get_max_length(self) -> int:
        return -1


class KVRows(Cache):
    """Per-layer key and value buffers [rows, kv_heads, capacity, head_dim] and per-row valid lengths."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int]):
        self.keys, self.values = keys, values
        self.lengths = list(lengths)
        super().__init__(layers=[_RowsLayer(self) for _ in keys])

    # construction -----------------------------------------------------------------------------------
    @classmethod
    def allocate(cls, rows: int, capacity: int, like: KVShape) -> KVRows:
        shape = (rows, like.kv_heads, capacity, like.head_dim)
        keys = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(like.layers)]
        values = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(like.layers)]
        return cls(keys, values, [0] * rows)

    @classmethod
    def from_tensors(
        cls, layers: list[tuple[torch.Tensor, torch.Tensor]], like: KVShape, slack: int = 0
    ) -> KVRows:
        """One row from per-layer (keys, values) [kv_heads, n, head_dim]."""
        n = layers[0][0].shape[1]
        kv = cls.allocate(1, n + slack, like)
        for layer, (k, v) in enumerate(layers):
            kv.keys[layer][0, :, :n].copy_(k)
            kv.values[layer][0, :, :n].copy_(v)
        kv.lengths[0] = n
        return kv

    @classmethod
    def gather(cls, sources: list[tuple[KVRows, int]], capacity: int, like: KVShape) -> KVRows:
        kv = cls.allocate(len(sources), capacity, like)
        for row, (src, i) in enumerate(sources):
            n = src.lengths[i]
            for layer in range(like.layers):
                kv.keys[layer][row, :, :n].copy_(src.keys[layer][i, :, :n])
                kv.values[layer][row, :, :n].copy_(src.values[layer][i, :, :n])
            kv.lengths[row] = n
        return kv

    # inspection -------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def span(self) -> int:
        """Columns a forward attends over before its new tokens: the longest row."""
        return max(self.lengths) if self.lengths else 0

    def row_tensors(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of row i's valid keys and values, per layer: [kv_heads, lengths[i], head_dim]."""
        n = self.lengths[i]
        return [(k[i, :, :n], v[i, :, :n]) for k, v in zip(self.keys, self.values, strict=True)]

    def extract(self, i: int, like: KVShape) -> KVRows:
        """Row i as its own one-row KVRows (a copy with capacity = its length)."""
        return KVRows.gather([(self, i)], self.lengths[i], like)

    # mutation ---------------------------------------------------------------------------------------
    def truncate(self, i: int, n: int) -> None:
        """Row i keeps its first n tokens (the columns past n are overwritten later)."""
        self.lengths[i] = min(self.lengths[i], n)

    def reserve(self, n: int) -> None:
        """Ensure capacity >= n, growing by an eighth at least (amortised O(1) copies per token, at most
        1/8 of the KV unused: doubling would hold up to twice a 128K-token context's KV)."""
        if n <= self.capacity:
            return
        capacity = max(n, self.capacity + max(self.capacity // 8, 64))
        for layer in range(len(self.keys)):
            for store in (self.keys, self.values):
                old = store[layer]
                grown = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                grown[:, :, : old.shape[2]].copy_(old)
                store[layer] = grown

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by each attention layer with its new keys/values [rows, kv_heads, q, head_dim]."""
        q = key_states.shape[2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if q == 1 and self.rows > 1:
            rows = torch.arange(self.rows, device=keys.device)
            cols = torch.tensor(self.lengths, device=keys.device)
            keys[rows, :, cols] = key_states[:, :, 0]
            values[rows, :, cols] = value_states[:, :, 0]
        else:
            for r, start in enumerate(self.lengths):
                keys[r, :, start : start + q] = key_states[r]
                values[r, :, start : start + q] = value_states[r]
        end = self.span + q
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, q: int) -> None:
        self.lengths = [n + q for n in self.lengths]


class KVShape:
    """Layer count, KV heads, head dim, dtype and device of a model's cache."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def signature(self) -> dict:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def prefill_mask(start: int, q: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One row: query i (at position start + i) sees columns 0..start + i.  # [1, 1, q, start + q]"""
    cols = torch.arange(start + q, device=device)
    allowed = cols[None, :] <= (start + torch.arange(q, device=device))[:, None]
    return _additive(allowed, dtype)[None, None]


def decode_mask(lengths: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row r's new token sits at column lengths[r] and sees columns 0..lengths[r].  # [rows, 1, 1, span + 1]"""
    lens = torch.tensor(lengths, device=device)
    cols = torch.arange(int(max(lengths)) + 1, device=device)
    allowed = cols[None, :] <= lens[:, None]
    return _additive(allowed, dtype)[:, None, None, :]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


class DecodeBatch:
    """The running requests' KV as one padded KVRows, in running order. Rebuilt (one copy per row and
    layer) only when the list of request ids changes; unchanged, each decode step writes in place."""

    def __init__(self, shape: KVShape, headroom: int = 64):
        self.shape, self.headroom = shape, headroom
        self.kv: KVRows | None = None
        self.ids: list[str] = []
        self.rebuilds = 0

    def sync(self, ids: list[str], joining: dict[str, KVRows]) -> KVRows:
        """The batch for ``ids``: rows kept from the current batch, plus the one-row caches of the
        requests in ``joining``; ``headroom`` columns past the longest row are allocated up front.
        A batch of one joining request is its own cache, not a copy (a long context alone: no second KV)."""
        if ids != self.ids and len(ids) == 1 and ids[0] in joining:
            self.kv, self.ids = joining[ids[0]], list(ids)
            self.kv.reserve(self.kv.lengths[0] + self.headroom)
            self.rebuilds += 1
        elif ids != self.ids:
            old = {request_id: row for row, request_id in enumerate(self.ids)}
            sources = [(joining[i], 0) if i in joining else (self.kv, old[i]) for i in ids]
            longest = max(src.lengths[row] for src, row in sources)
            self.kv = KVRows.gather(sources, longest + self.headroom, self.shape)
            self.ids = list(ids)
            self.rebuilds += 1
        return self.kv

    def take(self, request_id: str) -> KVRows | None:
        """The request's row (the request leaves; the batch is rebuilt at the next sync): the batch itself
        when it is that one row, else a copy."""
        if request_id not in self.ids:
            return None
        if len(self.ids) == 1:
            kv, self.kv, self.ids = self.kv, None, []
            return kv
        return self.kv.extract(self.ids.index(request_id), self.shape)

    def clear(self) -> None:
        self.kv, self.ids = None, []
