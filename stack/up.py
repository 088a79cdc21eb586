"""What `gyre up` starts on loopback and `gyre down` stops, recorded by pid under the data root.

    record = up(data_root, policy, ServingConfig())     # Prefect server + UI, rollout engines, gateway
    for row in status(data_root): print(row)             # each with its pid, address and health
    down(data_root)                                       # stops what the record lists, nothing else

The record is ``<state>/services.json`` (mode 0600: it holds the admin tokens), where ``<state>`` is
``<data_root>/.gyre`` for a local data root and ``~/.gyre/<hash of the URL>`` for an object store;
each service's log is beside it. ``up`` is idempotent: services of the record that still answer are
kept, the others are started again; for another policy or engine it replaces the engines and the
gateway and keeps the Prefect server (its UI and runs stay). ``campaign_stack`` is what `gyre run`
takes: this stack when it serves the campaign's policy, else only its Prefect server (the campaign
then starts engines of its own, and the stack, with whatever campaign uses it, runs on).

``revive`` (what ``up`` does when the record's policy is the same, and what ``watch``, `gyre up
--watch` and `gyre run` do every few seconds) starts a service
whose process died again the way it was started: same command, same port, same config and tokens,
so the gateway and the engines are where the campaign expects them. A Prefect server is started only when the caller has none
(``prefect_api_url`` None: the CLI passes PREFECT_API_URL when it is set). The trainer is not a
service: every step runs one in a process of its own (engines/train/run.py), so a trainer that dies
costs one retry of one step and never leaves state behind.

``down`` stops a pid only if its command line is still the one ``up`` started (a pid reused by another
program is left alone).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from pydantic import BaseModel

from engines.admin import AdminClient, AdminError
from engines.devices import process_env
from engines.gateway.config import EngineSpec, GatewayConfig
from engines.net import free_port
from stack.serving import ENGINE_MARKERS, ServingConfig, engine_process
from trajectory_store.storage import StoreConfig

RECORD = "services.json"


class ServiceRecord(BaseModel):
    name: str  # prefect, engine-0, ..., gateway
    pid: int
    url: str  # what answers /health (the Prefect server: its API)
    marker: str  # a piece of its command line that identifies it
    log: str
    command: list[str] = []  # how it was started (`revive` starts it again the same way; [] never)
    env: dict[str, str] = {}  # what it adds to the environment
    stdin: str = ""  # its config as JSON, admin tokens included (the record is mode 0600)
    starts: int = 1  # 1 + the times `revive` started it again


class UpRecord(BaseModel):
    data_root: str
    policy: str
    prefect_api_url: str
    prefect_ui_url: str | None  # None: a server gyre did not start
    gateway_url: str
    admin_token: str
    engine_urls: list[str]
    engine_admin_token: str
    services: list[ServiceRecord]
    started_at: float


def state_dir(data_root: str) -> Path:
    if "://" in data_root and not data_root.startswith("file://"):
        return Path.home() / ".gyre" / hashlib.sha256(data_root.encode()).hexdigest()[:16]
    return Path(data_root.removeprefix("file://")).resolve() / ".gyre"


def read_record(data_root: str) -> UpRecord | None:
    path = state_dir(data_root) / RECORD
    return UpRecord.model_validate_json(path.read_text()) if path.exists() else None


def _write_record(data_root: str, record: UpRecord) -> None:
    path = state_dir(data_root) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(record.model_dump_json(indent=1))
    os.replace(tmp, path)


def _alive(service: ServiceRecord) -> bool:
    try:
        cmdline = Path(f"/proc/{service.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return service.marker in cmdline


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=3).status_code == 200
    return False


BASE_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def _start(
    name: str, command: list[str], url: str, marker: str, state: Path, env: dict, stdin: str = ""
) -> ServiceRecord:
    """Starts a detached service (its own session, so it outlives `gyre up`) and waits for its health.
    ``env``: what it adds to this process's environment."""
    log = state / f"{name}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **BASE_ENV, **env},
            start_new_session=True,
        )
    with process.stdin:  # type: ignore[union-attr]
        process.stdin.write(stdin.encode())  # type: ignore[union-attr]
    deadline = time.monotonic() + 240
    while not _healthy(url):
        if process.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {process.returncode}; its log: {log}\n{log.read_text()[-1500:]}"
            )
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{name} did not answer {url}/health within 240 s; its log: {log}")
        time.sleep(0.5)
    return ServiceRecord(
        name=name,
        pid=process.pid,
        url=url,
        marker=marker,
        log=str(log),
        command=command,
        env=env,
        stdin=stdin,
    )


def up(
    data_root: str,
    policy: str,
    serving: ServingConfig,
    *,
    prefect_api_url: str | None = None,
    prefect_port: int = 4200,
    gateway_port: int = 8200,
    engine_port: int = 8100,
) -> UpRecord:
    """Starts (or keeps) the Prefect server, ``serving.engines`` engines and the gateway for ``policy``."""
    state = state_dir(data_root)
    state.mkdir(parents=True, exist_ok=True)
    old = read_record(data_root)
    kept: ServiceRecord | None = None  # the Prefect server of a stack that served another policy
    if old and not serves(old, policy, serving.engine):
        kept = _stop_serving(old)  # another policy or another engine: new engines and gateway below
        old = None
    if old and all(_alive(s) and _healthy(s.url) for s in old.services):
        return old
    if old and all(s.command for s in old.services):
        with contextlib.suppress(RuntimeError):  # a service that cannot start again: a fresh stack below
            revive(data_root)  # keeps what runs (a campaign may be using it), starts what died
        old = read_record(data_root)
        if old and all(_alive(s) and _healthy(s.url) for s in old.services):
            return old
    if old:
        down(data_root)
    env: dict[str, str] = {}
    services = []
    try:
        ui_url = None
        if prefect_api_url is None and kept is not None:  # the UI and its runs stay where they were
            services.append(kept)
            prefect_api_url, ui_url = kept.url, kept.url.removesuffix("/api")
        elif prefect_api_url is None:
            port = prefect_port or free_port()
            prefect_home = state / "prefect"
            prefect_env = {
                "PREFECT_HOME": str(prefect_home),
                "PREFECT_SERVER_UI_STATIC_DIRECTORY": str(prefect_home / "ui"),
                # the browser asks /ui-settings where the API is: this server, not the default port
                "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
            }
            prefect = str(Path(sys.executable).parent / "prefect")
            command = [
                prefect,
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--analytics-off",
            ]
            prefect_api_url = f"http://127.0.0.1:{port}/api"
            services.append(_start("prefect", command, prefect_api_url, "server start", state, prefect_env))
            ui_url = f"http://127.0.0.1:{port}"
        engine_token, admin_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        engine_urls = []
        for index in range(serving.engines):
            port = engine_port + index if engine_port else free_port()
            command, stdin, marker = engine_process(policy, serving, port, engine_token)
            url = f"http://127.0.0.1:{port}"
            engine_env = process_env(serving.engine_cell(index))  # its cell's GPUs, threads and cores
            services.append(_start(f"engine-{index}", command, url, marker, state, engine_env, stdin))
            engine_urls.append(url)
        gateway = GatewayConfig(
            model=policy,
            port=gateway_port or free_port(),
            engines=[EngineSpec(url=url) for url in engine_urls],
            admin_token=admin_token,
            engine_admin_token=engine_token,
            store=StoreConfig(data_root=data_root),
        )
        command = [sys.executable, "-m", "engines.gateway", "--config", "-"]
        services.append(
            _start(
                "gateway",
                command,
                gateway.base_url(),
                "engines.gateway",
                state,
                env,
                gateway.model_dump_json(),
            )
        )
        _install_zombie_detection(prefect_api_url)
    except Exception:
        _stop([s for s in services if s is not kept])
        if kept is not None:  # the record keeps the server it still runs, for `gyre down`
            _write_record(data_root, _prefect_only(data_root, kept))
        raise
    record = UpRecord(
        data_root=data_root,
        policy=policy,
        prefect_api_url=prefect_api_url,
        prefect_ui_url=ui_url,
        gateway_url=gateway.base_url(),
        admin_token=admin_token,
        engine_urls=engine_urls,
        engine_admin_token=engine_token,
        services=services,
        started_at=time.time(),
    )
    _write_record(data_root, record)
    return record


def _stop_serving(record: UpRecord) -> ServiceRecord | None:
    """Stops the engines and the gateway of ``record``; its Prefect server, when it runs and answers,
    is returned (kept), else stopped too. The record then lists only what still runs."""
    prefect = next((s for s in record.services if s.name == "prefect"), None)
    if prefect is not None and not (_alive(prefect) and _healthy(prefect.url)):
        prefect = None
    _stop([s for s in record.services if s is not prefect])
    if prefect is None:
        (state_dir(record.data_root) / RECORD).unlink(missing_ok=True)
    else:
        _write_record(record.data_root, _prefect_only(record.data_root, prefect))
    return prefect


def _prefect_only(data_root: str, prefect: ServiceRecord) -> UpRecord:
    """A record of a Prefect server alone (serving no policy: `up` starts engines beside it)."""
    return UpRecord(
        data_root=data_root,
        policy="",
        prefect_api_url=prefect.url,
        prefect_ui_url=prefect.url.removesuffix("/api"),
        gateway_url="",
        admin_token="",
        engine_urls=[],
        engine_admin_token="",
        services=[prefect],
        started_at=time.time(),
    )


def campaign_stack(
    data_root: str, policy: str, serving: ServingConfig, *, prefect_api_url: str | None = None, **ports: int
) -> tuple[UpRecord, bool]:
    """The stack `gyre run` starts a campaign on, and whether its engines serve the campaign's policy.

    A stack of `gyre up` that serves another policy or engine is left running, the UI and whatever
    campaign uses it included: the campaign uses its Prefect server (started again if its process
    died) and starts engines and a gateway of its own for its duration (stack/campaign.py
    campaign_services). With no stack, or one that serves this policy and engine, it is ``up``."""
    record = read_record(data_root)
    if record is None or not runs_beside(record, policy, serving.engine):
        return up(data_root, policy, serving, prefect_api_url=prefect_api_url, **ports), True
    if prefect_api_url is None:
        revive(data_root, only=("prefect",))
        record = read_record(data_root) or record
        prefect = next((s for s in record.services if s.name == "prefect"), None)
        if prefect is None or not _healthy(prefect.url):
            raise RuntimeError(
                f"the Prefect server of `gyre up` for {data_root} does not answer at {record.prefect_api_url}; "
                "`gyre status` shows it, `gyre down` then `gyre run` starts a fresh one"
            )
    else:
        record = record.model_copy(update={"prefect_api_url": prefect_api_url, "prefect_ui_url": None})
    return record, False


def runs_beside(record: UpRecord | None, policy: str, engine: str) -> bool:
    """Whether a campaign of ``policy`` on ``engine`` runs beside the recorded stack (which serves
    another policy or engine: the campaign starts engines of its own) rather than on it."""
    if record is None or not any(s.name == "gateway" for s in record.services):
        return False  # no stack, or a Prefect server alone: `up` starts the engines beside it
    return not serves(record, policy, engine)


def revive(data_root: str, only: tuple[str, ...] | None = None) -> list[str]:
    """Starts again each service of the record whose process died (of those named ``only``), the way
    `up` started it (same command, port, config and tokens); returns their names. A service that runs
    but does not answer is left alone: a busy engine answers /health late, and killing it would lose
    its calls. Serialised by a lock beside the record, so two supervisors never start one service
    twice."""
    state = state_dir(data_root)
    if not (state / RECORD).exists():
        return []
    with open(state / "revive.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_record(data_root)
        if record is None:
            return []
        revived = []
        for index, service in enumerate(record.services):  # Prefect, then the engines, then the gateway
            if _alive(service) or not service.command or (only is not None and service.name not in only):
                continue
            again = _start(
                service.name,
                service.command,
                service.url,
                service.marker,
                state,
                service.env,
                service.stdin,
            )
            record.services[index] = again.model_copy(update={"starts": service.starts + 1})
            revived.append(service.name)
            _write_record(data_root, record)  # at once: a supervisor killed next never starts it twice
            _note_revival(state, service, record.services[index], record.prefect_api_url)
            if service.name == "prefect":
                _install_zombie_detection(record.prefect_api_url)
            elif service.name.startswith("engine-"):
                _like_its_siblings(record, service.url)
        return revived


def _like_its_siblings(record: UpRecord, url: str) -> None:
    """A restarted engine serves what its live siblings serve (the version of the running step, or
    asleep while the trainer runs), not the policy it starts with; the gateway, which held it dead,
    takes it back at the next step (stack/campaign.readd_dead_engines)."""
    with AdminClient(engine_token=record.engine_admin_token, timeout_s=600) as admin:
        for sibling in record.engine_urls:
            if sibling == url:
                continue
            with contextlib.suppress(httpx.HTTPError, AdminError):
                stats = admin.engine_stats(sibling)
                if stats.asleep:
                    admin.sleep(url)
                elif stats.weights_path:
                    admin.load_weights(url, stats.weights_path, stats.policy_version, drop_kv=True)
                return


def _note_revival(state: Path, old: ServiceRecord, new: ServiceRecord, api_url: str) -> None:
    """One JSON line per revival in ``<state>/revivals.jsonl`` (a step's metrics count those in its
    time: services_revived), and a Prefect event ``gyre.service.revived`` (the UI's event feed)."""
    line = {"wall": time.time(), "name": new.name, "old_pid": old.pid, "pid": new.pid, "starts": new.starts}
    with open(state / "revivals.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")
    from prefect.events import emit_event
    from prefect.settings import PREFECT_API_URL, temporary_settings

    resource = {"prefect.resource.id": f"gyre.service.{new.name}", "prefect.resource.name": new.name}
    with contextlib.suppress(Exception), temporary_settings({PREFECT_API_URL: api_url}):
        emit_event(event="gyre.service.revived", resource=resource, payload=line)  # sent in the background


def revivals(data_root: str) -> list[dict]:
    path = state_dir(data_root) / "revivals.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def watch(
    data_root: str,
    stop: threading.Event,
    interval_s: float = 5.0,
    on_revive=None,
    only: tuple[str, ...] | None = None,
) -> None:
    """Revives dead services (of those named ``only``) every ``interval_s`` until ``stop`` is set; a
    failed start is reported (``on_revive(names, error)``) and tried again next time."""
    while not stop.wait(interval_s):
        try:
            names = revive(data_root, only)
        except Exception as exc:  # the supervisor outlives one failed start
            if on_revive:
                on_revive([], exc)
            continue
        if names and on_revive:
            on_revive(names, None)


def _install_zombie_detection(api_url: str) -> None:
    """The automation that sets a silent flow run CRASHED (stack/zombies.py), on the server used."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stack.zombies import install

    with temporary_settings({PREFECT_API_URL: api_url}):
        install()


def _stop(services: list[ServiceRecord]) -> list[str]:
    stopped = []
    for service in reversed(services):  # the gateway before its engines, the Prefect server last
        if not _alive(service):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _alive(service) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(service):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.pid, signal.SIGKILL)
        stopped.append(service.name)
    return stopped


def down(data_root: str) -> list[str]:
    """Stops the services of the record (those still running what `up` started) and removes it."""
    record = read_record(data_root)
    if record is None:
        return []
    stopped = _stop(record.services)
    (state_dir(data_root) / RECORD).unlink(missing_ok=True)
    return stopped


def status(data_root: str) -> list[dict[str, object]]:
    record = read_record(data_root)
    if record is None:
        return []
    return [
        {
            "name": s.name,
            "pid": s.pid,
            "url": s.url,
            "running": _alive(s),
            "healthy": _healthy(s.url),
            "starts": s.starts,
            "log": s.log,
        }
        for s in record.services
    ]


def serves(record: UpRecord, policy: str, engine: str) -> bool:
    """Whether a recorded stack serves ``policy`` with engines of kind ``engine`` ('gyre', 'vllm')."""
    engines = [s for s in record.services if s.name.startswith("engine-")]
    return record.policy == policy and all(s.marker == ENGINE_MARKERS[engine] for s in engines)


def running_stack(data_root: str, policy: str, engine: str = "gyre") -> UpRecord | None:
    """The stack `gyre up` started for this data root and policy with this kind of engine, if its
    engines and gateway answer."""
    record = read_record(data_root)
    if record is None or not serves(record, policy, engine):
        return None
    if not all(_alive(s) and _healthy(s.url) for s in record.services if s.name != "prefect"):
        return None
    return record
