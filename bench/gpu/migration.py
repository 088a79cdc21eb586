"""The migration section: two engine processes on the one device; a session's KV moved A -> B
over /dev/shm (ShmTransport) and over torch IPC (TorchIpcTransport: CUDA IPC on a GPU), against
recomputing the same context on B."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
import traceback
from typing import Any

import torch

from bench.engine_workload import device_clock
from bench.gpu.run import Run, attempt, quiet_transformers, tail
from engines.model.weights import load_model
from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateRequest, SamplingParams
from engines.rollout.migration import ShmHandle, ShmTransport, TorchIpcHandle, TorchIpcTransport


def _engine_process(name: str, folder: str, dtype: str, device: str, max_len: int, inbox, outbox) -> None:
    """An engine in its own process, driven by (command, args) messages; answers ("ok", result)."""
    try:
        quiet_transformers()
        if device == "cpu":
            torch.set_num_threads(1)
        engine = RolloutEngine(
            load_model(folder, dtype, device),
            EngineConfig(engine_id=name, device=device, max_model_len=max_len, kv_budget_tokens=8 * max_len),
        )
        dev = engine.runner.device
        transports: dict[str, Any] = {"shm": ShmTransport(), "ipc": TorchIpcTransport()}
        handles = {"shm": ShmHandle, "ipc": TorchIpcHandle}
        one = SamplingParams(temperature=0, max_tokens=1)

        def generate(session: str, context: list[int]) -> tuple[float, int]:
            started = device_clock(dev)
            out = engine.generate(
                [
                    GenerateRequest(
                        request_id=f"{session}-{time.monotonic_ns()}",
                        session_id=session,
                        prompt_ids=context,
                        sampling=one,
                    )
                ]
            )[0]
            return device_clock(dev) - started, out.prefilled_tokens

        def export(session: str, kind: str) -> tuple[dict, float, int]:
            started = device_clock(dev)
            state = engine.export_session(session)
            handle = transports[kind].send(state)
            return handle.model_dump(), device_clock(dev) - started, state.kv_bytes

        def import_(handle: dict, kind: str, session: str, context: list[int]) -> tuple[float, float, int]:
            started = device_clock(dev)
            engine.import_session(transports[kind].receive(handles[kind].model_validate(handle)))
            imported = device_clock(dev) - started
            seconds, prefilled = generate(session, context)  # the next call: only its last token runs
            return imported + seconds, imported, prefilled

        commands = {
            "generate": generate,
            "export": export,
            "import": import_,
            "end": engine.end_session,
            "release": transports["ipc"].release,
        }
        outbox.put(("ok", str(dev)))
        while True:
            command, args = inbox.get()
            if command == "stop":
                break
            try:
                outbox.put(("ok", commands[command](*args)))
            except Exception:
                outbox.put(("error", tail(traceback.format_exc())))
    except Exception:
        outbox.put(("error", tail(traceback.format_exc())))


class _Remote:
    """The driving side of one engine process."""

    def __init__(self, context, name: str, *args):
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_engine_process, args=(name, *args, self.inbox, self.outbox), daemon=True
        )
        self.process.start()

    def wait(self, timeout: float = 300) -> Any:
        status, value = self.outbox.get(timeout=timeout)
        if status != "ok":
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def call(self, command: str, *args, timeout: float = 300) -> Any:
        self.inbox.put((command, args))
        return self.wait(timeout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.inbox.put(("stop", ()))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def _move(a: _Remote, b: _Remote, kind: str, session: str, tokens: list[int]) -> tuple:
    """A session of ``tokens`` made on A, moved to B over ``kind``, continued there: the timings."""
    a.call("generate", session, tokens)
    started = time.perf_counter()
    handle, export_s, kv_bytes = a.call("export", session, kind)
    total_b, import_s, prefilled = b.call("import", handle, kind, session, tokens)
    relayed = time.perf_counter() - started
    return export_s + total_b, export_s, import_s, relayed, prefilled, kv_bytes


def section_migration(run: Run, figures: dict, deadline: float) -> None:
    import torch.multiprocessing as mp

    plan, device = run.plan, run.device
    longest = max(plan.migration_contexts) + 64
    context = mp.get_context("spawn")
    args = (run.folder(plan.migration_preset), plan.dtype, str(device), longest)
    a, b = _Remote(context, "engine-a", *args), _Remote(context, "engine-b", *args)
    transports = ["shm", "ipc"]
    figures.update(
        preset=plan.migration_preset,
        processes="two engine processes (torch.multiprocessing spawn) on the one device",
        transports={
            "shm": "ShmTransport: KV packed to host memory, one file in /dev/shm, mapped and copied to the device",
            "ipc": "TorchIpcTransport: KV packed into one device tensor shared by "
            + (
                "CUDA IPC (no host copy)"
                if device.type == "cuda"
                else "CPU shared memory (CUDA IPC needs a GPU: this exercises the same code path)"
            ),
        },
        runs=[],
    )
    if device.type != "cuda":
        figures["cuda_ipc"] = "skipped: no CUDA device (the torch IPC transport ran over CPU shared memory)"
    try:
        figures["devices"] = [a.wait(), b.wait()]
        rng = random.Random(3)
        vocab = 4096
        for n in plan.migration_contexts:
            samples: dict[str, list] = {"recompute": [], **{t: [] for t in transports}}
            for repeat in range(plan.migration_repeats + 1):  # the first round warms up and is dropped
                if repeat and time.monotonic() > deadline:
                    figures.setdefault("skipped", []).append(
                        f"{n} tokens, repeat {repeat}: the section's time ran out"
                    )
                    break
                tokens = [rng.randrange(vocab) for _ in range(n)]
                for kind in list(transports):
                    session = f"{kind}-{n}-{repeat}"
                    row = attempt(
                        figures,
                        kind,
                        lambda kind=kind, session=session, tokens=tokens: _move(a, b, kind, session, tokens),
                    )
                    a.call("release", session)
                    a.call("end", session)
                    b.call("end", session)
                    if row is None:
                        transports.remove(kind)  # recorded under errors; the other transport goes on
                    elif repeat:
                        samples[kind].append(row)
                seconds, prefilled = b.call("generate", f"re-{n}-{repeat}", tokens)
                b.call("end", f"re-{n}-{repeat}")
                if repeat:
                    samples["recompute"].append((seconds, prefilled))
            if not samples["recompute"]:
                continue
            recompute_ms = statistics.median(s[0] for s in samples["recompute"]) * 1e3
            result: dict[str, Any] = {
                "context_tokens": n,
                "repeats": len(samples["recompute"]),
                "recompute_ms": round(recompute_ms, 3),
                "recompute_prefilled_tokens": samples["recompute"][0][1],
            }
            for kind, rows in samples.items():
                if kind == "recompute" or not rows:
                    continue
                total_ms = statistics.median(r[0] for r in rows) * 1e3
                result[kind] = {
                    "migrate_ms": round(total_ms, 3),
                    "export_send_ms": round(statistics.median(r[1] for r in rows) * 1e3, 3),
                    "receive_import_ms": round(statistics.median(r[2] for r in rows) * 1e3, 3),
                    "end_to_end_with_relay_ms": round(statistics.median(r[3] for r in rows) * 1e3, 3),
                    "prefilled_after_import": rows[0][4],
                    "kv_bytes": rows[0][5],
                    "recompute_over_migrate": round(recompute_ms / total_ms, 2),
                }
            figures["runs"].append(result)
            run.write()
        figures["migrate_ms_note"] = (
            "migrate = export + send on A, then receive + import + the next call's first token on B "
            "(device-synchronized, inside the processes); recompute = B prefills the same context and "
            "samples one token; end_to_end_with_relay adds the queue hops through the driver"
        )
    finally:
        a.stop()
        b.stop()
