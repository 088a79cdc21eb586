"""One training step of a campaign in a process of its own: restore, train on the step's packed batch,
checkpoint, publish the new policy version.

    python -m engines.train.run < request.json     # TrainStepRequest as JSON on stdin
                                                   # -> TrainStepReport as JSON, the last stdout line
    python -m engines.train.run --serve            # a request per stdin line, a report per stdout line;
                                                   # the core stays in memory between steps

The campaign's train task starts this process for every step (tasks/train.py). Everything the step
needs is in the request and in storage, so a step whose trainer died is retried by running the
process again: it restores the previous step's checkpoint (HF weights + DeepSpeed optimizer + step,
version and RNG state) and makes the same update. A step whose batch is empty (every group's rewards
were equal, so every advantage is 0) still makes a policy version, without an optimizer step, so that
"step n trains version n into version n + 1" holds for every step.

Order of writes: checkpoint, then the published policy; the campaign marks the step committed only
after both (tasks/commit.py), so a crash in between leaves an uncommitted step that is redone.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, Field

from engines.devices import settings as devices
from engines.model.weights import load_model
from engines.train.config import CoreWorld, TrainerConfig
from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from engines.train.elastic_protocol import ElasticConfig
from engines.train.stream import write_chunk
from trajectory_store.processor import PackedSequence, table_to_sequences


class TrainStepRequest(BaseModel):
    step: int = Field(ge=0, description="the campaign step: it trains policy version `step` into `step + 1`")
    init_model: str = Field(description="HF folder of the campaign's starting policy (used at step 0)")
    resume_from: str | None = Field(None, description="checkpoint URL of the previous step (None at step 0)")
    batch_uri: str | None = Field(
        None, description="the step's packed batch (Parquet); None: nothing to train"
    )
    n_executions: int = Field(0, ge=0, description="executions in the batch (the loss averages over them)")
    checkpoint_url: str = Field(description="where this step's checkpoint is written")
    policy_root: str = Field(description="the new version is published under <policy_root>/policy/v<n>/")
    fast_dir: str = Field(description="an in-host folder for the published weights (engines read them here)")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    threads: int = Field(1, ge=1, description="torch threads")
    seed: int = Field(0, description="the campaign seed (the step's RNG derives from it and the step)")
    stream: bool = Field(
        False,
        description="open a streaming step instead of reading batch_uri: print its address as one JSON "
        'line {"stream": {host, port, step}} and train the micro-batches a producer appends until it '
        "closes the step (engines/train/stream.py); satellites may join and leave meanwhile",
    )
    address: str = Field(
        "127.0.0.1",
        description="a streaming step's address: what producers and satellites reach the core by, and the "
        "core's address in the gloo reduction (its host's address on the cluster network for satellites "
        "on other hosts)",
    )
    share_url: str | None = Field(
        None,
        description="a streaming step's folder in object storage for satellites on other hosts (the step's "
        "weights, hand-off gradient sums); None: every satellite runs on the core's host",
    )
    core: CoreWorld | None = Field(
        None,
        description="the core as a DeepSpeed world of several ranks: this process is rank 0, and each "
        "other rank runs `python -m engines.train.peer` with this same request (one process per step, "
        "like rank 0); None: a one-rank core",
    )
    prepare: bool = Field(
        False,
        description="--serve only: restore the core at `step` and train nothing; answer one JSON line "
        '{"prepared": {step, seconds, restored}}. A scheduler warms its core so before its first dispatch: the '
        "start-up (imports, model, optimizer) then never shares the core cell with its rollout",
    )


class TrainStepReport(BaseModel):
    step: int
    version: int  # the policy version the step made
    trained: bool  # False: an empty batch, no optimizer step
    metrics: dict[str, float]
    checkpoint_url: str
    policy_uri: str  # in object storage
    policy_path: str  # in-host copy, what engines hot-swap
    seconds: float
    optimizer_state_bytes: int = 0  # what the trainer (rank 0 of a core of several) holds after the step


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _save_rng(url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rng.pt"
        torch.save(_rng_state(), path)
        fs.put_file(str(path), root.rstrip("/") + "/rng.pt")


def _load_rng(url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    with fs.open(root.rstrip("/") + "/rng.pt", "rb") as handle:
        state = torch.load(handle, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def restore(request: TrainStepRequest, world: CoreWorld | None = None) -> CoreTrainer:
    """The core at the start of ``request.step``: the starting policy, or the previous checkpoint;
    ``world``: this process's rank of a core of several (``request.core`` is rank 0's)."""
    world = world or request.core
    torch.set_num_threads(request.threads)
    if request.resume_from is None:
        if request.step != 0:
            raise ValueError(
                f"step {request.step} needs the checkpoint of step {request.step - 1} (resume_from)"
            )
        random.seed(request.seed)
        np.random.seed(request.seed % 2**32)
        torch.manual_seed(request.seed)
        return CoreTrainer(load_model(request.init_model, dtype="float32"), request.trainer, world=world)
    hf = request.resume_from.rstrip("/") + "/hf"
    core = CoreTrainer(load_model(hf, dtype="float32"), request.trainer, world=world)
    core.load_checkpoint(request.resume_from)
    _load_rng(request.resume_from)
    return core


def elastic_at(address: str) -> ElasticConfig:
    """The elastic step's settings for a core listening on ``address``: the gloo reduction binds to it
    unless it is loopback (then torch's default)."""
    loopback = address.startswith("127.") or address in ("localhost", "::1")
    return ElasticConfig(address=None if loopback else address)


def mini_batches(
    sequences: list[PackedSequence], parts: int, rng: random.Random
) -> list[list[PackedSequence]]:
    """``sequences`` in at most ``parts`` non-empty mini-batches of about equal tokens: taken in a
    shuffled order, each goes to the lightest mini-batch so far."""
    order = list(range(len(sequences)))
    rng.shuffle(order)
    batches: list[list[int]] = [[] for _ in range(min(parts, len(sequences)))]
    tokens = [0] * len(batches)
    for index in order:
        lightest = min(range(len(batches)), key=lambda b: (tokens[b], b))
        batches[lightest].append(index)
        tokens[lightest] += len(sequences[index])
    return [[sequences[i] for i in sorted(batch)] for batch in batches]


def step_updates(
    core: CoreTrainer, request: TrainStepRequest, sequences: list[PackedSequence]
) -> dict[str, float]:
    """The step's optimizer updates: ``epochs`` passes over ``sequences`` in ``mini_batches``
    mini-batches (reshuffled every epoch with an RNG of the campaign seed and the step, so a retried
    step makes the same updates); the last update makes the new version. Every mini-batch keeps the
    step's normalizer (n_executions). Metrics: token means over all updates (loss and tokens per
    epoch), and ``updates``."""
    config = request.trainer
    rng = random.Random(f"{request.seed}/{request.step}")
    plan = [part for _ in range(config.epochs) for part in mini_batches(sequences, config.mini_batches, rng)]
    plan = plan or [[]]  # no sequences: one step closed empty, a version without an update
    reports = []
    world = core.world  # a core of several: its other ranks reach each step at rank 0's address
    host = "127.0.0.1" if world is None else world.local_address or world.address
    elastic = elastic_at(host)
    for k, part in enumerate(plan):
        uri = request.batch_uri
        if world is not None and len(plan) > 1:  # the other ranks read this update's part, not the batch
            uri = write_chunk(part, f"{uri.removesuffix('.parquet')}-update{k}.parquet", request.step)
        coordinator = ElasticCoordinator(core, host=host, config=elastic)
        try:
            reports.append(
                coordinator.run_step(
                    request.step,
                    part,
                    request.n_executions,
                    batch_uri=uri,
                    weights_dir=request.fast_dir,
                    final=k == len(plan) - 1,
                )
            )
        finally:
            coordinator.close()
    metrics = reports[0].metrics()
    if len(reports) > 1:
        tokens = sum(r.stats.tokens for r in reports) or 1
        metrics.update(
            clip_fraction=sum(r.stats.clipped for r in reports) / tokens,
            ratio_mean=sum(r.stats.ratio_sum for r in reports) / tokens,
            ratio_max=max(r.stats.ratio_max for r in reports),
            kl=sum(r.stats.kl_sum for r in reports) / tokens,
            entropy=sum(r.stats.entropy_sum for r in reports) / tokens,
            policy_lag_mean=sum(r.stats.lag_sum for r in reports) / tokens,
            policy_lag_max=float(max(r.stats.lag_max for r in reports)),
            loss=sum(r.stats.loss for r in reports) / config.epochs,
            grad_norm=sum(r.grad_norm for r in reports) / len(reports),
            tokens_trained=float(sum(r.stats.tokens for r in reports) / config.epochs),
            micro_batches=float(sum(r.micro_batches for r in reports)),
            core_micro_batches=float(sum(len(r.by_participant.get(0, [])) for r in reports)),
            step_s=sum(r.timings["step"] for r in reports),
        )
    metrics["updates"] = float(len(reports))
    return metrics


def train_step(request: TrainStepRequest) -> TrainStepReport:
    report, core = step_with(request, None)
    core.close()  # the other ranks of a core of several exit
    return report


def at_step(request: TrainStepRequest, core: CoreTrainer | None) -> tuple[CoreTrainer, bool]:
    """The core at the start of ``request.step``: ``core`` (kept by a serving process) when it is
    there, else restored; and whether it was restored."""
    restored = core is None or core.step != request.step
    if restored:
        core = restore(request)
    elif request.core is not None:
        raise ValueError("a core of several ranks runs one process per step, not a serving trainer")
    if core.step != request.step or core.version != request.step:
        raise ValueError(
            f"the checkpoint {request.resume_from} is at step {core.step} (version {core.version}); "
            f"step {request.step} needs step {request.step} and version {request.step}"
        )
    return core, restored


def step_with(request: TrainStepRequest, core: CoreTrainer | None) -> tuple[TrainStepReport, CoreTrainer]:
    """One step, and the core after it; ``core`` (kept by a serving process) is used when it is at
    the request's step, else the core is restored."""
    started = time.perf_counter()
    core, _ = at_step(request, core)
    try:
        return _step(request, core, started), core
    except BaseException:
        if request.core is not None:  # the other ranks exit now rather than at their timeout
            with contextlib.suppress(Exception):
                core.close()
        raise


def _step(request: TrainStepRequest, core: CoreTrainer, started: float) -> TrainStepReport:
    metrics: dict[str, float] = {}
    trained = bool(request.batch_uri and request.n_executions)
    if request.stream:
        if request.trainer.updates_per_step > 1:
            raise ValueError(
                f"step {request.step}: a streaming step makes one update; trainer.mini_batches "
                f"({request.trainer.mini_batches}) and trainer.epochs ({request.trainer.epochs}) must be 1"
            )
        coordinator = ElasticCoordinator(core, host=request.address, config=elastic_at(request.address))
        try:
            step = coordinator.open_step(
                request.step, weights_dir=request.fast_dir, share_url=request.share_url
            )
            host, port, number = step.address
            print(json.dumps({"stream": {"host": host, "port": port, "step": number}}), flush=True)
            report = step.train()
        finally:
            coordinator.close()
        trained, metrics = report.trained, report.metrics()
    elif trained:
        fs, path = fsspec.core.url_to_fs(request.batch_uri)
        with fs.open(path, "rb") as handle:
            sequences = table_to_sequences(pq.read_table(handle))
        metrics = step_updates(core, request, sequences)
    else:  # nothing carries signal: the same weights become the next version
        core.step += 1
        core.version += 1
    fs, root = fsspec.core.url_to_fs(request.checkpoint_url)
    if fs.exists(root):  # left by an attempt that died before the step was committed
        fs.rm(root, recursive=True)
    core.save_checkpoint(request.checkpoint_url)
    _save_rng(request.checkpoint_url)
    published = core.publish(request.policy_root, request.fast_dir, tokenizer_from=request.init_model)
    return TrainStepReport(
        step=request.step,
        version=core.version,
        trained=trained,
        metrics=metrics,
        checkpoint_url=request.checkpoint_url,
        policy_uri=published.uri,
        policy_path=published.local_path,
        seconds=time.perf_counter() - started,
        optimizer_state_bytes=core.optimizer_state_bytes(),
    )


def serve() -> int:
    """``--serve``: one request per stdin line, one step each, the core kept in memory between steps
    (the scheduler's trainer: no restore and no start-up per step); each report is one stdout line."""
    core = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = TrainStepRequest.model_validate_json(line)
        if request.core is not None:
            raise ValueError("a core of several ranks runs one process per step (without --serve)")
        if request.prepare:
            started = time.perf_counter()
            core, restored = at_step(request, core)
            seconds = round(time.perf_counter() - started, 3)
            answer = {"step": core.step, "seconds": seconds, "restored": restored}
            print(json.dumps({"prepared": answer}), flush=True)
            continue
        os.makedirs(request.fast_dir, exist_ok=True)
        report, core = step_with(request, core)
        print(json.dumps(report.model_dump()), flush=True)
    return 0


def main() -> int:
    devices.enter_cell()  # the cell's cores and threads (its GPUs: CUDA_VISIBLE_DEVICES, set by the spawner)
    if sys.argv[1:] == ["--serve"]:
        return serve()
    request = TrainStepRequest.model_validate_json(sys.stdin.read())
    if request.prepare:
        raise ValueError("a prepare request warms a serving core: run it with --serve")
    os.makedirs(request.fast_dir, exist_ok=True)
    report = train_step(request)
    print(json.dumps(report.model_dump()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
