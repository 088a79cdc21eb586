"""A campaign's cells on three hosts, each a long-lived flow run on its host's work pool: a real Prefect
server, S3 server and gateway in the root namespace, one process worker inside each host's network
namespace (bench/netns.py, bench/cluster.py). A host cut off mid-step stops its worker's heartbeats:
its cell is marked Crashed, declared dead at the gateway and started again on another host, and the
campaign loses nothing and counts nothing twice. Also the [cluster] config, the lost-host rule, the
cell's fence, and the CLI."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from engines.admin import AdminClient
from stack.cell import CellOrder
from stack.cluster_config import ClusterConfig, HostSpec
from stack.fleet import CellFleet, CellRun


def test_a_cluster_places_cells_in_its_hosts_order_and_refuses_what_it_cannot_place():
    cluster = ClusterConfig(
        hosts=[
            HostSpec(name="a", address="10.0.0.1", cells=2),
            HostSpec(name="b", address="10.0.0.2", work_pool="gpu-b"),
            HostSpec(name="c", address="10.0.0.3", cells=0),
        ]
    )
    assert cluster.placement() == [("cell-0", "a"), ("cell-1", "a"), ("cell-2", "b")]
    assert [h.pool() for h in cluster.hosts] == ["gyre-a", "gpu-b", "gyre-c"]
    with pytest.raises(ValueError, match="share a name: a"):
        ClusterConfig(hosts=[HostSpec(name="a", address="x"), HostSpec(name="a", address="y")])
    with pytest.raises(ValueError, match="share a work pool: p"):
        ClusterConfig(
            hosts=[
                HostSpec(name="a", address="x", work_pool="p"),
                HostSpec(name="b", address="y", work_pool="p"),
            ]
        )
    with pytest.raises(ValueError, match="places no cell"):
        ClusterConfig(hosts=[HostSpec(name="a", address="x", cells=0)])
    with pytest.raises(ValueError, match="host a: cells 3 is above its max_cells 2"):
        ClusterConfig(hosts=[HostSpec(name="a", address="x", cells=3, max_cells=2)])
    with pytest.raises(ValueError, match="pattern"):
        HostSpec(name="A host", address="x")


def test_a_lost_hosts_cell_goes_to_the_live_host_with_room_and_the_fewest_cells():
    cluster = ClusterConfig(
        hosts=[
            HostSpec(name="a", address="x", cells=1, max_cells=1),
            HostSpec(name="b", address="y", cells=2),
            HostSpec(name="c", address="z", cells=1),
        ]
    )
    fleet = CellFleet(cluster, CellOrder(policy="p", gateway_url="http://g"))
    fleet.cells = {cell_id: CellRun(cell_id, host, "run") for cell_id, host in cluster.placement()}
    fleet.lost = {"c"}
    assert fleet._least_loaded() == "b"  # a is full, c is lost
    fleet.lost = {"b", "c"}
    assert fleet._least_loaded() is None


def test_a_worker_silent_for_its_heartbeats_marks_its_host_lost(prefect_harness):
    """lost_hosts compares each pool's workers' last heartbeat with their interval (the clock is the
    fleet's), against the real API."""
    import uuid

    from prefect import get_client

    from deployments.deploy import ensure_pool

    pool = f"gyre-a-{uuid.uuid4().hex[:6]}"
    cluster = ClusterConfig(hosts=[HostSpec(name="a", address="x", work_pool=pool)], heartbeat_misses=3)
    now = [datetime.now(UTC)]
    fleet = CellFleet(cluster, CellOrder(policy="p", gateway_url="http://g"), clock=lambda: now[0])
    fleet.cells = {"cell-0": CellRun("cell-0", "a", "r")}
    ensure_pool(pool)
    assert "ever" in fleet.lost_hosts()["a"]  # no worker at all
    with get_client(sync_client=True) as client:
        client.send_worker_heartbeat(pool, "w1", heartbeat_interval_seconds=10)
        [worker] = client.read_workers_for_work_pool(pool)
    now[0] = worker.last_heartbeat_time  # the fleet's clock from the beat on
    assert fleet.lost_hosts() == {}
    now[0] += timedelta(seconds=29)
    assert fleet.lost_hosts() == {}
    now[0] += timedelta(seconds=2)
    assert "3.1 heartbeats" in fleet.lost_hosts()["a"]


@pytest.mark.slow
def test_a_campaign_runs_on_cells_across_three_hosts_and_survives_one_cut_off_and_a_gateway_killed(
    tmp_path,
):
    """The campaign (colocate) in the root namespace with its gateway on the hosts' network, its store
    in S3 (a moto server there), and one cell on each of three hosts (bench/cluster.py). h3 is cut off
    while step 1's executions run on it: its cell starts again on another host with version 1, the
    executions go on from their recorded calls, and each execution and call is recorded once and
    trained once. The campaign has two gateways, and the second is SIGKILLed during step 0: its
    executions go on at their standby (the first), the campaign starts it again with the cells'
    engines, and nothing it answered is lost. The core has a second rank on h3 (a flow run of
    gyre-core-rank there, holding half the optimizer state): in step 1, h3 being lost, that rank runs
    on another host, from its share of step 0's checkpoint in S3."""
    from bench.cluster import campaign_on_hosts

    # 5 missed 2 s heartbeats, not 3: on a loaded 2-core machine a live worker may beat late
    figures = campaign_on_hosts(
        tmp_path,
        cells=[1, 1, 1],
        cut="h3",
        heartbeat_misses=5,
        gateways=2,
        kill_gateway=True,
        core_hosts=("h3",),
    )
    print(json.dumps({k: v for k, v in figures.items() if k != "measured"}, default=str))  # for a failure
    assert figures["gateway_calls_before_kill"] >= 1 and figures["gateway_serving_again_s"] > 0
    assert figures["executions_went_on_at_standby"] >= 1
    assert figures["steps"] == 2 and figures["executions_packed"] == [6, 6], figures["left_out_by_step"]
    # every step's core was two ranks, the second a flow run that completed with the step: on h3, then
    # (h3 lost) on a live host
    assert figures["core_ranks"] == [2, 2]
    completed = {name for name, state in figures["core_rank_runs"].items() if state == "COMPLETED"}
    assert "core-rank-1-step-0-on-h3" in completed and "core-rank-1-step-1-on-h3" not in completed
    assert len(completed & {"core-rank-1-step-1-on-h1", "core-rank-1-step-1-on-h2"}) == 1
    assert figures["executions"] == 12 and figures["executions_lost"] == 0
    assert figures["executions_recorded_twice"] == 0 and figures["calls_recorded_twice"] == 0
    assert figures["trained_twice"] == 0
    # the cell started again on another host served version 1, the step's version, like the others
    assert figures["call_versions_by_step"] == {0: [0], 1: [1]}
    assert figures["sessions_on_cut_cell"] > 0 and figures["moved"]["cell-2"] in ("h1", "h2")
    runs = figures["cell_runs"]
    moved = f"cell-2-on-{figures['moved']['cell-2']}"
    assert sorted(runs) == sorted(["cell-0-on-h1", "cell-1-on-h2", "cell-2-on-h3", moved])
    assert runs["cell-2-on-h3"]["state"] == "CRASHED" and "host h3 lost" in runs["cell-2-on-h3"]["message"]
    assert {runs[n]["state"] for n in ("cell-0-on-h1", "cell-1-on-h2", moved)} == {"CANCELLED"}
    assert 0 < figures["found_lost_s"] <= figures["recovery_s"]
    assert all(n > 0 for n in figures["bytes_on_host_links"].values())
    assert figures["engines_left_listening"] == 0  # the cancelled cells stopped their engines
    # the hosts read the starting policy from the campaign's copy in S3, not from this machine's disk
    assert {run["policy"] for run in runs.values()} == {
        "s3://" + figures["bucket"] + "/data/campaigns/across/policy/start"
    }


def test_a_core_rank_of_a_lost_host_runs_on_the_live_host_holding_the_fewest_ranks():
    cluster = ClusterConfig.model_validate(
        {
            "gateway_address": "10.0.0.1",
            "hosts": [{"name": n, "address": f"10.0.0.{i + 2}"} for i, n in enumerate(["a", "b", "c"])],
            "core_hosts": ["b", "c"],
        }
    )
    assert cluster.core_rank_hosts() == ["b", "c"]
    assert cluster.core_rank_hosts({"c"}) == ["b", "a"]  # a holds none, b holds rank 1
    assert cluster.core_rank_hosts({"b", "c"}) == ["a", "a"]
    with pytest.raises(RuntimeError, match="every host of \\[cluster\\] is lost"):
        cluster.core_rank_hosts({"a", "b", "c"})
    for bad, why in ((["d"], "names no host called d"), (["b", "b"], "names a host twice")):
        with pytest.raises(ValidationError, match=why):
            ClusterConfig.model_validate({**cluster.model_dump(), "core_hosts": bad})


def test_gyre_deploys_a_clusters_cells_and_runs_it_only_against_a_server_the_hosts_reach(
    prefect_harness, cli_env, monkeypatch, tmp_path, capsys
):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    from cli.main import main

    config = tmp_path / "cluster.toml"
    config.write_text(
        'name = "c"\n[cluster]\ngateway_address = "10.0.0.1"\n'
        'hosts = [{name = "gpu-a", address = "10.0.0.2"}, {name = "gpu-b", address = "10.0.0.3", cells = 2}]\n'
    )
    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())  # the harness's server
    assert main(["deploy", "--cells", str(config)]) == 0
    out = capsys.readouterr().out
    assert (
        "on pool gyre-gpu-b: on gpu-b (10.0.0.3) run `PREFECT_API_URL=" in out
        and "gyre worker --pool gyre-gpu-b`" in out
    )
    with get_client(sync_client=True) as client:
        for host in ("gpu-a", "gpu-b"):
            deployment = client.read_deployment_by_name(f"gyre-cell/{host}")
            # the flow by its module: a host imports it from its own install, at any path
            assert deployment.work_pool_name == f"gyre-{host}" and deployment.entrypoint == "flows.cell.cell"
            assert deployment.path is None and not deployment.pull_steps

    plain = tmp_path / "plain.toml"
    plain.write_text('name = "p"\n')
    assert main(["deploy", "--cells", str(plain)]) == 2
    assert "has no [cluster]" in capsys.readouterr().err
    monkeypatch.delenv("PREFECT_API_URL")
    assert main(["run", "--config", str(config)]) == 2
    assert "needs a Prefect server every host reaches" in capsys.readouterr().err


def test_a_cell_stops_once_its_run_is_crashed_or_cancelling_and_serves_on_while_the_api_is_silent(
    prefect_harness, monkeypatch
):
    """The fence of a host that comes back: its cell reads its run Crashed (its cell moved) and ends."""
    from prefect import flow, get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling, Crashed, Running

    from stack.cell import run_ended

    @flow(name="fence-probe")
    def probe() -> None:
        return None

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(probe, state=Running())
        assert run_ended(str(run.id)) is None
        client.set_flow_run_state(run.id, Crashed(message="host h3 lost: silent"), force=True)
        assert run_ended(str(run.id)) == "its flow run is Crashed: host h3 lost: silent"
        other = client.create_flow_run(probe, state=Running())
        client.set_flow_run_state(other.id, Cancelling(), force=True)
        assert run_ended(str(other.id)).startswith("its flow run is Cancelling")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing listens there
        assert run_ended(str(run.id)) is None  # cut off from the API: serve on


def test_a_hosts_devices_go_one_list_a_cell_and_bound_what_it_holds(prefect_harness):
    """Each cell on a host takes the lowest free of the host's device lists (its engine's
    CUDA_VISIBLE_DEVICES) and the host's threads; a host holds no more cells than it has lists."""
    import uuid

    from prefect import get_client

    from deployments.cells import deploy_cells

    tag = uuid.uuid4().hex[:6]
    with pytest.raises(ValueError, match="host g: cells 3 but devices for 2 cells"):
        HostSpec(name="g", address="x", cells=3, devices=[[0], [1]])
    gpu = HostSpec(name=f"g-{tag}", address="10.0.0.2", cells=2, devices=[[0, 1], [2, 3]], threads=4)
    cpu = HostSpec(name=f"c-{tag}", address="10.0.0.3", cells=1, max_cells=3)
    assert gpu.capacity() == 2 and cpu.capacity() == 3
    cluster = ClusterConfig(hosts=[gpu, cpu])
    deploy_cells(cluster)
    fleet = CellFleet(cluster, CellOrder(policy="p", gateway_url="http://g"))
    fleet.start()
    with get_client(sync_client=True) as client:
        params = {c.cell_id: client.read_flow_run(c.flow_run_id).parameters for c in fleet.cells.values()}
    assert [(p["devices"], p["threads"], p["address"]) for p in params.values()] == [
        ([0, 1], 4, "10.0.0.2"),
        ([2, 3], 4, "10.0.0.2"),
        (None, None, "10.0.0.3"),
    ]
    fleet.lost = {cpu.name}
    assert fleet._least_loaded() is None  # the GPU host is full: both its device lists are taken
    fleet.cells["cell-0"].host = cpu.name  # cell-0 moved away: its list is free again
    fleet.lost = set()
    again = fleet._start("cell-9", gpu.name)
    assert again.slot == 0 and fleet.cells["cell-1"].slot == 1


def test_a_cell_whose_run_keeps_ending_is_started_again_then_given_up(prefect_harness, tmp_path):
    import uuid

    from prefect import get_client
    from prefect.states import Failed

    from deployments.cells import deploy_cells
    from tests.test_gateway_fixtures import (
        ADMIN_TOKEN,
        ENGINE_TOKEN,
        gateway_stack,
        scripted_model,
        tokenizer,
    )

    name = f"r-{uuid.uuid4().hex[:6]}"
    cluster = ClusterConfig(
        hosts=[HostSpec(name=name, address="10.0.0.4")], max_restarts=1, watch_interval_s=0.1
    )
    deploy_cells(cluster)
    with gateway_stack(str(tmp_path), scripted_model(tokenizer()), engine_ids=()) as gateway:
        fleet = CellFleet(cluster, CellOrder(policy="p", gateway_url=gateway.url))
        fleet.start()
        with (
            get_client(sync_client=True) as client,
            AdminClient(gateway.url, ADMIN_TOKEN, ENGINE_TOKEN) as admin,
        ):
            client.send_worker_heartbeat(f"gyre-{name}", "w", heartbeat_interval_seconds=60)  # the host lives
            first = fleet.cells["cell-0"].flow_run_id
            client.set_flow_run_state(first, Failed(message="engine exited with 1"), force=True)
            [again] = fleet.replace_lost(admin)
            assert (
                again.host == name
                and again.flow_run_id != first
                and "ended Failed: engine exited" in again.why
            )
            client.set_flow_run_state(again.flow_run_id, Failed(message="engine exited with 1"), force=True)
            with pytest.raises(
                RuntimeError, match="cell cell-0: its flow run ended Failed: engine exited with 1 "
            ):
                fleet.wait_serving(admin, timeout_s=30)
            assert "given up" in fleet.given_up["cell-0"] and fleet.replace_lost(admin) == []


def test_a_host_fetches_a_policy_folder_from_object_storage_once(s3_bucket, monkeypatch, tmp_path):
    import s3fs

    from stack.cell import local_policy

    endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.pipe({f"{bucket}/start/config.json": b"{}", f"{bucket}/start/model.safetensors": b"w"})
    assert local_policy("/models/p") == "/models/p" and local_policy("file:///models/p") == "/models/p"
    folder = local_policy(f"s3://{bucket}/start", cache=str(tmp_path))
    assert sorted(p.name for p in Path(folder).iterdir()) == [".complete", "config.json", "model.safetensors"]
    fs.rm(f"{bucket}/start", recursive=True)  # fetched once: the copy on this host serves from now on
    assert local_policy(f"s3://{bucket}/start", cache=str(tmp_path)) == folder
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_host_whose_worker_is_silent_but_whose_engines_answer_is_not_lost(prefect_harness, tmp_path):
    """A worker that died or beats late on a loaded host loses no cell while its engines serve; once
    they stop answering too, the host is lost and its cell moves to the host that beats, and serves
    the newest version a live engine serves (a scheduler process serves versions the fleet is never
    told)."""
    import uuid

    from prefect import flow, get_client
    from prefect.states import Running

    from deployments.cells import deploy_cells
    from tests.test_gateway_fixtures import (
        ADMIN_TOKEN,
        ENGINE_TOKEN,
        gateway_stack,
        kill,
        scripted_model,
        tokenizer,
    )

    tag = uuid.uuid4().hex[:6]
    quiet, beating = f"q-{tag}", f"b-{tag}"
    cluster = ClusterConfig(
        hosts=[HostSpec(name=quiet, address="127.0.0.1"), HostSpec(name=beating, address="10.0.0.5", cells=0)]
    )
    deploy_cells(cluster)

    @flow(name="cell-probe")
    def probe() -> None:
        return None

    from safetensors.torch import save_file

    model = scripted_model(tokenizer())
    newest = tmp_path / "v2.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, newest, metadata={"version": "2"})
    with gateway_stack(str(tmp_path), model, engine_ids=("cell-0", "other")) as gateway:
        fleet = CellFleet(cluster, CellOrder(policy="p", gateway_url=gateway.url))
        with (
            get_client(sync_client=True) as client,
            AdminClient(gateway.url, ADMIN_TOKEN, ENGINE_TOKEN) as admin,
        ):
            run = client.create_flow_run(probe, state=Running())
            fleet.cells = {"cell-0": CellRun("cell-0", quiet, str(run.id))}
            client.send_worker_heartbeat(f"gyre-{beating}", "w", heartbeat_interval_seconds=60)
            assert "ever" in fleet.lost_hosts()[quiet]  # its worker never beat...
            assert fleet.replace_lost(admin) == []  # ...but its engine answers: nothing moves
            other = next(e.url for e in admin.gateway_stats().engines if e.engine_id == "other")
            assert admin.load_weights(other, str(newest)).policy_version == 2  # served by no fleet call
            kill(gateway.engine_servers["cell-0"])  # now the engine is silent too
            [moved] = fleet.replace_lost(admin)
            assert (moved.cell_id, moved.lost_host, moved.host) == ("cell-0", quiet, beating)
            assert client.read_flow_run(run.id).state.type.value == "CRASHED"
            assert {e.engine_id: e.state for e in admin.gateway_stats().engines}["cell-0"] == "dead"
            started = client.read_flow_run(moved.flow_run_id).parameters
            assert (started["version"], started["weights"]) == (2, str(newest))


def test_a_cell_joins_its_gateway_again_once_the_gateway_was_started_again(tmp_path):
    """One gateway (no sibling to copy the engines from): SIGKILLed and started again on its port, it
    knows no engine; the cell's loop sees its engine missing there and adds it again. An engine listed
    as dead (declared so by the fleet) is left alone. The cell has a CPU quota ([cluster] cell_cpus):
    its engine runs in a cgroup of half a core, removed once the cell ended."""
    import os
    import threading

    from engines.devices.cpu_quota import CellCgroup, find_hierarchy
    from stack.cell import rejoin, serve_cell
    from stack.serving import ServingConfig
    from stack.stack import local_stack
    from trajectory_store.storage import StoreConfig

    stop = threading.Event()
    with local_stack(
        "data/policies/tiny-sft", StoreConfig(data_root=str(tmp_path / "data")), engines=0
    ) as stack:
        url = stack.gateway_url
        result: dict = {}

        def cell() -> None:
            try:
                result["ended"] = serve_cell(
                    "cell-0",
                    "h1",
                    "127.0.0.1",
                    "data/policies/tiny-sft",
                    url,
                    ServingConfig(engine_threads=1),
                    stack.admin_token,
                    stack.engine_admin_token,
                    should_stop=lambda: "stopped by the test" if stop.is_set() else None,
                    poll_s=0.5,
                    cpus=0.5,
                )
            except BaseException as exc:  # reported below
                result["error"] = exc

        thread = threading.Thread(target=cell, daemon=True)
        thread.start()
        with AdminClient(url, stack.admin_token, stack.engine_admin_token) as admin:

            def engines() -> dict[str, str]:
                return {e.engine_id: e.state for e in admin.gateway_stats().engines}

            deadline = time.monotonic() + 120
            while "cell-0" not in engines():
                assert thread.is_alive() and time.monotonic() < deadline, result
                time.sleep(0.2)
            hierarchy = find_hierarchy()
            folders = tuple(top / "gyre" / f"cell-0.{os.getpid()}" / "cell-0" for top in hierarchy.roots())
            quota = CellCgroup("cell-0", folders, hierarchy)
            assert quota.quota() == 0.5 and len(quota.pids()) == 1  # the engine (no replica here)
            stack.processes[url].kill()
            stack.processes[url].wait()
            stack.restart(url)
            assert "cell-0" not in engines()  # the new process starts with no engine
            deadline = time.monotonic() + 30
            while engines().get("cell-0") != "active":
                assert thread.is_alive() and time.monotonic() < deadline, result
                time.sleep(0.2)
            admin.declare_dead("cell-0", "declared dead by the test")
            assert not rejoin(
                url, "http://127.0.0.1:9", "cell-0", "h1", stack.admin_token, stack.engine_admin_token
            )
            assert engines()["cell-0"] == "dead"
        stop.set()
        thread.join(60)
    assert result.get("ended", {}).get("stopped") == "stopped by the test", result
    assert not any(folder.exists() for folder in folders)
