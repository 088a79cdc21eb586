"""A tiny random policy and a packed batch of random branched executions, for the training tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import Qwen2ForCausalLM

from engines.model.weights import load_model
from engines.train.config import TrainerConfig
from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from tests.test_rollout_fixtures import tiny_qwen2
from tests.trees import random_execution
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.processor import PackedBatch, batch_to_table, pack
from trajectory_store.recorder import Recorder
from trajectory_store.storage import Store, StoreConfig

VOCAB = 64


def tiny_model(
    seed: int = 0, attn: str = "sdpa", *, vocab: int = VOCAB, max_positions: int = 512
) -> Qwen2ForCausalLM:
    """tests/test_rollout_fixtures.tiny_qwen2, seeded: the training tests' policy."""
    torch.manual_seed(seed)
    return tiny_qwen2(vocab, max_positions, attn)


def packed_batch(
    root: str, seed: int, n_executions: int = 3, budget: int = 64, j_max: int = 5
) -> PackedBatch:
    """Random branched executions (vocab 6: plenty of shared prefixes), recorded, selected, packed."""
    store = Store(StoreConfig(data_root=root, campaign="train"))
    recorder = Recorder(store, step=0)
    rng = np.random.default_rng(seed)
    for k in range(n_executions):
        execution_id = f"e{k}"
        for call in random_execution(int(rng.integers(1 << 30)), int(rng.integers(4, 10)), 6, execution_id):
            call["role"] = "main"
            recorder.record_call_dict(call)
        recorder.record_execution(execution_id, "completed", reward=float(rng.random()), group_id="g")
    recorder.close()
    con = connect(store, SelectionConfig(j_max=j_max))
    longest = con.execute("SELECT max(n_tokens) FROM selected_trajectories").fetchall()[0][0]
    return pack(con, PackingConfig(token_budget=max(budget, int(longest)), advantage="grpo"))


def policy_and_batch(root, model_seed: int, batch_seed: int, n_executions: int, budget: int):
    """A tiny policy saved under root/policy and a perturbed packed batch written to
    root/batch.parquet: (model_dir, batch, batch_uri), what the trainer tests start from."""
    model_dir = str(root / "policy")
    tiny_model(model_seed).save_pretrained(model_dir, safe_serialization=True)
    batch = packed_batch(str(root / "data"), seed=batch_seed, n_executions=n_executions, budget=budget)
    perturb_behaviour(batch, batch_seed)
    batch_uri = str(root / "batch.parquet")
    pq.write_table(batch_to_table(batch, 0), batch_uri)
    return model_dir, batch, batch_uri


def perturb_behaviour(batch: PackedBatch, seed: int) -> None:
    """Behaviour logprobs near (not at) the current policy's, so some ratios clip."""
    rng = np.random.default_rng(seed)
    for sequence in batch.sequences:
        noise = rng.normal(0, 0.3, len(sequence)).astype(np.float32)
        sequence.behaviour_logprobs = np.where(sequence.loss_mask, -np.log(VOCAB) + noise, 0).astype(
            np.float32
        )


def chunks_by_execution(batch: PackedBatch, executions_per_chunk: int = 2) -> list[tuple[list, int]]:
    """The batch's sequences in arrival order, cut into chunks of whole executions, as a streaming
    producer appends them: [(sequences, executions in them)]; the counts sum to the batch's."""
    chunks: list[tuple[list, int]] = []
    seen: list[str] = []
    for sequence in batch.sequences:
        new = [e for e in dict.fromkeys(sequence.executions) if e not in seen]
        if new and (not chunks or chunks[-1][1] >= executions_per_chunk):
            chunks.append(([], 0))
        sequences, count = chunks[-1]
        chunks[-1] = ([*sequences, sequence], count + len(new))
        seen += new
    missing = len(batch.advantages) - len(seen)  # executions without a sequence still count
    chunks[0] = (chunks[0][0], chunks[0][1] + missing)
    return chunks


TRAINER = TrainerConfig(lr=1e-3, zero_stage=1, eps=1e-6)
"""The elastic tests' optimizer settings."""


def load_float32(model_dir: str) -> torch.nn.Module:
    return load_model(model_dir, dtype=torch.float32)


def chunk_files(batch: PackedBatch, folder: str) -> list[tuple[str, int, int]]:
    """The batch's sequences as a streaming producer appends them, one execution a chunk, each written
    to ``folder``: [(chunk URI, sequences, executions)]."""
    from engines.train.stream import write_chunk

    return [
        (write_chunk(seqs, f"{folder}/c{k}.parquet"), len(seqs), n)
        for k, (seqs, n) in enumerate(chunks_by_execution(batch, 1))
    ]


def reference_step(
    model_dir: str, batch: PackedBatch, batch_uri: str, weights_dir: str, config: TrainerConfig | None = None
) -> dict[str, Any]:
    """What the elastic tests compare with, as their setup's entries: the trainer config (``config``,
    else TRAINER), the initial weights, and the non-streaming step over the whole batch on the core
    alone (its weights, gradient and report after the step), with the folders it used."""
    config = config or TRAINER
    initial = {k: v.detach().clone() for k, v in load_float32(model_dir).state_dict().items()}
    core = CoreTrainer(load_float32(model_dir), config)
    coordinator = ElasticCoordinator(core)
    n_executions = len(batch.advantages)
    report = coordinator.run_step(
        0, batch.sequences, n_executions, batch_uri=batch_uri, weights_dir=weights_dir
    )
    coordinator.close()
    return {
        "model_dir": model_dir,
        "batch": batch,
        "weights_dir": weights_dir,
        "config": config,
        "initial": initial,
        "reference": core.weights(),
        "reference_grad": core.last_grad.clone(),
        "reference_report": report,
    }


def update_rel_diff(weights: dict[str, torch.Tensor], setup: dict[str, Any]) -> float:
    """|| update - reference update || / || reference update || over all parameters (``setup``: what
    reference_step returned)."""
    num = den = 0.0
    for name, ref in setup["reference"].items():
        update = weights[name] - setup["initial"][name]
        ref_update = ref - setup["initial"][name]
        num += float((update - ref_update).double().pow(2).sum())
        den += float(ref_update.double().pow(2).sum())
    return (num / den) ** 0.5


def streamed_case(root, seed: int, config: TrainerConfig | None = None) -> tuple[list, dict[str, Any]]:
    """A policy (tiny_model(5)) and a batch of 8 executions (``seed``) under ``root``, the batch as
    one-execution chunks (chunk_files) and the reference step over the whole batch on the core alone
    (reference_step, with ``config``): (chunks, setup)."""
    import os

    from engines.train.stream import write_chunk

    model_dir = str(root / "model")
    tiny_model(5).save_pretrained(model_dir, safe_serialization=True)
    batch = packed_batch(str(root / "batch"), seed=seed, n_executions=8, budget=16)
    perturb_behaviour(batch, seed)
    weights_dir = str(root / "fast")
    os.makedirs(weights_dir)
    uri = write_chunk(batch.sequences, str(root / "batch.parquet"))
    return chunk_files(batch, str(root / "chunks")), reference_step(
        model_dir, batch, uri, weights_dir, config
    )


class CoreStreaming:
    """The core's streaming step 0 on ``setup`` (streamed_case), trained on a thread (paced, so a
    satellite has micro-batches left to take), with a producer: ``append(chunks)``, then ``finish()``
    gives the step's report."""

    def __init__(self, setup: dict[str, Any]):
        import threading

        from engines.train.stream import StreamProducer

        self.core = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
        self.coordinator = ElasticCoordinator(self.core)
        self.step = self.coordinator.open_step(0, weights_dir=setup["weights_dir"])
        self.reports: list = []
        self.thread = threading.Thread(
            target=lambda: self.reports.append(self.step.train(pace_s=0.05)), daemon=True
        )
        self.thread.start()
        self.producer = StreamProducer(*self.step.address)
        self.appended = 0

    def append(self, chunks: list[tuple[str, int, int]]) -> None:
        for chunk_uri, count, n in chunks:
            self.producer.append(chunk_uri, count, n, key=f"c{self.appended}")
            self.appended += 1

    def finish(self):
        self.producer.close()
        self.thread.join(120)
        assert self.reports, "the core's step did not end"
        self.coordinator.close()
        return self.reports[0]
