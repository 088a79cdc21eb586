"""The services a campaign talks to: the rollout engines and the gateway, and how their policy
version is set.

    with campaign_services("./policy", store, ServingConfig()) as services:   # engines + gateway
        serve_version(services, services.engine_urls, version=3, path=...)

``Services`` holds addresses and admin tokens (SecretStr: Prefect records flow parameters, and a
token shown in the UI would be a leak). ``campaign_services`` uses the stack `gyre up` started for the
same data root and policy when it is healthy (tasks/services/up.py), and otherwise starts one on loopback for
the duration of the block.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import fsspec
import httpx
from pydantic import BaseModel, Field, SecretStr

from engines.train.core import default_fast_dir
from tasks.services.stack import LocalStack, local_stack
from tasks.services.up import ServingConfig, UpRecord, running_stack
from trajectory_store.storage import Store, StoreConfig


class Services(BaseModel):
    gateway_url: str
    admin_token: SecretStr
    engine_urls: list[str]
    engine_admin_token: SecretStr
    policy_root: str = Field(description="URL of the campaign folder: versions go under policy/v<n>/")
    fast_dir: str = Field(description="in-host folder of published weights (what engines load)")


@contextlib.contextmanager
def campaign_services(model: str, store: StoreConfig, serving: ServingConfig) -> Iterator[Services]:
    """The stack `gyre up` runs for this data root and policy (left running), or else engines and a
    gateway started on loopback for the duration of the block."""
    fast_dir = os.path.join(default_fast_dir(), f"campaign-{store.campaign}-{os.getpid()}")
    os.makedirs(fast_dir, exist_ok=True)
    target = Store(store)

    def services(stack: LocalStack | UpRecord) -> Services:
        return Services(
            gateway_url=stack.gateway_url,
            admin_token=SecretStr(stack.admin_token),
            engine_urls=stack.engine_urls,
            engine_admin_token=SecretStr(stack.engine_admin_token),
            policy_root=target.url(target.campaign_dir),
            fast_dir=fast_dir,
        )

    try:
        running = running_stack(store.data_root, model)
        if running is not None:
            yield services(running)
            return
        sizes = {"engines": serving.engines, "threads": serving.engine_threads}
        sizes |= {"max_batch_size": serving.max_batch_size, "dtype": serving.engine_dtype}
        with local_stack(model, store, **sizes) as stack:
            yield services(stack)
    finally:
        shutil.rmtree(fast_dir, ignore_errors=True)


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


def _engine(url: str, services: Services, method: str, path: str, body: dict | None = None) -> dict:
    headers = {"Authorization": f"Bearer {services.engine_admin_token.get_secret_value()}"}
    response = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"engine {url} {path} answered {response.status_code}: {response.text[:300]}")
    return response.json()


def serve_version(services: Services, engines: list[str], version: int, path: str) -> dict[str, str]:
    """Makes every engine in ``engines`` awake and serving ``version`` (idempotent); says what it did.
    An engine that cannot be reached (its process died) is skipped: the gateway routes nothing to it,
    and the step runs on the others; with none reachable it raises."""
    done = {}
    for url in engines:
        try:
            stats = _engine(url, services, "GET", "/admin/stats")
        except httpx.TransportError:
            done[url] = "unreachable"
            continue
        if stats.get("asleep"):
            _engine(url, services, "POST", "/admin/wake", {"path": path, "version": version})
            done[url] = "woke"
        elif stats.get("policy_version") != version:
            _engine(
                url, services, "POST", "/admin/weights", {"path": path, "version": version, "drop_kv": True}
            )
            done[url] = "swapped"
        else:
            done[url] = "serving"
    if engines and all(what == "unreachable" for what in done.values()):
        raise RuntimeError(f"no engine answers: {', '.join(engines)}")
    return done


def gateway_admin(services: Services, method: str, path: str, body: dict | None = None) -> dict:
    headers = {"Authorization": f"Bearer {services.admin_token.get_secret_value()}"}
    response = httpx.request(method, f"{services.gateway_url}{path}", json=body, headers=headers, timeout=60)
    if response.status_code != 200:
        raise RuntimeError(f"gateway {path} answered {response.status_code}: {response.text[:300]}")
    return response.json()


def readd_dead_engines(services: Services, engines: list[str]) -> list[str]:
    """Adds back to the gateway each engine of ``engines`` it holds dead (a process that died and was
    started again on its address, by `gyre up --watch` or `gyre run`); call it once the engine serves
    the step's version. Returns their ids."""
    stats = gateway_admin(services, "GET", "/admin/stats")
    added = []
    for engine in stats["engines"]:
        if engine["state"] == "dead" and engine["url"] in engines:
            gateway_admin(services, "POST", "/admin/engines", {"url": engine["url"]})
            added.append(engine["engine_id"])
    return added


def sleep_engines(services: Services, engines: list[str]) -> None:
    """Frees the engines' memory for training; one that cannot be reached (dead) holds none."""
    for url in engines:
        with contextlib.suppress(httpx.TransportError):
            _engine(url, services, "POST", "/admin/sleep")


def prune_fast_dir(services: Services, version: int) -> None:
    """Removes in-host weight files of versions older than ``version`` (the engines loaded it; every
    version stays in object storage)."""
    for name in os.listdir(services.fast_dir):
        stem = name.removesuffix(".safetensors")
        number = stem.rsplit("-v", 1)[-1]
        if name.endswith(".safetensors") and number.isdigit() and int(number) < version:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(services.fast_dir, name))
