"""A campaign's cells on three hosts, each a long-lived flow run on its host's work pool: a real Prefect
server and gateway in the root namespace, one process worker inside each host's network namespace
(bench/netns.py). A host cut off stops its worker's heartbeats: its cell is marked Crashed, declared
dead at the gateway and started again on another host, and an execution whose session was there goes
on, its calls recorded once each."""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta

import pytest

from bench.cluster import start_worker, stop_process
from bench.netns import cut_off, hosts, root_address
from bench.servers import prefect_server
from deployments.cells import deploy_cells
from engines.admin import AdminClient
from engines.model.tokenizer import save_tokenizer
from tasks.services.cluster import CellFleet, CellOrder, CellRun, ClusterConfig, HostSpec
from tests.test_gateway_fixtures import ADMIN_TOKEN, ENGINE_TOKEN, gateway_stack, scripted_model, tokenizer


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


@pytest.fixture(scope="module")
def model():
    return scripted_model(tokenizer())


def _states(runs: list[str]) -> dict[str, tuple[str, str]]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {
            r: (client.read_flow_run(r).state.type.value, client.read_flow_run(r).state.message or "")
            for r in runs
        }


@pytest.mark.slow
def test_cells_run_on_their_hosts_pools_and_a_cut_off_hosts_cell_moves_and_its_execution_goes_on(
    tmp_path, model
):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    folder = str(tmp_path / "policy")
    model.save_pretrained(folder)
    save_tokenizer(tokenizer(), folder)
    with contextlib.ExitStack() as stack:
        h1, h2, h3 = stack.enter_context(hosts(["h1", "h2", "h3"]))
        assert h3.netns is not None  # root here: a host can be cut off
        root = root_address(h1)
        api_url, env = stack.enter_context(prefect_server(tmp_path / "prefect", host=root))
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        gateway = stack.enter_context(gateway_stack(str(tmp_path / "gw"), model, engine_ids=(), host=root))
        cluster = ClusterConfig(
            hosts=[HostSpec(name=h.name, address=h.address) for h in (h1, h2, h3)], heartbeat_misses=3
        )
        assert set(deploy_cells(cluster)) == {"h1", "h2", "h3"}
        worker_env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "2"}
        workers = [start_worker(h, f"gyre-{h.name}", worker_env) for h in (h1, h2, h3)]
        for worker in workers:
            stack.callback(stop_process, worker)
        fleet = CellFleet(cluster, CellOrder(policy=folder, gateway_url=gateway.url))
        fleet.save_tokens(ADMIN_TOKEN, ENGINE_TOKEN)
        fleet.start()
        admin = stack.enter_context(AdminClient(gateway.url, ADMIN_TOKEN, ENGINE_TOKEN))
        stack.callback(fleet.stop)  # also after a failure: no engine outlives the test
        urls = fleet.wait_serving(admin, timeout_s=300)
        assert {c: u.split("//")[1].split(":")[0] for c, u in urls.items()} == {
            "cell-0": h1.address,
            "cell-1": h2.address,
            "cell-2": h3.address,
        }
        first_runs = {c.cell_id: c.flow_run_id for c in fleet.cells.values()}
        assert {s for s, _ in _states(list(first_runs.values())).values()} == {"RUNNING"}
        assert fleet.lost_hosts() == {}

        # one execution a cell: the gateway binds each new session to the least-loaded engine
        clients = {}
        for n in range(3):
            client = gateway.client(gateway.register(f"x{n}"))
            answer = client.completions.create(model="m", prompt=[5, 6, 7, n], max_tokens=4, seed=1)
            clients[answer.model_extra["gyre"]["engine_id"]] = (f"x{n}", client)
        assert set(clients) == {"cell-0", "cell-1", "cell-2"}

        cut_off(h3)
        cut_at = time.monotonic()
        _until(lambda: "h3" in fleet.lost_hosts(), 60)
        found_s = time.monotonic() - cut_at
        assert set(fleet.lost_hosts()) == {"h3"}  # h1 and h2 beat on
        replaced = fleet.replace_lost(admin)
        assert [(r.cell_id, r.lost_host) for r in replaced] == [("cell-2", "h3")]
        assert replaced[0].host in {"h1", "h2"} and replaced[0].flow_run_id != first_runs["cell-2"]
        urls = fleet.wait_serving(admin, timeout_s=300)
        moved_to = {"h1": h1, "h2": h2}[replaced[0].host].address
        assert urls["cell-2"].startswith(f"http://{moved_to}:")
        recovery_s = time.monotonic() - cut_at
        state, message = _states([first_runs["cell-2"]])[first_runs["cell-2"]]
        assert state == "CRASHED" and "host h3 lost" in message
        assert fleet.replace_lost(admin) == []  # nothing else is lost or ended

        execution, client = clients["cell-2"]  # its session's engine is gone with its KV
        answer = client.completions.create(model="m", prompt=[5, 6, 7, 2, 9], max_tokens=4, seed=1)
        assert answer.model_extra["gyre"]["engine_id"] in {"cell-0", "cell-1", "cell-2"}
        stats = admin.gateway_stats()
        assert {e.engine_id: e.state for e in stats.engines} == dict.fromkeys(
            ("cell-0", "cell-1", "cell-2"), "active"
        )
        assert stats.engine_deaths == 1
        for x, _ in clients.values():
            gateway.finish(x)
        assert len(gateway.calls(execution)) == 2  # each call recorded once
        assert sum(len(gateway.calls(x)) for x, _ in clients.values()) == 4

        states = fleet.stop()
        assert states == dict.fromkeys(("cell-0", "cell-1", "cell-2"), "Cancelled")
        for url in (urls["cell-0"], urls["cell-1"], urls["cell-2"]):  # the cancelled cells' engines stopped
            _until(lambda u=url: not _answers(u), 60)
        print(
            f"host h3 found lost after {found_s:.1f} s; its cell serving again on {replaced[0].host} after "
            f"{recovery_s:.1f} s"
        )


def _until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s"
        time.sleep(0.5)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


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
    assert fleet.lost_hosts() == {}
    now[0] += timedelta(seconds=29)
    assert fleet.lost_hosts() == {}
    now[0] += timedelta(seconds=2)
    assert "3.1 heartbeats" in fleet.lost_hosts()["a"]


@pytest.mark.slow
def test_a_campaign_runs_on_cells_across_three_hosts_and_survives_one_cut_off_mid_step(tmp_path):
    """The campaign (colocate) in the root namespace with its gateway on the hosts' network, its store
    in S3 (a moto server there), and one cell on each of three hosts (bench/cluster.py). h3 is cut off
    while step 1's executions run on it: its cell starts again on another host with version 1, the
    executions go on from their recorded calls, and each execution and call is recorded once and
    trained once."""
    from bench.cluster import campaign_on_hosts

    figures = campaign_on_hosts(tmp_path, cells=[1, 1, 1], cut="h3")
    assert figures["steps"] == 2 and figures["executions_trained"] == [6, 6]
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
            assert (
                deployment.work_pool_name == f"gyre-{host}" and deployment.entrypoint == "flows/cell.py:cell"
            )

    plain = tmp_path / "plain.toml"
    plain.write_text('name = "p"\n')
    assert main(["deploy", "--cells", str(plain)]) == 2
    assert "has no [cluster]" in capsys.readouterr().err
    monkeypatch.delenv("PREFECT_API_URL")
    assert main(["run", "--config", str(config)]) == 2
    assert "needs a Prefect server every host reaches" in capsys.readouterr().err
