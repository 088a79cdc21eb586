"""`gyre bench ui` (and `make screenshot`): the Prefect UI of a campaign in a real headless browser.

    gyre bench ui [--out bench/results/ui.png] [--config configs/demo.toml] [--steps 1]

Starts what `gyre up` starts (a Prefect server with its UI, an engine, the gateway) under a fresh data
root, runs a short campaign against that server, then opens the campaign's flow run page in headless
Chromium (Debian's `chromium`) and saves a screenshot. ``page_text`` is what tests read: the rendered
DOM of a UI page once the browser has fetched its data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
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
    from tasks.services.up import down, up

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
