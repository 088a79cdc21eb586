"""The scheduler's runtime on a campaign's services: one execution, one group packed, the core's
streaming step as a process, engine weights (scheduler/controller.py drives it).

    runtime = CampaignRuntime(services, store, dispatch_config, selection, packing, trainer, policy)
    controller = Controller(make_policy("elastic"), pool, runtime, sessions_per_cell=2)
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import replace
from typing import Any

from engines.train.config import TrainerConfig
from engines.train.run import TrainStepRequest
from engines.train.stream import StreamProducer, write_chunk
from environments.dispatch import DispatchConfig, dispatch, group_id_for
from environments.problems import Problem
from scheduler.controller import Chunk, Outcome
from tasks.services import Services, policy_path, serve_version
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.processor import pack
from trajectory_store.step import left_out
from trajectory_store.storage import Store, StoreConfig


class CoreService:
    """The core as one long-lived process (`python -m engines.train.run --serve`): a step request per
    stdin line; per step, its streaming address (one JSON line) and then its report (the next)."""

    def __init__(self, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engines.train.run", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):  # its JSON lines; libraries print other things
                self.lines.put(line.strip())
        self.lines.put(None)  # the process ended

    def next_line(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the core said nothing for {timeout_s:.0f} s, waiting for {what}") from None
        if line is None:
            raise RuntimeError(f"the core's process ended (exit {self.process.wait()}) before {what}")
        return json.loads(line)

    def step(self, request: TrainStepRequest) -> CoreStep:
        self.process.stdin.write(request.model_dump_json() + "\n")
        self.process.stdin.flush()
        return CoreStep(self, request.step)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class CoreStep:
    """One streaming step of the core service (scheduler.controller.Training)."""

    def __init__(self, service: CoreService, step: int):
        self.service, self.step = service, step
        self._address: tuple[str, int, int] | None = None
        self._producer: StreamProducer | None = None
        self._lock = threading.Lock()

    def address(self) -> tuple[str, int, int]:
        with self._lock:
            if self._address is None:
                spec = self.service.next_line(300, f"step {self.step} to open")["stream"]
                self._address = (spec["host"], int(spec["port"]), int(spec["step"]))
            return self._address

    def _stream(self) -> StreamProducer:
        if self._producer is None:
            self._producer = StreamProducer(*self.address())
        return self._producer

    def append(self, chunk: Chunk, key: str) -> None:
        self._stream().append(chunk.uri, chunk.sequences, chunk.executions, key=key)

    def close(self) -> None:
        self._stream().close()

    def wait(self) -> dict[str, Any]:
        return self.service.next_line(600, f"the report of step {self.step}")


class CampaignRuntime:
    def __init__(
        self,
        services: Services,
        store: StoreConfig,
        dispatch_config: DispatchConfig,
        selection: SelectionConfig,
        packing: PackingConfig,
        trainer: TrainerConfig,
        init_model: str,
        *,
        max_policy_lag: int = 1,
        trainer_threads: int = 1,
        seed: int = 0,
    ):
        self.services, self.store, self.config = services, store, dispatch_config
        self.selection, self.packing, self.trainer = selection, packing, trainer
        self.init_model, self.max_policy_lag = init_model, max_policy_lag
        self.trainer_threads, self.seed = trainer_threads, seed
        self.core: CoreService | None = None

    async def execute(self, step: int, problem: dict[str, Any], member: int) -> Outcome:
        chosen = Problem.from_json(problem)
        config = replace(self.config, step=step, campaign=self.store.campaign)
        outcomes = await dispatch(
            [chosen],
            self.services.gateway_url,
            self.services.admin_token.get_secret_value(),
            self.store,
            config,
            {chosen.problem_id: [member]},
        )
        o = outcomes[0]
        return Outcome(o.execution_id, o.group_id, o.status, float(o.reward or 0.0))

    def pack_group(self, step: int, problem: dict[str, Any]) -> Chunk | None:
        """The group's executions (trees, selection, group-relative advantages), packed as one chunk;
        None when the group carries no signal or nothing in it is trainable."""
        group = group_id_for(step, Problem.from_json(problem), self.config.run_id)
        target = Store(self.store)
        con = connect(target, self.selection)
        others = con.execute(
            "SELECT execution_id FROM executions WHERE step = ? AND coalesce(group_id, '') <> ?",
            [step, group],
        ).fetchall()
        exclude = left_out(
            con, step, trained_version=step, max_policy_lag=self.max_policy_lag, skip_zero_signal=True
        )
        exclude |= {row[0]: "another group" for row in others}
        batch = pack(con, self.packing, step=step, exclude=exclude)
        con.close()
        if not batch.sequences:
            return None
        uri = target.url(target.path(f"batches/step={step}/{group}.parquet"))
        write_chunk(batch.sequences, uri, step)
        return Chunk(uri, len(batch.sequences), len(batch.advantages))

    def start_training(self, step: int) -> CoreStep:
        if self.core is None:
            self.core = CoreService(self.trainer_threads)
        root = self.services.policy_root
        request = TrainStepRequest(
            step=step,
            init_model=self.init_model,
            resume_from=f"{root}/checkpoints/step={step - 1}" if step > 0 else None,
            checkpoint_url=f"{root}/checkpoints/step={step}",
            policy_root=root,
            fast_dir=self.services.fast_dir,
            trainer=self.trainer,
            threads=self.trainer_threads,
            seed=self.seed,
            stream=True,
        )
        return self.core.step(request)

    def close(self) -> None:
        if self.core is not None:
            self.core.close()

    def weights_path(self, version: int) -> str:
        return policy_path(self.services, version, self.init_model)

    def serve(self, engine_urls: list[str], version: int) -> None:
        serve_version(self.services, engine_urls, version, self.weights_path(version))
