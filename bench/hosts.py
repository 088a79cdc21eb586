"""Beyond one machine, measured (issue 36): `gyre bench hosts [--quick]` writes bench/results/hosts.json.

    python -m bench.hosts [--quick] [--out FILE]

What it measures so far: a session's KV moved between two hosts over TCP against the importing
engine prefilling the same context again, at 8K and 32K tokens (quick: 8K). The exporting engine
serves the KV once over its own HTTP and the importing engine fetches it
(engines/rollout/migration.py `TcpTransport`; the gateway picks it for engines on different hosts).
The hosts are network namespaces the benchmark makes (bench/netns.py), one engine process in each,
one torch thread each; where the machine refuses namespaces, the two engines run on loopback ports
and `namespaces` is false.

Per size: the first engine prefills an N-token prompt in a session and samples one token (greedy);
then
- moved: the session's KV goes to the other engine (export + import, timed: `tcp_s`), which answers
  the next turn (the sampled token and one new token, 4 tokens out) from it (`moved_answer_s`);
- re-prefilled: the other engine answers the same next turn from scratch (`reprefill_answer_s`),
  as the gateway's fallback does when a KV cannot move (an engine dies, a transfer fails).
Both answers must be the same tokens (`same_answer`), and the moved one must have prefilled only
the turn's 2 new tokens. `speedup` = reprefill_answer_s / (tcp_s + moved_answer_s).

The model is the `tiny` preset (3M parameters, 4 layers, 2 KV heads of 64, float32: 4 KiB of KV a
token), generated locally, with its RoPE table set to 65,536 positions.

Not measured yet (issue 36): step time on 1 host against 3 of the same CPU budget, weight delivery
per version, recovery after a host is cut off, executions lost or trained twice, and bytes between
hosts per step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.netns import engine_on, hosts
from engines.admin import ENGINE_STATS, EXPORT_SESSION, IMPORT_SESSION
from engines.model.build import save_model_folder
from engines.model.config import ModelConfig

DEFAULT_OUT = "bench/results/hosts.json"
TOKEN = "bench-hosts-engine-token"
SIZES = (8192, 32768)
QUICK_SIZES = (8192,)
ROUNDS = 2  # every size measured this many times (quick: once); the medians are reported
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


def main(quick: bool = False, out: str = DEFAULT_OUT) -> int:
    started = time.perf_counter()
    sizes, rounds = (QUICK_SIZES, 1) if quick else (SIZES, ROUNDS)
    report: dict[str, Any] = {"quick": quick, "kv_migration": kv_migration(sizes, rounds)}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} ({report['wall_s']} s)")
    bad = [
        r["tokens"]
        for r in report["kv_migration"]["sizes"]
        if not (r["same_answer"] and r["fetched_bytes_match"])
    ]
    if bad:
        print(
            f"the moved session answered differently (or its bytes fell short) at {bad} tokens",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8K tokens only, one round")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    sys.exit(main(args.quick, args.out))
