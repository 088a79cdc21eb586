"""The campaign in the Prefect UI, in a real headless browser (Debian's chromium): `gyre up`'s server,
a one-step campaign reporting to it, then the rendered pages show the campaign run, its step run and
its artifacts."""

from __future__ import annotations

import re
import shutil
import time

import pytest

from bench.ui import campaign_run, page_text
from stack.up import down, up
from tests.campaign_fixtures import tiny_campaign, tiny_policy


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.mark.slow
# timing-sensitive (a browser renders what the server has): never beside the vLLM engines' processes
@pytest.mark.xdist_group("vllm")
@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="LOUD: no chromium on PATH; install Debian's chromium (apt-get install chromium) to run the UI test",
)
def test_the_ui_shows_the_campaign_its_step_and_its_artifacts(prefect_harness, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    policy = tiny_policy(tmp_path / "policy")
    data_root = str(tmp_path / "data")
    config = tiny_campaign("uicheck", policy, data_root)
    record = up(data_root, policy, config.serving, prefect_port=0, gateway_port=0, engine_port=0)
    try:
        run_id, records = campaign_run(record.prefect_api_url, config)
        assert len(records) == 1
        with (
            temporary_settings({PREFECT_API_URL: record.prefect_api_url}),
            get_client(sync_client=True) as client,
        ):
            step_runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["step 0"]))
            )
        assert len(step_runs) == 1
        time.sleep(2)  # the server writes the last events
        ui = record.prefect_ui_url
        campaign_page = _text(page_text(f"{ui}/runs/flow-run/{run_id}"))
        assert "uicheck" in campaign_page and "Completed" in campaign_page
        assert "Subflow Runs" in campaign_page and "Artifacts" in campaign_page
        assert "step 0" in _text(page_text(f"{ui}/runs/flow-run/{step_runs[0].id}"))
        # the list of artifacts renders after their count: under load one dump can hold the count alone
        for _ in range(4):
            artifacts = _text(page_text(f"{ui}/artifacts"))
            if "uicheck-summary" in artifacts and "uicheck-step-0" in artifacts:
                break
            time.sleep(3)
        assert "uicheck-summary" in artifacts and "uicheck-step-0" in artifacts, artifacts
    finally:
        down(data_root)
