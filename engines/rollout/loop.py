"""EngineLoop: steps a RolloutEngine in a background thread while it has work, and hands each ended
request's GenerateOutput to the asyncio future its HTTP handler awaits. Requests that arrive while a
step runs join the running batch at the next step (continuous batching across HTTP calls).

A failed step is logged with the state that explains it; the in-flight requests fail (their handlers
raise) and the loop keeps serving (abort_all drops the batch), so one bad step never kills the server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateOutput, GenerateRequest

logger = logging.getLogger(__name__)


class EngineLoop:
    """Steps the engine in a background thread while it has work; resolves asyncio futures per request."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._waiters_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def notify(self) -> None:
        self._wake.set()

    def expect(self, request_id: str) -> asyncio.Future:
        """A future resolved with the request's GenerateOutput (register before the request can end)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._waiters_lock:
            self._waiters[request_id] = (loop, future)
        return future

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        future = self.expect(request.request_id)
        try:
            self.engine.add_request(request)
        except Exception:
            with self._waiters_lock:
                self._waiters.pop(request.request_id, None)
            raise
        self.notify()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away
            self.engine.abort(request.request_id)
            self.notify()
            raise

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail the requests in flight, log what explains it
                logger.exception(
                    "engine step failed (running=%d waiting=%d); aborting in-flight requests",
                    len(self.engine.running),
                    len(self.engine.waiting),
                )
                self.engine.abort_all()
                self._fail_all(exc)
                continue
            for output in outputs:
                with self._waiters_lock:
                    waiter = self._waiters.pop(output.request_id, None)
                if waiter is not None:
                    loop, future = waiter
                    loop.call_soon_threadsafe(_resolve, future, output)

    def _fail_all(self, exc: Exception) -> None:
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, {}
        for loop, future in waiters.values():
            loop.call_soon_threadsafe(_resolve, future, exc)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if future.done():
        return
    if isinstance(value, Exception):
        future.set_exception(value)
    else:
        future.set_result(value)
