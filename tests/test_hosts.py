"""Engines on two hosts: network namespaces the test makes (bench/netns.py), each engine
a process inside its own, the gateway in the root namespace. A drained engine's session moves to the
engine of the other host with its KV over TCP (the exporting engine serves it, the importing one
fetches it: no shared file), and decodes on exactly as it would have."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from bench.netns import cut_off, engine_on, hosts
from engines.model.tokenizer import save_tokenizer
from engines.net import host_of
from tests.test_gateway_fixtures import ENGINE_TOKEN, gateway_stack, scripted_model, scripts, tokenizer
from tests.test_gateway_routing import chat

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return scripted_model(tokenizer())


def test_a_drained_session_moves_to_another_host_with_its_kv_over_tcp(tmp_path, model):
    folder = str(tmp_path / "policy")
    model.save_pretrained(folder)
    save_tokenizer(tokenizer(), folder)
    text = scripts(tokenizer())[1]
    with (
        hosts(["h1", "h2"]) as (h1, h2),
        engine_on(h1, folder, "A", ENGINE_TOKEN) as a_url,
        engine_on(h2, folder, "B", ENGINE_TOKEN) as b_url,
    ):
        if h1.netns is not None:  # each address is its own namespace's: the root reaches both
            assert host_of(a_url) != host_of(b_url)
            assert h2.run(
                ["python3", "-c", f"import urllib.request; urllib.request.urlopen('{a_url}/health')"]
            )
        with gateway_stack(str(tmp_path / "gw"), model, engine_ids=()) as stack:
            stack.engine_urls.update(A=a_url, B=b_url)
            with stack.typed_admin() as admin:
                # the hosts by name, as [cluster] places them (on loopback too, where namespaces are refused)
                assert admin.add_engine(a_url, host=h1.name).engine_id == "A"
                client = stack.client(stack.register("moving"))
                messages = [{"role": "user", "content": "Write a lot."}]
                chat(client, messages)
                assert admin.add_engine(b_url, host=h2.name).engine_id == "B"
                report = admin.drain("A")
            assert report.sessions == 1 and report.moved_with_kv == 1 and report.failed == []
            a_stats, b_stats = stack.engine_stats("A"), stack.engine_stats("B")
            # the KV went over TCP, served by A and fetched by B; B recomputed none of the context
            assert a_stats["kv_bytes_served"] == b_stats["kv_bytes_fetched"] > 0
            assert b_stats["migrations_in"] == 1 and b_stats["prefilled_tokens"] == 0
            chat(client, messages)  # the next turn decodes on B from the moved KV
            stack.finish("moving")
            calls = stack.calls("moving")
            assert [row["engine_id"] for row, _ in calls] == ["A", "B"]
            row, sequence = calls[1]
            assert sequence[row["prompt_len"] :] == text  # what the scripted policy says, moved or not
            new_tokens = row["prompt_len"] - (len(calls[0][1]) - 1)  # the last sampled token was never fed
            assert stack.engine_stats("B")["prefilled_tokens"] == new_tokens
        if h1.netns is not None:  # a host cut off (its link down) answers nothing; its process lives on
            cut_off(h1)
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{a_url}/health", timeout=2)
            assert httpx.get(f"{b_url}/health", timeout=5).status_code == 200


def test_the_hosts_benchmark_moves_kv_between_namespaces_and_checks_the_answer():
    """bench/hosts.py at a small size: the moved session answers as the re-prefilled one does, after
    prefilling only the turn's 2 new tokens, and every byte of the KV (4 KiB a token of the tiny
    preset: 4 layers x keys and values x 2 heads x 64 x float32) crossed between the hosts."""
    from bench.hosts import kv_migration

    figures = kv_migration((512,), rounds=1)
    (row,) = figures["sizes"]
    assert figures["hosts"] == 2 and figures["namespaces"] is True  # root here: namespaces are made
    assert row["same_answer"] and row["fetched_bytes_match"] and row["moved_prefilled_tokens"] == 2
    assert row["kv_bytes"] >= 4 * 2 * 2 * 64 * 4 * 513 and row["tcp_s"] > 0 and row["reprefill_answer_s"] > 0


def test_an_engine_on_another_host_loads_a_new_version_from_object_storage(tmp_path):
    """serve_version on an engine whose URL names another host: it gets the version's URL in the
    campaign's object storage (S3, here a moto server on the hosts' network), not the path of the
    trainer's host, and serves exactly those weights."""
    import boto3
    import fsspec
    import httpx
    from moto.server import ThreadedMotoServer

    from bench.netns import root_address
    from engines.model.weights import save_weights
    from engines.net import free_port
    from engines.rollout import EngineConfig, GenerateRequest, RolloutEngine, SamplingParams
    from stack.campaign import Services, serve_version
    from tests.test_rollout_fixtures import perturbed_state, tiny_policy

    policy = tiny_policy()
    folder = str(tmp_path / "policy")
    policy.save_pretrained(folder)
    save_tokenizer(tokenizer(), folder)
    version_1 = perturbed_state(policy, seed=5)
    local = str(tmp_path / "fast" / "policy-v1.safetensors")
    save_weights(version_1, local, 1)
    with hosts(["h1"]) as (h1,):
        assert h1.netns is not None  # root here: the engine's host is a namespace of its own
        port = free_port(root_address(h1))
        s3 = ThreadedMotoServer(ip_address=root_address(h1), port=port)
        s3.start()
        endpoint = f"http://{root_address(h1)}:{port}"
        credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        credentials.update(AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
        try:
            boto3.client("s3", endpoint_url=endpoint, **_boto(credentials)).create_bucket(Bucket="campaigns")
            fs = fsspec.filesystem(
                "s3", client_kwargs={"endpoint_url": endpoint}, key="testing", secret="testing"
            )
            fs.put_file(local, "campaigns/run/policy/v1/model.safetensors")
            with engine_on(h1, folder, "A", ENGINE_TOKEN, env=credentials) as url:
                services = Services(
                    gateway_url="http://127.0.0.1:9",  # unused: serve_version talks to the engines only
                    admin_token="unused",
                    engine_urls=[url],
                    engine_admin_token=ENGINE_TOKEN,
                    policy_root="s3://campaigns/run",
                    fast_dir=str(tmp_path / "fast"),
                )
                missing = str(tmp_path / "not-on-h1.safetensors")  # what h1 could never read
                assert serve_version(services, [url], 1, missing) == {url: "swapped"}
                headers = {"authorization": f"Bearer {ENGINE_TOKEN}"}
                stats = httpx.get(f"{url}/admin/stats", headers=headers).json()
                assert stats["policy_version"] == 1
                assert stats["weights_path"] == "s3://campaigns/run/policy/v1/model.safetensors"
                body = {"model": "m", "prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "temperature": 0}
                served = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}).json()
        finally:
            s3.stop()
    policy.load_state_dict(version_1)
    sampling = SamplingParams(temperature=0, max_tokens=8)
    [expected] = RolloutEngine(policy, EngineConfig()).generate(
        [GenerateRequest(request_id="x", prompt_ids=[3, 1, 4, 1, 5], sampling=sampling)]
    )
    assert served["choices"][0]["token_ids"] == expected.output_ids


def _boto(credentials: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": credentials["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": credentials["AWS_SECRET_ACCESS_KEY"],
        "region_name": credentials["AWS_DEFAULT_REGION"],
    }


def test_an_engine_host_is_its_spec_or_its_url():
    from engines.gateway.engine_client import EngineClient
    from engines.net import host_of

    assert host_of("http://127.0.0.1:8100") == host_of("http://localhost:9") == "loopback"
    assert host_of("http://[::1]:8100") == "loopback" and host_of("http://10.0.0.12:8100") == "10.0.0.12"
    assert host_of("http://GPU-7.example:8100") == "gpu-7.example"
    assert EngineClient("a", "http://127.0.0.1:1").host == "loopback"
    assert EngineClient("a", "http://127.0.0.1:1", host="h2").host == "h2"  # a [cluster] name wins


def test_a_remote_engine_loads_from_object_storage_only_when_the_store_is_remote(s3_bucket, monkeypatch):
    import s3fs

    from stack.campaign import Services, remote_policy_path

    def services(root: str) -> Services:
        return Services(
            gateway_url="http://127.0.0.1:9",
            admin_token="a",
            engine_urls=[],
            engine_admin_token="e",
            policy_root=root,
            fast_dir="/fast",
        )

    remote = services("s3://campaigns/run/")
    assert remote_policy_path(remote, 3, "/fast/p-v3") == "s3://campaigns/run/policy/v3/model.safetensors"
    endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    shared = services(f"s3://{bucket}/run")
    assert remote_policy_path(shared, 0, "/models/start") == "/models/start"  # no copy of the starting folder
    s3fs.S3FileSystem().pipe(f"{bucket}/run/policy/start/model.safetensors", b"weights")
    assert (
        remote_policy_path(shared, 0, "/models/start") == f"s3://{bucket}/run/policy/start/model.safetensors"
    )
    s3fs.S3FileSystem.clear_instance_cache()
    for local in ("/data/campaigns/run", "file:///data/campaigns/run"):  # a shared file system, if any
        assert remote_policy_path(services(local), 3, "/fast/p-v3") == "/fast/p-v3"


def test_a_host_cut_off_mid_call_misses_its_health_checks_and_the_call_re_runs_on_another_host(
    tmp_path, model
):
    """A cut link breaks no connection: the call to the engine on h1 would wait for ever. The gateway's
    health checks find the engine silent, mark it dead and end its call, which re-runs on h2's engine
    from its recorded prompt; the execution records the call once, from h2."""
    from tests.test_gateway_routing import long_call_finishes_on_b

    folder = str(tmp_path / "policy")
    model.save_pretrained(folder)
    save_tokenizer(tokenizer(), folder)
    with (
        hosts(["h1", "h2"]) as (h1, h2),
        engine_on(h1, folder, "A", ENGINE_TOKEN) as a_url,
        engine_on(h2, folder, "B", ENGINE_TOKEN) as b_url,
    ):
        assert h1.netns is not None  # root here: a host can be cut off
        watch = dict(engine_watch_interval_s=0.5, engine_watch_misses=2, engine_watch_timeout_s=0.5)
        with gateway_stack(str(tmp_path / "gw"), model, engine_ids=(), **watch) as stack:
            with stack.typed_admin() as admin:
                admin.add_engine(a_url, host=h1.name)
                admin.add_engine(b_url, host=h2.name)
            stack.gateway.router.engines["B"].state = "draining"  # the call starts on A
            client = stack.client(stack.register("cut"))
            long_call_finishes_on_b(stack, client, "A", lose=lambda: cut_off(h1), timeout=300)
            with stack.typed_admin() as admin:
                stats = admin.gateway_stats()
            assert stats.engine_deaths == 1 and stats.engines_unresponsive == 1 and stats.rerouted_calls == 1
            assert {e.engine_id: e.state for e in stats.engines} == {"A": "dead", "B": "active"}
            stack.finish("cut")
            assert [row["engine_id"] for row, _ in stack.calls("cut")] == ["B"]


def test_weights_read_from_a_url_are_version_checked_like_a_local_file(tmp_path):
    """read_weights through fsspec (file:// here; s3:// in the namespace test above): a file and a
    folder of it, the version in their metadata, another version refused before use."""
    import torch

    from engines.model.weights import read_weights, save_weights

    path = str(tmp_path / "policy-v7.safetensors")
    save_weights({"w": torch.arange(4.0)}, path, 7)
    for where in (f"file://{path}", f"file://{tmp_path}"):
        state, version = read_weights(where, expected_version=7)
        assert version == 7 and state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="holds policy version 7, expected 8"):
        read_weights(f"file://{path}", expected_version=8)


def test_satellites_on_other_hosts_join_and_leave_a_step_and_the_update_is_the_one_process_update(
    tmp_path, monkeypatch
):
    """The core in the root namespace, a satellite process on each of two hosts (namespaces). Both
    pull the step's weights from object storage (S3, a moto server on the hosts' network), not the
    core's file; the batch is read from there too. The one on h1 trains to the end and joins the gloo
    reduction from its own address; the one on h2 leaves after one micro-batch and hands its gradient
    sum over through S3. Every micro-batch counts once and the update is the core's alone."""
    import json
    import os
    import subprocess
    import sys
    import time

    import boto3
    import fsspec
    import s3fs
    from moto.server import ThreadedMotoServer

    from bench.netns import root_address
    from engines.net import free_port
    from engines.train.core import CoreTrainer
    from engines.train.elastic import ElasticCoordinator
    from engines.train.elastic_protocol import ElasticConfig
    from tests.train_fixtures import load_float32, policy_and_batch, reference_step, update_rel_diff

    model_dir, batch, local_uri = policy_and_batch(tmp_path, 5, 11, n_executions=10, budget=16)
    n, n_executions = len(batch.sequences), len(batch.advantages)
    weights_dir = str(tmp_path / "fast")
    os.makedirs(weights_dir)
    setup = reference_step(model_dir, batch, local_uri, weights_dir)
    with hosts(["h1", "h2"]) as (h1, h2):
        assert h1.netns is not None  # root here: each satellite's host is a namespace of its own
        core_address = root_address(h1)
        port = free_port(core_address)
        s3 = ThreadedMotoServer(ip_address=core_address, port=port)
        s3.start()
        endpoint = f"http://{core_address}:{port}"
        credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        credentials.update(AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
        fs = fsspec.filesystem(
            "s3",
            client_kwargs={"endpoint_url": endpoint},
            key="testing",
            secret="testing",
            skip_instance_cache=True,
        )
        for key, value in credentials.items():  # the core's S3 environment, as the satellites have it
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # no client made before with another endpoint
        satellites = []
        try:
            boto3.client("s3", endpoint_url=endpoint, **_boto(credentials)).create_bucket(Bucket="satellites")
            with (
                fs.open("satellites/run/step0/chunk0.parquet", "wb") as handle,
                open(local_uri, "rb") as source,
            ):
                handle.write(source.read())
            batch_uri = "s3://satellites/run/step0/chunk0.parquet"
            core = CoreTrainer(load_float32(model_dir), setup["config"])
            coordinator = ElasticCoordinator(
                core, host=core_address, config=ElasticConfig(address=core_address)
            )
            env = {**os.environ, "OMP_NUM_THREADS": "1", **credentials}
            for host, extra in [(h1, []), (h2, ["--leave-after", "1"])]:
                command = [sys.executable, "-m", "engines.train.satellite", "--host", core_address]
                command += ["--port", str(coordinator.port), "--step", "0", "--model", model_dir]
                command += ["--address", host.address, *extra]
                satellites.append(
                    subprocess.Popen(host.command(command), env=env, stdout=subprocess.PIPE, text=True)
                )
            share = "s3://satellites/run/fast"
            opened = coordinator.open_step(
                0, weights_dir=weights_dir, n_executions=n_executions, share_url=share
            )
            deadline = time.monotonic() + 180
            active = [f"active/{sid}" for sid in range(1, len(satellites) + 1)]
            while not opened.store.check(active):  # both joined and pulled the weights: the step starts
                assert time.monotonic() < deadline, "the satellites did not join within 180 s"
                assert all(p.poll() is None for p in satellites), "a satellite ended before joining"
                time.sleep(0.1)
            opened.append(batch_uri, n_executions, sequences=batch.sequences)
            opened.close(n_executions)
            report = opened.train(pace_s=0.5)
            outputs = [p.communicate(timeout=120)[0] for p in satellites]
            left_over = fs.ls("satellites/run/fast")
        finally:
            for process in satellites:
                if process.poll() is None:
                    process.kill()
            s3.stop()
            s3fs.S3FileSystem.clear_instance_cache()
    assert [p.returncode for p in satellites] == [0, 0], outputs
    stayed, left = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert stayed["weights"] == left["weights"] == f"{share}/step0-v0.safetensors"  # not the core's file
    assert stayed["member"] and stayed["micro_batches"] and not stayed["left"]
    assert left["left"] and left["micro_batches"] == report.by_participant[left["sid"]]
    assert report.members == [0, stayed["sid"]]  # the gloo reduction spanned the root and h1
    assert sorted(i for ids in report.by_participant.values() for i in ids) == list(range(n))
    assert not report.recomputed and not report.dead
    assert left_over == ["satellites/run/fast/step0-v0.safetensors"]  # the hand-off was added, then deleted
    assert update_rel_diff(core.weights(), setup) <= 1e-4  # Adam's first step amplifies rounding


def test_a_satellite_on_another_host_reads_the_share_url_and_refuses_a_step_without_one(tmp_path):
    from engines.model.weights import save_weights
    from engines.train.satellite import pull_weights
    from tests.test_rollout_fixtures import perturbed_state, tiny_policy

    state = perturbed_state(tiny_policy(), seed=3)
    local, shared = str(tmp_path / "core" / "w.safetensors"), f"file://{tmp_path}/share/w.safetensors"
    save_weights(state, local, 4)
    save_weights(state, shared, 4)
    meta = {"core_address": "10.0.0.1", "weights": local, "weights_url": shared, "version": 4}
    assert pull_weights(meta, None)[2] == local  # on the core's host (the default)
    assert pull_weights(meta, "10.0.0.1")[2] == local
    weights, version, source = pull_weights(meta, "10.0.0.2")
    assert (
        source == shared and version == 4 and torch.equal(weights["lm_head.weight"], state["lm_head.weight"])
    )
    with pytest.raises(ValueError, match=r"on another host than the core .* no share URL"):
        pull_weights({**meta, "weights_url": None}, "10.0.0.2")
    with pytest.raises(ValueError, match="expected 5"):
        pull_weights({**meta, "version": 5}, "10.0.0.2")


def test_the_hosts_benchmark_trains_a_step_with_a_satellite_on_each_side_and_the_same_update():
    """bench/hosts.py's training section at a small size: the satellite on the core's host reads the
    core's file, the one on the other host the S3 copy; both take part, and both steps make the update
    of the core alone."""
    from bench.hosts import train_across_hosts

    size = {"max_context": 600, "max_turns": 6, "budget": 1024, "executions": 4}
    figures = train_across_hosts(size, pace_s=1.0)  # the satellite, slower to start, gets some
    places = figures["places"]
    assert figures["namespaces"] is True
    assert places["alone"]["members"] == [0]
    for place in ("same_host", "other_host"):
        assert places[place]["members"] == [0, 1], places[place]
        assert sum(places[place]["micro_batches_by_participant"].values()) == figures["micro_batches"]
        assert places[place]["update_rel_diff_vs_alone"] <= 1e-4
    assert re.fullmatch(
        r"s3://gyre-[\d-]+/run/fast/step0-v0\.safetensors", places["other_host"]["satellite_weights"]
    )
    assert not places["same_host"]["satellite_weights"].startswith("s3://")
    assert figures["bytes_between_hosts"]["weights"] > 10_000_000  # the tiny preset: 3M float32 weights
    delivery = figures["weight_delivery"]  # each engine answered with the version it was sent
    assert delivery["bytes"] == figures["bytes_between_hosts"]["weights"]
    assert all(len(times) == 3 and min(times) > 0 for times in delivery["rounds"].values())


def test_the_hosts_benchmark_trains_with_a_core_rank_on_another_host_and_the_same_update():
    """bench/hosts.py's core section at a small size: two trainer steps as one rank and as two, the
    second rank on another host (a namespace) reading the policy, batch and its share of step 0's
    checkpoint from S3 there; the two-rank update is the one-rank update, and each rank holds about
    half of the optimizer state."""
    from bench.hosts import core_across_hosts

    size = {"max_context": 600, "max_turns": 6, "budget": 1024, "executions": 4}
    figures = core_across_hosts(size)
    assert figures["update_rel_diff_2_ranks_vs_1"] < 1e-5
    (alone,), (first, second) = (
        figures["1_rank"]["optimizer_state_bytes_by_rank"],
        figures["2_ranks"]["optimizer_state_bytes_by_rank"],
    )
    assert 0.4 * alone <= first <= 0.6 * alone and 0.4 * alone <= second <= 0.6 * alone
    assert len(figures["2_ranks"]["step_s"]) == 2
    # both ranks computed micro-batches of each step (rank 1 on the other host)
    assert all(min(by_rank) >= 1 for by_rank in figures["2_ranks"]["micro_batches_by_rank"]), figures
    if figures["namespaces"]:  # the second rank's reads from S3 and the broadcasts crossed its link
        assert figures["2_ranks"]["other_host_link_bytes"] > 4 * figures["parameters"]


def test_a_test_hosts_processes_end_with_it():
    """A cut-off host's cell serves on while its API is silent; once the test's hosts are gone,
    nothing is left running in them (bench/netns.py kills what each namespace still holds)."""
    import subprocess
    import time

    with hosts(["h1"]) as [host]:
        if host.netns is None:
            pytest.skip("no network namespaces here: nothing runs inside a host")
        inside = subprocess.Popen(["ip", "netns", "exec", host.netns, "sleep", "600"], start_new_session=True)
        deadline = time.monotonic() + 10
        while not subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the process never showed up in its namespace"
            time.sleep(0.05)
    assert inside.wait(timeout=10) == -9
