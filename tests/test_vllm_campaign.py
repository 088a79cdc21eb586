"""A campaign rolled out by vLLM (`[serving] engine = "vllm"`): the real flow on the Prefect test
harness, vLLM's own server behind our adapter, the gateway, the harness and the trainer. Every call
the store recorded passes the checks our engine's calls pass: each rebuilt prompt matches its hash,
each call's logprobs are the raw logprobs of the version it records (recomputed by transformers from
that version's published weights), and step n's calls were sampled by version n."""

from __future__ import annotations

import pytest
import torch

from engines.model.weights import load_model, read_weights
from tests.test_campaign import small_campaign
from trajectory_store.db import connect, verify_prompts
from trajectory_store.storage import Store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]

POLICY = "data/policies/tiny-sft"


def test_a_vllm_campaign_records_every_call_token_exact_with_its_versions_logprobs(prefect_harness, tmp_path):
    from flows.campaign import campaign, campaign_store

    config = small_campaign(tmp_path, POLICY, steps=2).merged({"serving": {"engine": "vllm"}})
    records = campaign(config)
    assert [r.version for r in records] == [1, 2]
    store, _ = campaign_store(config)
    con = connect(Store(store))
    calls = con.sql(
        "SELECT c.step, c.policy_version, c.engine_id, p.prompt_ids, "
        "c.new_ids[len(c.new_ids) - c.output_len + 1:], c.output_logprobs "
        "FROM calls c JOIN call_prompts p USING (execution_id, call_id) WHERE c.output_len > 0"
    ).fetchall()
    assert calls and verify_prompts(con) >= len(calls)
    assert all(engine.startswith("vllm-") for _, _, engine, *_ in calls)
    assert {step: version for step, version, *_ in calls} == {0: 0, 1: 1}

    campaign_dir = tmp_path / "data" / "campaigns" / store.campaign
    gaps = []
    for version in (0, 1):
        model = load_model(POLICY, dtype=torch.float32)
        if version:
            state, found = read_weights(str(campaign_dir / "policy" / f"v{version}" / "model.safetensors"))
            assert found == version
            model.load_state_dict(state, strict=False)  # the tied head follows the embeddings
        for _, recorded, _, prompt, output, logprobs in calls:
            if recorded != version:
                continue
            ids = torch.tensor([prompt + output])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
            gaps.append(float((expected - torch.tensor(logprobs)).abs().max()))
    assert len(gaps) == len(calls) and max(gaps) < 1e-3
