"""Picking next tokens for a batch of rows, each with its own SamplingParams and torch.Generator.

Each sampled row draws exactly one uniform number from its own CPU generator and inverts the CDF of
its filtered distribution; greedy rows draw nothing. So a request's samples depend only on its seed
and its logits, never on which other requests share the batch, and a generator's state (a CPU byte
tensor) moves between engines and devices unchanged (KV migration carries it).

The logprob returned with each token is log_softmax of the raw logits (the policy's own logprob,
before temperature / top-k / top-p), as vLLM v1's default logprobs_mode='raw_logprobs'.
"""

from __future__ import annotations

import hashlib

import torch

from engines.rollout.messages import SamplingParams


def request_generator(params: SamplingParams, engine_seed: int, request_id: str) -> torch.Generator:
    """The request's own generator: its seed, or one derived from (engine seed, request id)."""
    seed = params.seed
    if seed is None:
        digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed % (1 << 64))
    return generator


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[list[int], list[float]]:
    """Next token and its raw logprob for every row."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    tokens = torch.argmax(logits, dim=-1)  # [rows]; greedy rows keep this
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        tokens[index] = _sample(logits[index], [params[i] for i in sampled], [generators[i] for i in sampled])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    scaled, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True)  # [rows, vocab]
    rank = torch.arange(vocab, device=device)[None, :]
    scaled = scaled.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = (mass_before < top_p[:, None]) & (rank < top_k[:, None])
    keep[:, 0] = True
    probs = probs * keep
    cdf = torch.cumsum(probs, dim=-1)  # [rows, vocab]
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)  # [rows]
    target = uniform * cdf[:, -1]
    pick = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    pick = torch.minimum(pick, keep.sum(dim=-1) - 1)  # u * total rounding up to total
    return order.gather(1, pick[:, None])[:, 0]
