"""The services a campaign talks to: the rollout engines and the gateway, and how their policy
version is set.

    with campaign_services("./policy", store, ServingConfig()) as services:   # engines + gateway
        serve_version(services, services.engine_urls, version=3, path=...)

``Services`` holds addresses and admin tokens (SecretStr: Prefect records flow parameters, and a
token shown in the UI would be a leak). ``campaign_services`` uses the stack `gyre up` started for the
same data root and policy when it is healthy (stack/up.py), and otherwise starts one on loopback for
the duration of the block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator

import fsspec
import httpx
from pydantic import BaseModel, Field, SecretStr

from engines.admin import AdminClient, AdminError
from engines.devices import CellDevices
from engines.net import host_of
from engines.train.core import default_fast_dir
from stack.cell import CellOrder
from stack.cluster_config import ClusterConfig
from stack.fleet import CellFleet
from stack.stack import LocalStack, local_stack
from stack.up import ServingConfig, UpRecord, running_stack
from trajectory_store.storage import Store, StoreConfig

log = logging.getLogger(__name__)


class Services(BaseModel):
    gateway_url: str
    gateway_urls: list[str] = Field(
        default_factory=list,
        description="every gateway when there are several ([cluster] gateways), gateway_url first; [] with one",
    )
    admin_token: SecretStr
    engine_urls: list[str]
    engine_admin_token: SecretStr
    policy_root: str = Field(description="URL of the campaign folder: versions go under policy/v<n>/")
    fast_dir: str = Field(description="in-host folder of published weights (what engines load)")
    cells_on_hosts: bool = Field(
        False,
        description="the engines are cells on the hosts of [cluster] (stack/fleet.py): a cell that "
        "moves changes its URL, so the engines in use are the gateway's live ones (live_engine_urls)",
    )
    core_address: str | None = Field(
        None,
        description="the address of this machine the hosts reach ([cluster] gateway_address) for cells on "
        "hosts: the core's streaming step listens there, so replicas on the hosts join it",
    )
    core_cpus: float | None = None  # the scheduler's core trainer's CPU quota in cores ([cluster] cell_cpus)
    cell_cgroups: list[list[str]] = Field(
        default_factory=list,
        description="each cell's CPU cgroup folders (cell i: engine i) when the stack gave its cells their "
        "CPU share ([serving] partition = 'cgroup'); the cell's other processes (the trainer for cell 0, the "
        "scheduler's replicas) join them. [] = the cells share the cores",
    )

    def in_cell(self, cell: CellDevices, index: int) -> CellDevices:
        """``cell`` (what a process of cell ``index`` gets) in that cell's CPU cgroup, if it has one."""
        if index < len(self.cell_cgroups):
            return cell.model_copy(update={"cgroup": self.cell_cgroups[index]})
        return cell


@contextlib.contextmanager
def campaign_services(
    model: str,
    store: StoreConfig,
    serving: ServingConfig,
    cluster: ClusterConfig | None = None,
    replicas: bool = False,
) -> Iterator[Services]:
    """The stack `gyre up` runs for this data root and policy (left running), or else engines and a
    gateway started on loopback for the duration of the block. With ``cluster``: the gateway on the
    cluster's gateway address and the cells on their hosts (``cluster_stack``), each also serving a
    trainer replica with ``replicas`` (the elastic scheduler's cells)."""
    fast_dir = os.path.join(default_fast_dir(), f"campaign-{store.campaign}-{os.getpid()}")
    os.makedirs(fast_dir, exist_ok=True)
    target = Store(store)

    def services(stack: LocalStack | UpRecord, **more) -> Services:
        fields = dict(
            gateway_url=stack.gateway_url,
            admin_token=SecretStr(stack.admin_token),
            engine_urls=stack.engine_urls,
            engine_admin_token=SecretStr(stack.engine_admin_token),
            policy_root=target.url(target.campaign_dir),
            fast_dir=fast_dir,
            cell_cgroups=[c.cgroup for c in getattr(stack, "cells", []) if c.cgroup is not None],
            gateway_urls=getattr(stack, "gateway_urls", []),
        )
        return Services(**{**fields, **more})

    try:
        if cluster is not None:
            with cluster_stack(model, store, serving, cluster, replicas) as (stack, urls):
                yield services(
                    stack,
                    engine_urls=urls,
                    cells_on_hosts=True,
                    core_address=cluster.gateway_address,
                    core_cpus=cluster.cell_cpus,
                )
            return
        running = running_stack(store.data_root, model, serving.engine)
        if running is not None:
            if serving.partition == "cgroup":
                log.warning(
                    "CELLS SHARE THE CORES: [serving] partition = 'cgroup' applies to a stack the campaign "
                    "starts itself; the engines `gyre up` runs for %s are not in cell cgroups",
                    store.data_root,
                )
            yield services(running)
            return
        cells = [serving.engine_cell(index) for index in range(serving.engines)]
        with local_stack(model, store, engines=serving.engines, cells=cells, serving=serving) as stack:
            yield services(stack)
    finally:
        shutil.rmtree(fast_dir, ignore_errors=True)


_STACKS: dict[str, LocalStack] = {}
_FLEETS: dict[str, CellFleet] = {}
"""The cell fleet of each campaign in this process, by its gateway URL: serve_version tells it the
version a cell started from then on loads."""

CELL_SERVING = (
    "engine",
    "engine_threads",
    "max_batch_size",
    "engine_dtype",
    "vllm_python",
    "vllm_kv_cache_gib",
    "vllm_args",
    "tensor_parallel_size",
)
"""The [serving] fields a cell's engine takes (the others place processes on this machine)."""


@contextlib.contextmanager
def cluster_stack(
    model: str, store: StoreConfig, serving: ServingConfig, cluster: ClusterConfig, replicas: bool = False
) -> Iterator[tuple[LocalStack, list[str]]]:
    """The gateway on ``cluster.gateway_address`` and every cell of the cluster serving behind it
    (flow runs of the hosts' `gyre-cell` deployments, on the current Prefect API; with ``replicas``,
    each with a trainer replica beside its engine), watched: a lost host's cells start again elsewhere
    while the block runs. (the gateway's stack, the cells' URLs)."""
    if cluster.gateway_address is None:
        raise ValueError(
            "[cluster] gateway_address is not set: give the address of this machine that every host reaches "
            "(the campaign's gateway listens there and the cells join it)"
        )
    with local_stack(
        model,
        store,
        engines=0,
        serving=serving,
        gateway_host=cluster.gateway_address,
        gateways=cluster.gateways,
    ) as stack:
        order = CellOrder(
            policy=share_policy(model, store),
            gateway_url=stack.gateway_url,
            more_gateways=tuple(stack.gateway_urls[1:]),
            serving=serving.model_dump(include=set(CELL_SERVING)),
            replica=replicas,
            cpus=cluster.cell_cpus,
        )
        fleet = CellFleet(cluster, order)
        fleet.save_tokens(stack.admin_token, stack.engine_admin_token)
        stop = threading.Event()
        with AdminClient(stack.gateway_url, stack.admin_token, stack.engine_admin_token) as admin:
            try:
                fleet.start()
                urls = fleet.wait_serving(admin)
                _FLEETS[stack.gateway_url] = fleet
                _STACKS[stack.gateway_url] = stack
                watch = threading.Thread(
                    target=fleet.watch, args=(admin, stop), name="cell-fleet", daemon=True
                )
                watch.start()
                threading.Thread(
                    target=_revive_gateways,
                    args=(stack, cluster.watch_interval_s, stop),
                    name="gateways",
                    daemon=True,
                ).start()
                yield stack, [urls[cell_id] for cell_id, _ in cluster.placement()]
            finally:
                stop.set()
                _FLEETS.pop(stack.gateway_url, None)
                _STACKS.pop(stack.gateway_url, None)
                fleet.stop()


def _revive_gateways(stack: LocalStack, interval_s: float, stop: threading.Event) -> None:
    """Starts a campaign's gateway again once its process died (it writes its spool's calls before it
    serves, environments/gateways.py) and gives it the cells a live gateway serves with; with no live
    sibling (one gateway), each cell joins it again itself (`serve_cell`)."""
    while not stop.wait(interval_s):
        for url in stack.gateway_urls or [stack.gateway_url]:
            process = stack.processes.get(url)
            if process is None or process.poll() is None or stop.is_set():
                continue
            log.warning("gateway %s exited with %s: starting it again", url, process.returncode)
            try:
                stack.restart(url)  # type: ignore[misc]
                revive_engines(stack, url)
            except Exception:  # the next round tries again
                log.exception("gateway %s could not be started again", url)


def revive_engines(stack: LocalStack, url: str) -> list[str]:
    """Adds to the gateway at ``url`` the engines a sibling gateway serves with (it starts with none:
    the cells joined the gateways as they started). Their ids."""
    added = []
    for sibling in stack.gateway_urls:
        if sibling == url:
            continue
        try:
            with AdminClient(sibling, stack.admin_token, stack.engine_admin_token) as admin:
                engines = [e for e in admin.gateway_stats().engines if e.state != "dead"]
        except (AdminError, httpx.HTTPError):
            continue
        with AdminClient(url, stack.admin_token, stack.engine_admin_token) as admin:
            for engine in engines:
                with contextlib.suppress(AdminError):  # its cell joined it again first (serve_cell)
                    admin.add_engine(
                        engine.url,
                        engine_id=engine.engine_id,
                        host=engine.host,
                        trainer_url=engine.trainer_url,
                    )
                    added.append(engine.engine_id)
        break
    return added


def share_policy(model: str, store: StoreConfig) -> str:
    """Where the hosts read the starting policy folder: a copy under the campaign's folder in object
    storage (``policy/start/``) when the store is remote, so no host needs it on its disk; else the
    folder itself (a store on a local disk: the hosts share a file system)."""
    target = Store(store)
    if target.is_local:
        return model
    url = target.url(target.path("policy", "start"))
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(f"{model.rstrip('/')}/", f"{root}/", recursive=True)
    return url


def running_fleets() -> list[CellFleet]:
    """The cell fleets of the campaigns running in this process (their cells on hosts)."""
    return list(_FLEETS.values())


def running_cluster_stacks() -> list[LocalStack]:
    """The gateways' stacks of the campaigns on hosts running in this process (fault tests kill them)."""
    return list(_STACKS.values())


def live_engine_urls(services: Services) -> list[str]:
    """The engines a step uses: the gateway's live ones for cells on hosts (a moved cell has a new URL),
    else the stack's."""
    if not services.cells_on_hosts:
        return list(services.engine_urls)
    with gateway_admin(services) as admin:
        return [e.url for e in admin.gateway_stats().engines if e.state != "dead"]


def policy_path(services: Services, version: int, init_model: str) -> str:
    """A local file (or, for version 0, the starting HF folder) holding policy ``version``; a version
    that is only in object storage (a resumed campaign) is copied to the fast folder first."""
    if version == 0:
        return init_model
    local = os.path.join(services.fast_dir, f"policy-v{version}.safetensors")
    if not os.path.exists(local):
        fs, root = fsspec.core.url_to_fs(services.policy_root)
        fs.get_file(f"{root.rstrip('/')}/policy/v{version}/model.safetensors", local + ".part")
        os.replace(local + ".part", local)
    return local


def remote_policy_path(services: Services, version: int, path: str) -> str:
    """What an engine on another host loads for ``version``: the version in the campaign's object
    storage (``policy/v<n>/model.safetensors`` under ``policy_root``) when that storage is remote
    (version 0: the weights of the starting folder's copy there, ``policy/start/``, which a campaign
    on a cluster makes); else ``path`` itself (a store on a local disk, which another host sees only
    through a shared file system)."""
    if "://" not in services.policy_root or services.policy_root.startswith("file://"):
        return path
    root = services.policy_root.rstrip("/")
    if version == 0:
        start = f"{root}/policy/start/model.safetensors"
        fs, inner = fsspec.core.url_to_fs(start)
        return start if fs.exists(inner) else path
    return f"{root}/policy/v{version}/model.safetensors"


def _engine(services: Services) -> AdminClient:
    """The engines' admin client (a weight load may take minutes)."""
    return AdminClient(engine_token=services.engine_admin_token.get_secret_value(), timeout_s=600)


def serve_version(services: Services, engines: list[str], version: int, path: str) -> dict[str, str]:
    """Makes every engine in ``engines`` awake and serving ``version`` (idempotent); says what it did.
    An engine that cannot be reached (its process died) is skipped: the gateway routes nothing to it,
    and the step runs on the others; with none reachable it raises. ``path`` is on this host: an engine
    whose URL names another host loads the version from the campaign's object storage instead
    (`remote_policy_path`)."""
    fleet = _FLEETS.get(services.gateway_url)
    if fleet is not None:  # a cell started from now on serves this version
        fleet.serving(version, remote_policy_path(services, version, path))
    done = {}
    with _engine(services) as admin:
        for url in engines:
            load = path if host_of(url) == "loopback" else remote_policy_path(services, version, path)
            try:
                stats = admin.engine_stats(url)
            except httpx.TransportError:
                done[url] = "unreachable"
                continue
            if stats.asleep:
                admin.wake(url, load, version)
                done[url] = "woke"
            elif stats.policy_version != version:
                admin.load_weights(url, load, version, drop_kv=True)
                done[url] = "swapped"
            else:
                done[url] = "serving"
    if engines and all(what == "unreachable" for what in done.values()):
        raise RuntimeError(f"no engine answers: {', '.join(engines)}")
    return done


def gateway_admin(services: Services) -> AdminClient:
    """The gateway's admin client (engine management)."""
    return AdminClient(services.gateway_url, services.admin_token.get_secret_value(), timeout_s=60)


def readd_dead_engines(services: Services, engines: list[str]) -> list[str]:
    """Adds back to the gateway each engine of ``engines`` it holds dead (a process that died and was
    started again on its address, by `gyre up --watch` or `gyre run`); call it once the engine serves
    the step's version. Returns their ids (at every gateway, when there are several)."""
    added = []
    for url in services.gateway_urls or [services.gateway_url]:
        with AdminClient(url, services.admin_token.get_secret_value(), timeout_s=60) as admin:
            for engine in admin.gateway_stats().engines:
                if engine.state == "dead" and engine.url in engines:
                    admin.add_engine(engine.url)
                    added.append(engine.engine_id)
    return added


def sleep_engines(services: Services, engines: list[str]) -> None:
    """Frees the engines' memory for training; one that cannot be reached (dead) holds none."""
    with _engine(services) as admin:
        for url in engines:
            with contextlib.suppress(httpx.TransportError):
                admin.sleep(url)


def prune_fast_dir(services: Services, version: int) -> None:
    """Removes in-host weight files of versions older than ``version`` (the engines loaded it; every
    version stays in object storage)."""
    for name in os.listdir(services.fast_dir):
        stem = name.removesuffix(".safetensors")
        number = stem.rsplit("-v", 1)[-1]
        if name.endswith(".safetensors") and number.isdigit() and int(number) < version:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(services.fast_dir, name))
