"""Per-path training: the reference that tree-packed training must equal (DESIGN.md 5).

A selected trajectory is a root-to-leaf path of its packed sequence. Per-path training runs one
causal forward/backward per path over every token of it, each target counted on exactly one path;
tree-packed training (tree.py, worker.py) runs one forward over the unique tokens. The two must give
the same per-token logprobs and the same gradient within fp32 tolerance (1e-5 relative). The tests
check that with these functions, and the training benchmarks time the two against each other.

    path_indices(sequence, index)           token indices from the root to ``index``
    per_path_jobs(sequences)                every trajectory as a PathJob: (sequence, path, its targets)
    per_path_backward(model, jobs, ...)     per-path fwd+bwd; gradients accumulate in the parameters
    tree_backward(model, sequences, ...)    the same loss tree-packed (GradWorker's, without its buffer)
    near_policy_behaviour(sequences, model) behaviour logprobs near the current policy's
    compare(model, sequences, ...)          Agreement: max |logprob diff| and gradient relative diff
    flat_grad(model), clear_grads(model)    the parameters' gradients as one vector; dropped
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engines.train.config import LossConfig
from engines.train.loss import policy_loss
from engines.train.tree import Kernel, path_logprobs, target_logprobs
from engines.train.worker import GradWorker, at_targets, sequence_loss
from trajectory_store.processor import PackedSequence


class PathJob(NamedTuple):
    """One trajectory of a packed sequence and the targets it is trained on."""

    sequence: PackedSequence
    path: np.ndarray  # token indices from the root to the leaf, ascending
    targets: np.ndarray  # the path's target indices not taken by an earlier job


def path_indices(sequence: PackedSequence, index: int) -> np.ndarray:
    """Token indices of ``sequence`` from the root down to ``index``, following parent indices."""
    path = []
    while index >= 0:
        path.append(index)
        index = int(sequence.parent_index[index])
    return np.array(path[::-1])


def per_path_jobs(sequences: list[PackedSequence]) -> list[PathJob]:
    """Every selected trajectory's path, each target on the first path holding it. A split tree can
    leave targets whose leaves went to the next sequence: they get the path to the deepest of them."""
    jobs = []
    for sequence in sequences:
        taken = np.zeros(len(sequence), dtype=bool)
        ends = [leaf for _, _, leaf in sequence.leaves]
        while True:
            for end in ends:
                path = path_indices(sequence, end)
                mine = path[sequence.loss_mask[path] & ~taken[path]]
                taken[mine] = True
                jobs.append(PathJob(sequence, path, mine))
            left = np.flatnonzero(sequence.loss_mask & ~taken)
            if not left.size:
                break
            ends = [int(left[np.argmax(sequence.position_ids[left])])]
    return jobs


def logprobs_at_targets(model: torch.nn.Module, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """log p(tokens[k] | tokens[:k]) for k in positions, the output projection at those k - 1 only."""
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(tokens, dtype=torch.long, device=device)[None]
    at = torch.as_tensor(positions, device=device)
    hidden = model.base_model(input_ids=input_ids).last_hidden_state[0, at - 1]  # [n, H]
    log_probs = torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1)
    return log_probs.gather(1, input_ids[0, at, None])[:, 0]


def per_path_backward(
    model: torch.nn.Module,
    jobs: list[PathJob],
    n_executions: int,
    config: LossConfig,
    *,
    lean: bool = False,
) -> None:
    """Per-path training: one causal forward/backward per trajectory over its whole path; gradients
    accumulate in the parameters. The logits of every path position, as an HF forward gives them, or
    (``lean``) of the targets only."""
    device = next(model.parameters()).device
    for sequence, path, targets in jobs:
        positions = np.searchsorted(path, targets)  # where each target sits on the path (path is sorted)
        if lean:
            logprobs = logprobs_at_targets(model, sequence.token_ids[path], positions)
        else:
            logprobs = path_logprobs(model, sequence.token_ids[path])[
                torch.as_tensor(positions - 1, device=device)
            ]
        terms = policy_loss(
            logprobs,
            at_targets(sequence.behaviour_logprobs, targets, device),
            at_targets(sequence.advantages, targets, device),
            at_targets(sequence.weights, targets, device),
            n_executions,
            config,
        )
        terms.loss.backward()


def tree_backward(
    model: torch.nn.Module,
    sequences: list[PackedSequence],
    n_executions: int,
    config: LossConfig,
    *,
    kernel: Kernel = "blocks",
) -> None:
    """Tree-packed fwd+bwd of every sequence (GradWorker's loss); gradients accumulate in the parameters."""
    for sequence in sequences:
        terms, _ = sequence_loss(model, sequence, n_executions, config, kernel=kernel)
        terms.loss.backward()


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every trainable parameter's gradient (zeros where it has none) as one float32 vector."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
    )


def clear_grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = None


def near_policy_behaviour(
    sequences: list[PackedSequence], model: torch.nn.Module, scale: float = 0.05, seed: int = 0
) -> None:
    """Sets behaviour logprobs near the model's own (as after a real rollout), so ratios are near 1."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for sequence in sequences:
            out = target_logprobs(model, sequence)
            noise = rng.normal(0, scale, out.logprobs.numel()).astype(np.float32)
            behaviour = np.zeros(len(sequence), dtype=np.float32)
            behaviour[out.targets.cpu().numpy()] = np.minimum(out.logprobs.float().cpu().numpy() + noise, 0)
            sequence.behaviour_logprobs = behaviour


@dataclass
class Agreement:
    """Tree-packed against per-path training on the same model and sequences."""

    max_abs_logprob_diff: float  # over every target: tree-packed vs its path's causal forward
    grad_rel_diff: float  # |GradWorker's gradient - per-path gradient| / |per-path gradient|
    reference_grad_norm: float  # |per-path gradient|
    paths: int  # per-path jobs
    targets: int  # targets compared (each once)


def compare(
    model: torch.nn.Module,
    sequences: list[PackedSequence],
    n_executions: int,
    config: LossConfig | None = None,
) -> Agreement:
    """Logprobs of every target and the step's gradient, tree-packed (GradWorker) and per path."""
    config = config or LossConfig()
    jobs = per_path_jobs(sequences)
    worst, compared = 0.0, 0
    model.eval()
    with torch.no_grad():
        trees = {id(sequence): target_logprobs(model, sequence) for sequence in sequences}
        for sequence, path, targets in jobs:  # one forward per path gives every target on it
            tree = trees[id(sequence)]
            by_index = dict(zip(tree.targets.tolist(), tree.logprobs.tolist(), strict=True))
            reference = path_logprobs(model, sequence.token_ids[path])
            for target in targets.tolist():
                position = int(np.searchsorted(path, target))
                worst = max(worst, abs(by_index[target] - reference[position - 1].item()))
                compared += 1
    worker = GradWorker(model, config)
    for index, sequence in enumerate(sequences):
        worker.accumulate(sequence, n_executions, index, 0)
    clear_grads(model)
    model.train()
    per_path_backward(model, jobs, n_executions, config)
    reference_grad = flat_grad(model).cpu()
    clear_grads(model)
    norm = float(reference_grad.norm())
    return Agreement(
        max_abs_logprob_diff=worst,
        grad_rel_diff=float((worker.grad - reference_grad).norm() / reference_grad.norm()),
        reference_grad_norm=norm,
        paths=len(jobs),
        targets=compared,
    )
