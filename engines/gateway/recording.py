"""Recording: every call and execution the gateway answers, written through trajectory_store's Recorder.

    recording = CallRecording(store, flush_interval_s=30.0)
    await recording.start()                                  # the spool's leftovers, then the periodic flush
    await recording.record_call(target, execution_id, agent_id, role, prompt_ids, output_ids, logprobs,
                                policy_version, call_id=..., engine_id=..., finish_reason=..., ...)
    await recording.record_execution(target, execution_id, status, reward=..., ...)  # RecordError if refused
    await recording.flush()          # every recorder; {calls, executions, quarantined, manifests}
    await recording.forget(target, execution_id)

``target`` is (campaign, step): an execution registered with a campaign of its own (a held-out
evaluation beside the training campaign) is recorded there, any other in the gateway's campaign.
    await recording.close()

Recording runs on ONE dedicated thread (a FIFO executor): the gateway numbers an execution's calls itself
(call_id, returned in the response's ``gyre`` field) and hands each record to that thread, in that order,
and answers once the record is in the recorder, and so in its spool (record_call): a gateway killed at
any moment has spooled every call a harness received, and its restart writes them. The other order
would lose a call answered but not yet spooled (its output tokens then reach the next prompt without
their logprobs). What this order allows instead: a call spooled whose answer never left is recorded,
and the harness's retry at the standby records the same context again, a dead-end branch with a real
sample of the policy, as any retry makes. The event loop is free while the thread works. Everything
else that touches a recorder (record_execution, flush, forget) goes through the same queue, so a flush
or a finished execution always includes every call answered before it. A call the recorder refuses is
quarantined by it with its reason, logged and counted (``errors``); the harness still has its answer.
Recorders: one per (campaign, step) (executions carry both); flushed when an execution finishes, on
/admin/flush, and every flush_interval_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from trajectory_store.recorder import Recorder
from trajectory_store.schema import Status
from trajectory_store.storage import Store

logger = logging.getLogger(__name__)


Target = tuple[str | None, int]
"""Where an execution is recorded: (campaign, step); campaign None = the gateway's own."""


class CallRecording:
    """Attributes: store (the gateway's campaign), recorders ((campaign, step) -> Recorder), errors
    (calls the recorder refused)."""

    def __init__(self, store: Store, flush_interval_s: float, spool_dir: str | None = None):
        self.store = store
        self.flush_interval_s = flush_interval_s
        self.spool_dir = spool_dir
        self.recorders: dict[Target, Recorder] = {}
        self._stores: dict[str, Store] = {}
        self.errors = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-recorder")
        self._flush_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Writes what a killed predecessor left in the spool (before anything is served), then
        flushes every interval."""
        if sum(self.recorder(target).replayed for target in self._spooled_targets()):
            try:
                await self.flush()
            except Exception:  # the store is down: it stays buffered (and spooled) for the next flush
                logger.exception("writing the rows a killed gateway left in the spool failed")
        self._flush_task = asyncio.create_task(self._flush_periodically())

    def _spool(self, target: Target) -> str | None:
        """The spool file of a recorder: <spool_dir>/step<step>--<campaign>.jsonl."""
        if self.spool_dir is None:
            return None
        campaign, step = target
        return os.path.join(self.spool_dir, f"step{step}--{campaign or self.store.config.campaign}.jsonl")

    def _spooled_targets(self) -> list[Target]:
        if self.spool_dir is None or not os.path.isdir(self.spool_dir):
            return []
        targets = []
        for name in sorted(os.listdir(self.spool_dir)):
            head, _, campaign = name.removesuffix(".jsonl").partition("--")
            if name.endswith(".jsonl") and head.startswith("step") and head[4:].isdigit() and campaign:
                targets.append(self._key((campaign, int(head[4:]))))
        return targets

    def _key(self, target: Target) -> Target:
        """The gateway's own campaign is keyed as None, whichever way a caller names it."""
        campaign, step = target
        return (None if campaign == self.store.config.campaign else campaign, step)

    async def close(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
        await self.run(lambda: [r.close() for r in list(self.recorders.values())])
        self._thread.shutdown(wait=True)

    def recorder(self, target: Target) -> Recorder:
        target = self._key(target)
        recorder = self.recorders.get(target)
        if recorder is None:
            campaign, step = target
            recorder = Recorder(self._store(campaign), step, spool=self._spool(target))
            self.recorders[target] = recorder
        return recorder

    def _store(self, campaign: str | None) -> Store:
        if campaign is None or campaign == self.store.config.campaign:
            return self.store
        if campaign not in self._stores:
            self._stores[campaign] = Store(self.store.config.model_copy(update={"campaign": campaign}))
        return self._stores[campaign]

    async def run(self, work: Callable[[], Any]) -> Any:
        """Runs ``work`` on the recording thread after every record queued before it."""
        return await asyncio.wrap_future(self._thread.submit(work))

    async def record_call(self, target: Target, *args: Any, **fields: Any) -> None:
        """Recorder.record_call(*args, **fields) on the recording thread, queued at once (before any other
        await, so calls keep their order) and awaited. A call the recorder refuses is counted and logged,
        not raised: the harness still gets its answer."""
        future = self._thread.submit(self.recorder(target).record_call, *args, **fields)
        future.add_done_callback(self._recorded)
        with contextlib.suppress(Exception):  # _recorded counted and logged it
            # shielded: a handler cancelled now (its client gone) must not cancel a record not yet run
            await asyncio.shield(asyncio.wrap_future(future))

    async def record_execution(
        self, target: Target, execution_id: str, status: Status, *, calls_elsewhere: int = 0, **fields: Any
    ) -> None:
        """``calls_elsewhere``: calls other gateways recorded for the execution, added to its n_calls."""
        recorder = self.recorder(target)

        def record() -> None:
            if calls_elsewhere:
                fields["n_calls"] = recorder.calls_of(execution_id) + calls_elsewhere
            recorder.record_execution(execution_id, status, **fields)

        await self.run(record)

    async def forget(self, target: Target, execution_id: str) -> None:
        """Drops the execution's prefix index (it takes no more calls)."""
        recorder = self.recorder(target)
        await self.run(lambda: recorder.forget(execution_id))

    async def flush(self) -> dict[str, Any]:
        reports = await self.run(lambda: {s: r.flush() for s, r in list(self.recorders.items())})
        return {
            "calls": sum(r.calls for r in reports.values()),
            "executions": sum(r.executions for r in reports.values()),
            "quarantined": sum(r.quarantined for r in reports.values()),
            "manifests": [r.manifest for r in reports.values() if r.manifest],
        }

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # keep serving; the next flush retries what stayed buffered
                logger.exception("periodic flush of the recorders failed")

    def _recorded(self, future: Future) -> None:
        error = future.exception()
        if error is not None:  # the recorder quarantined the record with its reason
            self.errors += 1
            logger.error("a call could not be recorded: %s", error)
