"""Devices per cell: `[serving]` names each cell's GPUs (and, on CPU, cores), every process of a cell is
started with them, and a layout that cannot be placed is refused naming its key.

The process tests start real processes on this CPU machine (`gyre up`'s engines, a campaign's own
stack, the trainer, a scheduler cell's replica) and read back what each was given: its environment
from /proc/<pid>/environ, its CPU affinity from the kernel, and what it reports itself (an engine's
/admin/stats `devices`, a replica's ready message). No GPU is needed: CUDA_VISIBLE_DEVICES is what
the process is given, and without a GPU the engine runs on the CPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engines.admin import AdminClient
from engines.devices import CellDevices, process_env
from stack.up import ServingConfig
from tests.campaign_fixtures import tiny_policy


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _two_cores() -> tuple[int, int]:
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[-1]  # two distinct cores of this machine (it has at least 2)


# --- the layout and its refusals -------------------------------------------------------------------


def test_process_env_gives_the_cells_gpus_threads_and_cores():
    env = process_env(CellDevices(gpus=[2, 3], threads=4, cores=[8, 9]))
    assert env == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
        "GYRE_CPU_CORES": "8,9",
    }
    # nothing named: the GPUs and cores are inherited, only the thread budget is set
    assert process_env(CellDevices(threads=2)) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}


def test_cells_name_each_engines_devices_and_the_trainer_takes_the_core_cells():
    serving = ServingConfig(devices=[[0], [1], [2, 3]], cores=[[0, 1], [2, 3], [4, 5]], engine_threads=2)
    assert serving.engines == 3  # one engine per cell when engines is not given
    assert serving.engine_cell(2) == CellDevices(gpus=[2, 3], cores=[4, 5], threads=2)
    assert serving.trainer_cell() == CellDevices(gpus=[0], cores=[0, 1], threads=serving.trainer_threads)
    mine = ServingConfig(devices=[[0], [1]], trainer_devices=[0, 1], trainer_cores=[0, 1, 2, 3])
    assert mine.trainer_cell() == CellDevices(gpus=[0, 1], cores=[0, 1, 2, 3], threads=2)
    plain = ServingConfig(engines=2)  # nothing named: today's behaviour, threads only
    assert plain.engine_cell(1) == CellDevices(threads=1) and plain.trainer_cell().gpus is None


@pytest.mark.parametrize(
    ("serving", "message"),
    [
        (
            "devices = [[0], [0, 1]]",
            "[serving] devices: GPU 0 is in cell 0 and cell 1; a GPU belongs to one cell",
        ),
        ("devices = [[0, 0]]", "[serving] devices: GPU 0 is in cell 0 twice"),
        ("devices = [[0], []]", "[serving] devices: cell 1 names no GPU"),
        (
            "engines = 2\ndevices = [[0], [1], [2]]",
            "[serving] devices names 3 cells but engines = 2: one cell per engine",
        ),
        ("engines = 3\ndevices = [[0], [1]]", "[serving] devices names 2 cells but engines = 3"),
        (
            "devices = [[0, 1], [2, 3, 4]]\ntensor_parallel_size = 2",
            "[serving] tensor_parallel_size = 2 does not divide cell 1's 3 GPUs (devices[1] = [2, 3, 4])",
        ),
        ("cores = [[0, 1], [1, 2]]", "[serving] cores: core 1 is in cell 0 and cell 1"),
        ("engines = 1\ncores = [[0], [1]]", "[serving] cores names 2 cells but engines = 1"),
        (
            "devices = [[0], [1]]\ntrainer_devices = [1, 1]",
            "[serving] trainer_devices: GPU 1 is in cell 0 twice",
        ),
        ("devices = [[-1]]", "[serving.devices.0.0] Input should be greater than or equal to 0"),
    ],
)
def test_a_layout_that_cannot_be_placed_is_refused_naming_its_key(tmp_path, serving, message):
    from flows.config import CampaignConfig

    path = tmp_path / "campaign.toml"
    path.write_text(f"[serving]\n{serving}\n")
    with pytest.raises(ValueError) as refused:
        CampaignConfig.from_toml(path)
    assert message in str(refused.value)


# --- what each spawned process was given -----------------------------------------------------------


def _engine_devices(url: str, token: str) -> dict:
    with AdminClient(engine_token=token, timeout_s=30) as admin:
        return admin.engine_stats(url).devices.model_dump()


@pytest.mark.slow
def test_up_starts_each_engine_with_its_cells_gpus_threads_and_cores(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from stack.up import down, up

    first, last = _two_cores()
    serving = ServingConfig(devices=[[0], [1, 2]], cores=[[first], [last]], engine_threads=2)
    data_root = str(tmp_path / "data")
    record = up(
        data_root,
        tiny_policy(tmp_path / "policy"),
        serving,
        prefect_api_url=PREFECT_API_URL.value(),
        gateway_port=0,
        engine_port=0,
    )
    try:
        engines = [s for s in record.services if s.name.startswith("engine-")]
        assert [s.name for s in engines] == ["engine-0", "engine-1"]
        for service, gpus, core in zip(engines, ["0", "1,2"], [first, last], strict=True):
            env = _environ(service.pid)
            assert env["CUDA_VISIBLE_DEVICES"] == gpus
            assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("2", "2")
            assert os.sched_getaffinity(service.pid) == {core}
            reported = _engine_devices(service.url, record.engine_admin_token)
            assert reported == {"cuda_visible_devices": gpus, "threads": 2, "cores": [core]}
            assert service.env["CUDA_VISIBLE_DEVICES"] == gpus  # what `revive` starts it with again
        gateway = next(s for s in record.services if s.name == "gateway")
        assert _environ(gateway.pid).get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    finally:
        down(data_root)


@pytest.mark.slow
def test_a_campaigns_own_stack_trainer_and_replicas_take_their_cells(tmp_path):
    """The stack a campaign starts when `gyre up` runs none (stack/campaign.py), the trainer
    process (tasks/train.py, as the step flow and the scheduler start it) and a scheduler cell's
    replica (scheduler/cells.py): each on the cell the same [serving] names for it."""
    from scheduler.cells import Replica
    from stack.campaign import campaign_services
    from stack.placement import Colocate
    from tasks.train import CoreService
    from trajectory_store.storage import StoreConfig

    first, last = _two_cores()
    policy = tiny_policy(tmp_path / "policy")
    serving = ServingConfig(
        devices=[[3], [4, 5]],
        cores=[[first], [last]],
        engine_threads=2,
        trainer_threads=3,
        trainer_devices=[3, 4, 5],
    )
    store = StoreConfig(data_root=str(tmp_path / "data"), campaign="devices")
    with campaign_services(policy, store, serving) as services:
        token = services.engine_admin_token.get_secret_value()
        reported = [_engine_devices(url, token) for url in services.engine_urls]
        training = Colocate().training(services, serving)
    assert reported == [
        {"cuda_visible_devices": "3", "threads": 2, "cores": [first]},
        {"cuda_visible_devices": "4,5", "threads": 2, "cores": [last]},
    ]

    core = CoreService(training.trainer_threads, training.trainer)  # waits for its first step on stdin
    try:
        env = _environ(core.process.pid)
        assert env["CUDA_VISIBLE_DEVICES"] == "3,4,5" and env["OMP_NUM_THREADS"] == "3"
        assert env["GYRE_CPU_CORES"] == str(first)
        deadline = time.monotonic() + 120  # it pins itself as it starts (engines/devices.enter_cell)
        while os.sched_getaffinity(core.process.pid) != {first} and time.monotonic() < deadline:
            assert core.process.poll() is None, "the trainer process ended"
            time.sleep(0.2)
        assert os.sched_getaffinity(core.process.pid) == {first}
    finally:
        core.close()

    replica = Replica(policy, threads=1, cell=serving.engine_cell(1))
    try:
        replica.wait_ready()
        assert replica.devices == {"cuda_visible_devices": "4,5", "threads": 2, "cores": [last]}
        assert os.sched_getaffinity(replica.process.pid) == {last}
    finally:
        replica.stop()
