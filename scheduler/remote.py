"""A cell's trainer replica on another host: served over HTTP beside the cell's engine, driven by the
scheduler as any `TrainerEnd`.

On one machine the scheduler spawns each cell's replica process itself (scheduler/cells.py `Replica`).
A cell on a host of ``[cluster]`` runs its replica on its host: the cell's flow run (stack/cell.py
``serve_cell``) starts a `ReplicaServer` there, and adds its engine to the gateway with the server's
URL as the engine's ``trainer_url``. The scheduler reads that URL from the gateway and drives the
replica through `RemoteReplica`:

    with ReplicaServer(model_dir, "10.0.0.11", token, threads=2) as server:     # on the cell's host
        admin.add_engine(engine_url, engine_id="cell-1", trainer_url=server.url)
    replica = RemoteReplica(server.url, token, loss=trainer.loss.model_dump())   # in the scheduler
    replica.join(host, port, step); replica.leave_step(); replica.poll()

Every route takes the engines' admin token as its bearer token; a join's body is a `Join`
(scheduler/cells.py, as the local replica's command: a malformed one is refused with 422 naming the
field), and every command answers an `Answer`. The replica process belongs to the
cell, not to the scheduler: ``RemoteReplica.stop`` leaves a step in progress and nothing more, so a
scheduler started again drives the same replica (its model already built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import threading
import time
from typing import Any

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel

from engines.devices import CellDevices
from engines.net import KEEP_ALIVE_S, free_port
from scheduler.cells import JOIN_TIMEOUT_S, Join, Replica

ROUTE = "/replica"


class Answer(BaseModel):
    """What a replica's command route answers: the replica's answer (join info, its step's result)
    and whether it is in a step now."""

    answer: dict[str, Any] | None
    busy: bool


class ReplicaState(BaseModel):
    """GET /replica: whether it is in a step, what its process got, whether that process lives."""

    busy: bool
    devices: dict[str, Any] | None
    alive: bool


class ReplicaServer:
    """A `Replica` of ``model_dir`` on this host, its commands served at ``url`` (uvicorn in a thread)."""

    def __init__(
        self,
        model_dir: str,
        address: str,
        token: str,
        *,
        threads: int = 1,
        cell: CellDevices | None = None,
        port: int | None = None,
    ):
        # its gloo reduction binds the host's address: torch's default may pick another interface
        self.replica = Replica(model_dir, threads, None, cell, address=address)
        self.port = port or free_port(address)
        self.url = f"http://{address}:{self.port}"

        def bearer(request: Request) -> None:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
            if not hmac.compare_digest(given, token.encode()):
                raise HTTPException(401, "the replica's routes take the engines' admin token as bearer")

        app = FastAPI(dependencies=[Depends(bearer)])
        replica = self.replica

        # sync routes: each runs on uvicorn's thread pool, and a join blocks until the replica counts
        @app.get(ROUTE)
        def state() -> ReplicaState:
            return ReplicaState(busy=replica.busy, devices=replica.devices, alive=replica.process.is_alive())

        @app.post(f"{ROUTE}/join")
        def join(body: Join) -> Answer:
            try:
                info = replica.join(body.host, body.port, body.step, loss=body.loss)
            except (RuntimeError, TimeoutError) as error:
                raise HTTPException(503, f"the replica could not join step {body.step}: {error}") from None
            return Answer(answer=info, busy=replica.busy)

        @app.post(f"{ROUTE}/leave")
        def leave() -> Answer:
            try:
                left = replica.leave_step()
            except (RuntimeError, TimeoutError) as error:
                raise HTTPException(503, f"the replica could not leave its step: {error}") from None
            return Answer(answer=left, busy=replica.busy)

        @app.post(f"{ROUTE}/poll")
        def poll() -> Answer:
            return Answer(answer=replica.poll(), busy=replica.busy)

        import uvicorn

        config = uvicorn.Config(
            app, host=address, port=self.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="replica-server", daemon=True)

    def __enter__(self) -> ReplicaServer:
        try:
            self.replica.wait_ready()
            self.thread.start()
            deadline = time.monotonic() + 30
            while not self.server.started:
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the replica's server did not start on {self.url}")
                time.sleep(0.05)
        except BaseException:
            self.replica.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.replica.stop()


class RemoteReplica:
    """A `TrainerEnd` for a replica served by a `ReplicaServer` (``loss``: the core's LossConfig
    fields, sent with every join). ``busy`` is what the server said last. A replica that cannot be
    reached (its host cut off) has left: the core evicts a satellite that stops beating, and its
    micro-batches are computed again, so leave and poll answer with the error and busy False."""

    def __init__(self, url: str, token: str, loss: dict | None = None, timeout_s: float = JOIN_TIMEOUT_S):
        self.url, self.loss = url, loss
        self.busy = False
        self.client = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s + 10, connect=5.0),  # a join waits; a cut-off host does not
        )

    def _call(self, route: str, body: Join | None = None) -> Any:
        response = self.client.post(f"{ROUTE}/{route}", json=dataclasses.asdict(body) if body else {})
        if response.status_code != 200:
            raise RuntimeError(
                f"replica at {self.url}: {route} answered {response.status_code}: {response.text}"
            )
        answer = Answer.model_validate_json(response.content)
        self.busy = answer.busy
        return answer.answer

    def join(self, host: str, port: int, step: int) -> dict[str, Any]:
        self.busy = True
        try:
            return self._call("join", Join(host, port, step, self.loss))
        except BaseException:
            self.busy = False  # as a local replica that failed to join: the cell is free again
            raise

    def leave_step(self) -> dict[str, Any]:
        return self._unless_unreachable("leave")

    def poll(self) -> dict[str, Any] | None:
        return self._unless_unreachable("poll")

    def _unless_unreachable(self, route: str) -> Any:
        try:
            return self._call(route)
        except httpx.TransportError as error:
            self.busy = False
            return {"error": f"replica at {self.url} unreachable ({type(error).__name__}): left"}

    def stop(self) -> None:
        """Leaves a step in progress (the replica and its process are the cell's: they stay)."""
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            if self.busy:
                self.leave_step()
        self.client.close()
