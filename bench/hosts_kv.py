"""KV moved between two hosts over TCP against re-prefilling it: `gyre bench hosts`' `kv_migration` section.

bench/hosts.py's docstring says what is measured. `bench_model` makes the tiny preset with a
65,536-position RoPE table; `kv_round` is one measurement at one context size on two engines (one on
each host: bench/netns.py), through their HTTP and admin routes; `kv_migration` runs the rounds per
size and reports their medians. TOKEN is the admin token of every engine the benchmark starts.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.netns import engine_on, hosts
from engines.admin import ENGINE_STATS, EXPORT_SESSION, IMPORT_SESSION
from engines.model.build import save_model_folder
from engines.model.config import ModelConfig

TOKEN = "bench-hosts-engine-token"
POSITIONS = 65536


def bench_model(folder: str) -> str:
    """The tiny preset with a 65,536-position RoPE table (contexts of 32K tokens and more)."""
    save_model_folder(ModelConfig(preset="tiny", seed=0), folder)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = POSITIONS
    config_path.write_text(json.dumps(config, indent=1))
    return folder


def _post(client: httpx.Client, url: str, body: dict, admin: bool = False) -> dict:
    headers = {"authorization": f"Bearer {TOKEN}"} if admin else {}
    answer = client.post(url, json=body, headers=headers)
    if answer.status_code != 200:
        raise RuntimeError(f"POST {url}: HTTP {answer.status_code} {answer.text[:300]}")
    return answer.json()


def _complete(
    client: httpx.Client, url: str, prompt: list[int], max_tokens: int, session: str | None
) -> dict:
    body: dict[str, Any] = {
        "model": "gyre-policy",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    body.update(return_token_ids=True, logprobs=1)
    if session is not None:
        body["session_id"] = session
    return _post(client, f"{url}/v1/completions", body)["choices"][0]


def _stats(client: httpx.Client, url: str) -> dict:
    answer = client.get(ENGINE_STATS.url(url), headers={"authorization": f"Bearer {TOKEN}"})
    answer.raise_for_status()
    return answer.json()


def kv_round(client: httpx.Client, a_url: str, b_url: str, tokens: int, seed: int) -> dict[str, Any]:
    """One measurement at ``tokens`` tokens of context (see the module's docstring)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(16, 4000) for _ in range(tokens)]
    session = f"s{tokens}-{seed}"
    first = _complete(client, a_url, prompt, 1, session)
    turn = prompt + first["token_ids"] + [rng.randrange(16, 4000)]
    before = _stats(client, b_url)
    started = time.perf_counter()
    handle = _post(client, EXPORT_SESSION.url(a_url), {"session_id": session, "transport": "tcp"}, admin=True)
    _post(client, IMPORT_SESSION.url(b_url), {"handle": handle}, admin=True)
    tcp_s = time.perf_counter() - started
    started = time.perf_counter()
    moved = _complete(client, b_url, turn, 4, session)
    moved_answer_s = time.perf_counter() - started
    after = _stats(client, b_url)
    started = time.perf_counter()
    fresh = _complete(client, b_url, turn, 4, None)
    reprefill_answer_s = time.perf_counter() - started
    return {
        "kv_bytes": handle["nbytes"],
        "tcp_s": tcp_s,
        "moved_answer_s": moved_answer_s,
        "reprefill_answer_s": reprefill_answer_s,
        "moved_prefilled_tokens": after["prefilled_tokens"] - before["prefilled_tokens"],
        "fetched_bytes": after["kv_bytes_fetched"] - before["kv_bytes_fetched"],
        "same_answer": moved["token_ids"] == fresh["token_ids"],
    }


def kv_migration(sizes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-hosts-") as tmp:
        folder = bench_model(f"{tmp}/tiny-64k")
        with (
            hosts(["h1", "h2"]) as (h1, h2),
            engine_on(h1, folder, "A", TOKEN) as a_url,
            engine_on(h2, folder, "B", TOKEN) as b_url,
            httpx.Client(timeout=1800) as client,
        ):
            namespaces = h1.netns is not None
            rows = []
            for tokens in sizes:
                measured = [kv_round(client, a_url, b_url, tokens, seed) for seed in range(rounds)]
                tcp = statistics.median(m["tcp_s"] for m in measured)
                moved = statistics.median(m["moved_answer_s"] for m in measured)
                fresh = statistics.median(m["reprefill_answer_s"] for m in measured)
                row = {
                    "tokens": tokens,
                    "kv_bytes": measured[0]["kv_bytes"],
                    "tcp_s": round(tcp, 4),
                    "tcp_mb_per_s": round(measured[0]["kv_bytes"] / tcp / 1e6, 1),
                    "moved_answer_s": round(moved, 4),
                    "reprefill_answer_s": round(fresh, 3),
                    "speedup": round(fresh / (tcp + moved), 2),
                    "moved_prefilled_tokens": max(m["moved_prefilled_tokens"] for m in measured),
                    "fetched_bytes_match": all(m["fetched_bytes"] == m["kv_bytes"] for m in measured),
                    "same_answer": all(m["same_answer"] for m in measured),
                    "rounds": [
                        {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}
                        for m in measured
                    ],
                }
                print(
                    f"kv {tokens:6d} tokens  {row['kv_bytes'] / 2**20:7.1f} MiB  over tcp {row['tcp_s']:7.3f} s "
                    f"({row['tcp_mb_per_s']:7.1f} MB/s) + answer {row['moved_answer_s']:6.3f} s  "
                    f"re-prefill + answer {row['reprefill_answer_s']:8.2f} s  {row['speedup']:7.1f}x  "
                    f"same answer {row['same_answer']}  prefilled after the move {row['moved_prefilled_tokens']}",
                    flush=True,
                )
                rows.append(row)
    return {"hosts": 2, "namespaces": namespaces, "sizes": rows}
