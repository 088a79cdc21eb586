"""`gyre bench ui` (and `make screenshot`): the Prefect UI of a campaign in a real headless browser.

    gyre bench ui [--out bench/results/ui.png] [--config configs/demo.toml] [--steps 1]
    gyre bench ui --mlflow [--out bench/results/mlflow.png] [--config configs/demo.toml]

Starts what `gyre up` starts (a Prefect server with its UI, an engine, the gateway) under a fresh data
root, runs a short campaign against that server, then opens the campaign's flow run page in headless
Chromium (Debian's `chromium`) and saves a screenshot. ``page_text`` is what tests read: the rendered
DOM of a UI page once the browser has fetched its data.

With --mlflow it shows a campaign that already ran (`gyre run` makes the demo's): its MLflow run is
synced from the store (tasks/tracking.py; nothing is logged twice), `mlflow server` starts on a free
loopback port against the config's tracking URI (an http(s) one is opened as it is), and the run's
metric charts are the screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # root in a container has no user namespace for Chromium's own sandbox
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--virtual-time-budget=20000",  # without it the page is captured before the UI fetched its data
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no Chromium on PATH: install Debian's chromium (apt-get install chromium)")


def page_text(url: str, timeout_s: float = 120) -> str:
    """The DOM of ``url`` after the UI rendered it."""
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"chromium exited with {result.returncode}: {result.stderr[-1000:]}")
    return result.stdout


def screenshot(url: str, out: str, size: str = "1400,1000", timeout_s: float = 120) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--window-size={size}", f"--screenshot={os.path.abspath(out)}", url],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"chromium could not take the screenshot: {result.stderr[-1000:]}")
    return out


def campaign_run(api_url: str, config: Any) -> tuple[str, list[Any]]:
    """Runs ``config`` as a campaign reporting to the server at ``api_url``; (flow run id, records)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.campaign import campaign

    with temporary_settings({PREFECT_API_URL: api_url}):
        state = campaign(config, return_state=True)
        records = state.result()
        return str(state.state_details.flow_run_id), records


def main(out: str = "bench/results/ui.png", config_path: str = "configs/demo.toml", steps: int = 1) -> int:
    from flows.config import CampaignConfig
    from stack.up import down, up

    config = CampaignConfig.from_toml(config_path).merged({"steps": steps, "evaluation": {"per_suite": 2}})
    with tempfile.TemporaryDirectory(prefix="gyre-ui-") as tmp:
        config.store.data_root = os.path.join(tmp, "data")
        record = up(
            config.store.data_root,
            config.policy,
            config.serving,
            prefect_port=0,
            gateway_port=0,
            engine_port=0,
        )
        try:
            run_id, records = campaign_run(record.prefect_api_url, config)
            time.sleep(2)  # the server writes the last task runs' events
            page = f"{record.prefect_ui_url}/runs/flow-run/{run_id}"
            screenshot(page, out)
        finally:
            down(config.store.data_root)
    print(f"campaign {config.name}: {len(records)} step(s); flow run page {page}")
    print(f"wrote {out}")
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DevTools:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: no port,
    no websocket library): open a page, wait until it shows what it should, capture it. The MLflow UI
    draws its charts only once they are in view and their data came, which a fixed
    --virtual-time-budget does not wait for."""

    def __init__(self, flags: Sequence[str] = ()) -> None:
        import fcntl

        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()
        # the browser reads fd 3 and writes fd 4; copies above 9 so the two moves cannot collide
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser, from_browser)]
        argv = [chromium(), *[f for f in CHROMIUM_FLAGS if not f.startswith("--virtual-time-budget")]]
        argv += ["--remote-debugging-pipe", *flags, "about:blank"]
        self.pid = os.posix_spawn(
            argv[0],
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, ends[0], 3),
                (os.POSIX_SPAWN_DUP2, ends[1], 4),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
            setsid=True,  # its own session: closing it ends its helper processes too
        )
        for fd in (to_browser, from_browser, *ends):
            os.close(fd)
        self._buffer = b""
        self._last_id = 0

    def call(
        self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 60
    ):
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._last_id:
                    if "error" in reply:
                        raise RuntimeError(f"chromium: {method}: {reply['error']}")
                    return reply["result"]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {method} within {timeout_s} s")
            if select.select([self._from_browser], [], [], left)[0]:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited during {method}")
                self._buffer += chunk

    def capture(
        self,
        url: str,
        out: str,
        ready_js: str,
        ready: int,
        size: tuple[int, int],
        bottom_js: str | None = None,
        timeout_s: float = 120,
    ) -> int:
        """Opens ``url`` at ``size``, waits until the number ``ready_js`` evaluates to reaches ``ready``
        (else captures what shows after ``timeout_s``), and saves the page as a PNG, down to the pixel
        ``bottom_js`` evaluates to when given. Returns that number at the capture."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        width, height = size
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics, session)
        self.call("Page.navigate", {"url": url}, session)
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.call("Runtime.evaluate", {"expression": ready_js, "returnByValue": True}, session)
            seen = int(answer["result"].get("value") or 0)
            if seen >= ready or time.monotonic() > deadline:
                break
            time.sleep(1)
        time.sleep(2)  # the last chart's drawing
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        if bottom_js:
            answer = self.call("Runtime.evaluate", {"expression": bottom_js, "returnByValue": True}, session)
            clip["height"] = min(height, int(answer["result"].get("value") or height))
        png = self.call("Page.captureScreenshot", {"format": "png", "clip": clip}, session)["data"]
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "wb") as handle:
            handle.write(base64.b64decode(png))
        return seen

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.call("Browser.close", timeout_s=10)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The browser's name for the loopback MLflow server: for a page served from localhost or 127.0.0.1 the
# UI opens its assistant panel over a third of the page. Chromium resolves the name to 127.0.0.1
# itself (--host-resolver-rules), and the server is told to accept it (its DNS-rebinding guard).
MLFLOW_HOST = "mlflow.gyre.internal"


@contextlib.contextmanager
def mlflow_server(tracking_uri: str, timeout_s: float = 240) -> Iterator[tuple[str, list[str]]]:
    """An MLflow UI for ``tracking_uri``: (its URL, the Chromium flags that reach it). `mlflow server`
    runs on a free loopback port with telemetry off and is stopped with everything it started on exit;
    an http(s) tracking URI is a server already."""
    if tracking_uri.startswith(("http://", "https://")):
        yield tracking_uri.rstrip("/"), []
        return
    from trajectory_store.tracking import MLFLOW_ENV

    port = _free_port()
    url = f"http://{MLFLOW_HOST}:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--allowed-hosts", f"{MLFLOW_HOST}:{port},127.0.0.1:{port}", "--cors-allowed-origins", url]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **MLFLOW_ENV},
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer,
                ):
                    if answer.status == 200:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"mlflow server did not come up on port {port}: {tail}")
                time.sleep(0.5)
            yield url, [f"--host-resolver-rules=MAP {MLFLOW_HOST} 127.0.0.1"]
        finally:
            with contextlib.suppress(ProcessLookupError):  # the server and its uvicorn worker
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


CHARTS_JS = "document.querySelectorAll('.js-plotly-plot').length"
# the bottom of the last chart's card, and a margin
CHARTS_BOTTOM_JS = (
    "Math.max(...[...document.querySelectorAll('.js-plotly-plot')]"
    ".map(e => e.getBoundingClientRect().bottom)) + 110"
)


def mlflow_run_page(ui_url: str, experiment_id: str, run_id: str) -> str:
    """The run's metric charts in the MLflow UI."""
    return f"{ui_url}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics"


def charts_height(names: list[str]) -> int:
    """Pixels that hold every chart of the run page: a section per name prefix, three charts a row."""
    sections: dict[str, int] = {}
    for name in names:
        prefix = name.split("/", 1)[0] if "/" in name else ""
        sections[prefix] = sections.get(prefix, 0) + 1
    rows = sum(-(-n // 3) for n in sections.values())
    return 300 + 120 * (len(sections) + 1) + 420 * rows  # generous: the capture ends at the last chart


def mlflow_screenshot(
    tracking_uri: str, experiment_id: str, run_id: str, out: str, width: int = 1600
) -> tuple[int, int]:
    """The run's metric charts as a PNG, once every one is drawn: (charts drawn, metrics of the run)."""
    from trajectory_store.tracking import mlflow_client

    names = sorted(mlflow_client(tracking_uri).get_run(run_id).data.metrics)
    with mlflow_server(tracking_uri) as (url, flags), DevTools(flags) as browser:
        page = mlflow_run_page(url, experiment_id, run_id)
        size = (width, charts_height(names))
        return browser.capture(page, out, CHARTS_JS, len(names), size, CHARTS_BOTTOM_JS), len(names)


def mlflow_main(out: str = "bench/results/mlflow.png", config_path: str = "configs/demo.toml") -> int:
    from flows.config import CampaignConfig
    from tasks.commit import committed_steps
    from tasks.tracking import sync_campaign

    config = CampaignConfig.from_toml(config_path)
    store = config.store.model_copy(update={"campaign": config.name})
    targets = config.tracking.targets(store.data_root, store.campaign)
    if not targets.mlflow_uri:
        raise ValueError(f"{config_path}: [tracking] mlflow = '' turns MLflow off; there is nothing to show")
    steps = committed_steps(store)
    if not steps:
        raise ValueError(
            f"campaign {config.name} has no committed step in {store.data_root}: run it first (gyre run)"
        )
    synced = sync_campaign(config.tracking, store, config.model_dump(mode="json"), config.steps).mlflow
    drawn, charts = mlflow_screenshot(targets.mlflow_uri, synced.experiment_id, synced.run_id, out)
    print(
        f"campaign {config.name}: {len(steps)} step(s) in MLflow run {synced.run_id} ({targets.mlflow_uri}); "
        f"{drawn} of its {charts} metric charts drawn"
    )
    print(f"wrote {out}")
    return 0
