"""Options generated from the config classes (engines/options.py), the settings modules that read the
environment (one per process), and configs passed between processes as JSON (stack/stack.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import httpx
import pytest

from cli.main import build_parser as gyre_parser
from engines.gateway import settings as gateway_settings
from engines.gateway.__main__ import build_parser as gateway_parser
from engines.gateway.config import GatewayConfig
from engines.options import add_config_options, build_config
from engines.rollout import settings as engine_settings
from engines.rollout.config import EngineServerConfig
from engines.rollout.server import build_parser as engine_parser

REPO = Path(__file__).resolve().parents[1]


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """option -> (dest, default, help) of every option but --help."""
    return {
        action.option_strings[0]: (action.dest, action.default, action.help)
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


@pytest.mark.parametrize(
    ("command", "server_parser"), [("gateway", gateway_parser), ("engine", engine_parser)]
)
def test_gyre_and_python_m_show_the_same_options_defaults_and_help(command, server_parser):
    gyre = options(subcommand(gyre_parser(), command))
    server = options(server_parser())

    assert gyre == server
    for option, (_, _, help_text) in gyre.items():
        assert help_text, option
        assert "default: " in help_text or "(required" in help_text, option


def test_every_scalar_field_of_the_gateway_config_is_an_option_with_the_class_default():
    parser = gateway_parser()
    given = options(parser)

    assert {"--access-log", "--max-prompt-tokens", "--data-root", "--engine-timeout-s"} <= set(given)
    for name in GatewayConfig.model_fields:
        if name in ("engines", "limits", "store"):
            continue
        assert "--" + name.replace("_", "-") in given, name
    defaults = GatewayConfig(model="m")
    help_port = given["--port"][2]
    assert f"(default: {defaults.port})" in help_port
    assert f"(default: {defaults.limits.max_prompt_tokens})" in given["--max-prompt-tokens"][2]
    assert "$GYRE_DATA_ROOT, else ./gyre-data" in given["--data-root"][2]
    assert "--aws-secret-access-key" not in given  # a secret never goes through argv


def test_gateway_config_layers_class_env_json_and_options(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_DATA_ROOT", "/from/env")
    monkeypatch.setenv("GYRE_GATEWAY_ADMIN_TOKEN", "env-token")
    monkeypatch.delenv("GYRE_CAMPAIGN", raising=False)
    file = tmp_path / "gateway.json"
    file.write_text(json.dumps({"model": "from-json", "port": 9000, "limits": {"max_tokens_cap": 7}}))
    parser = gateway_parser()

    config = gateway_settings.config_from_args(
        parser.parse_args(["--config", str(file), "--port", "9100", "--engine", "http://e:1", "--access-log"])
    )

    assert config.model == "from-json" and config.port == 9100  # the option over the file
    assert config.limits.max_tokens_cap == 7 and config.limits.max_prompt_tokens == 262_144
    assert config.store.data_root == "/from/env" and config.store.campaign == "default"
    assert config.admin_token == "env-token" and config.access_log is True
    assert [e.url for e in config.engines] == ["http://e:1"]
    again = gateway_settings.config_from_args(parser.parse_args(["--model", "m", "--data-root", "/given"]))
    assert again.store.data_root == "/given"  # the option over the environment


def test_a_refused_value_names_its_option():
    with pytest.raises(ValueError, match="--port"):
        gateway_settings.config_from_args(gateway_parser().parse_args(["--model", "m", "--port", "70000"]))
    with pytest.raises(ValueError, match="--model"):
        engine_settings.config_from_args(engine_parser().parse_args([]))


def test_an_unsupported_field_type_must_be_skipped_not_guessed():
    with pytest.raises(TypeError, match="engines"):
        add_config_options(argparse.ArgumentParser(), GatewayConfig)


def test_the_engine_id_defaults_to_the_port_so_two_engines_never_collide(monkeypatch):
    monkeypatch.delenv("GYRE_ROLLOUT_ADMIN_TOKEN", raising=False)
    parser = subcommand(gyre_parser(), "engine")

    first = engine_settings.config_from_args(parser.parse_args(["--model", "m"]))
    second = engine_settings.config_from_args(parser.parse_args(["--model", "m", "--port", "8101"]))
    named = engine_settings.config_from_args(parser.parse_args(["--model", "m", "--engine-id", "a"]))

    assert first.engine_id is None and first.admin_token is None
    assert first.engine_config().engine_id == "rollout-8100"
    assert second.engine_config().engine_id == "rollout-8101"
    assert named.engine_config().engine_id == "a"


def test_a_config_round_trips_through_json_unchanged(tmp_path):
    config = EngineServerConfig(model="m", port=1, admin_token="t", engine={"max_batch_size": 3})
    file = tmp_path / "engine.json"
    file.write_text(config.model_dump_json())
    parser = engine_parser()

    again = build_config(EngineServerConfig, parser.parse_args(["--config", str(file)]))
    overridden = engine_settings.config_from_args(parser.parse_args(["--config", str(file), "--port", "2"]))

    assert again == config
    assert overridden.port == 2 and overridden.engine.max_batch_size == 3 and overridden.admin_token == "t"


ENV_READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=)")
# reads that build a child process's environment (the sandbox's PATH), not configuration
CHILD_ENV = {"environments/runner.py", "environments/problems/problem.py"}


def test_the_environment_is_read_only_in_the_settings_modules():
    readers = set()
    for folder in ("cli", "flows", "tasks", "engines", "environments", "trajectory_store", "scheduler"):
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO).as_posix()
            if path.name == "settings.py" or relative in CHILD_ENV:
                continue
            if ENV_READ.search(path.read_text()):
                readers.add(relative)
    assert readers == set()
    for module in (REPO / "cli/settings.py", REPO / "engines/gateway/settings.py"):
        text = module.read_text()
        for name in re.findall(r'"(GYRE_[A-Z_]+)"', text):
            assert name in text.split('"""')[1], f"{module.name}'s docstring does not name {name}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from engines.model import ModelConfig, init_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    init_model(ModelConfig(preset="tiny", seed=0), str(out))
    return str(out)


def child_command_lines() -> list[str]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            lines.append(cmdline)
    return lines


@pytest.mark.slow
def test_local_stack_hands_each_process_its_config_as_json(tiny_model, tmp_path):
    from stack.stack import local_stack
    from trajectory_store.storage import StoreConfig

    store = StoreConfig(data_root=str(tmp_path / "data"), campaign="json-stack")
    with local_stack(tiny_model, store, engines=2, max_batch_size=3, step=4) as stack:
        admin = {"Authorization": f"Bearer {stack.admin_token}"}
        stats = httpx.get(f"{stack.gateway_url}/admin/stats", headers=admin, timeout=10).json()
        cards = [httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0] for url in stack.engine_urls]
        registration = httpx.post(
            f"{stack.gateway_url}/admin/executions",
            headers=admin,
            json={"execution_id": "json-1"},
            timeout=10,
        ).json()
        engine_stats = httpx.get(
            f"{stack.engine_urls[0]}/admin/stats",
            headers={"Authorization": f"Bearer {stack.engine_admin_token}"},
            timeout=10,
        )
        command_lines = child_command_lines()

    ports = [url.rsplit(":", 1)[1] for url in stack.engine_urls]
    assert sorted(e["engine_id"] for e in stats["engines"]) == sorted(f"rollout-{p}" for p in ports)
    assert [card["engine_id"] for card in cards] == [f"rollout-{p}" for p in ports]
    assert registration["step"] == 4 and registration["base_url"].startswith(stack.gateway_url)
    assert engine_stats.status_code == 200  # the engine got its admin token through the JSON
    servers = [line for line in command_lines if "--config -" in line]
    assert len(servers) == 3
    assert not [
        line for line in command_lines if stack.admin_token in line or stack.engine_admin_token in line
    ]


def _reuse_after_idle(url: str, idle_s: float) -> int | str:
    """GET /health on one connection, ``idle_s`` of quiet, GET /health again on it: the second status,
    or what went wrong (http.client opens no new connection behind our back: its socket is checked)."""
    import http.client
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request("GET", "/health")
        first = connection.getresponse()
        first.read()
        assert first.status == 200
        sock = connection.sock
        time.sleep(idle_s)
        try:
            connection.request("GET", "/health")
            second = connection.getresponse()
            second.read()
        except (OSError, http.client.HTTPException) as error:  # the server closed it
            return f"{type(error).__name__}: {error}"
        return second.status if connection.sock is sock else "a new connection"
    finally:
        connection.close()


@pytest.mark.slow
def test_the_servers_keep_an_idle_connection_longer_than_a_client_does(tiny_model, tmp_path):
    # httpx lets go of an idle connection after 5 s; a server that closes at the same 5 s races it and the
    # client's next request on that connection fails with ReadError (seen once in the elastic controller)
    from concurrent.futures import ThreadPoolExecutor

    from engines.net import KEEP_ALIVE_S
    from stack.stack import local_stack
    from trajectory_store.storage import StoreConfig

    client_keep_alive = httpx.Limits().keepalive_expiry
    assert 2 * client_keep_alive < KEEP_ALIVE_S
    with local_stack(tiny_model, StoreConfig(data_root=str(tmp_path / "data")), engines=1) as stack:
        urls = [stack.gateway_url, *stack.engine_urls]
        with ThreadPoolExecutor(len(urls)) as pool:
            answers = list(pool.map(lambda url: _reuse_after_idle(url, client_keep_alive + 1.5), urls))
    assert answers == [200] * len(urls)


def test_a_dead_servers_log_tail_keeps_its_error_and_drops_nanobinds_leak_lines():
    from stack.stack import log_tail

    leaks = "nanobind: leaked 4 instances!\n" + "".join(f' - leaked function "f{i}"\n' for i in range(300))
    text = "Traceback ...\nOSError: [Errno 98] Address already in use\nINFO:     Shutting down\n" + leaks
    tail = log_tail(text)
    assert "Address already in use" in tail and "leaked" not in tail
    assert log_tail("x" * 5000) == "x" * 2000  # still the end of a long log
