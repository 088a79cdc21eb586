"""KV migration: a request moved mid-decode continues exactly as if it had never moved, and the importing
engine prefills none of the migrated context. In one process, and across two processes (shm, gloo)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from engines.net import free_port
from engines.rollout import EngineConfig, GenerateRequest, RolloutEngine, SamplingParams, ShmTransport
from engines.rollout.migration import GlooTransport, TorchIpcHandle, TorchIpcTransport, pack, unpack
from tests.test_rollout_fixtures import VOCAB, tiny_policy

K = 7  # tokens produced on engine A before the move
SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=25)

pytestmark = pytest.mark.usefixtures("one_thread")


def request(rid: str = "m") -> GenerateRequest:
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    return GenerateRequest(request_id=rid, session_id="s", prompt_ids=ids, sampling=SAMPLING)


def run_until_k_tokens(engine: RolloutEngine) -> None:
    engine.add_request(request())
    engine.add_request(GenerateRequest(request_id="other", prompt_ids=[1, 2, 3], sampling=SAMPLING))
    for _ in range(K - 1):  # the first step prefills and decodes: K tokens after K - 1 steps
        assert engine.step() == []
    assert len(engine.running[0].output_ids) == K


def finish(engine: RolloutEngine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_in_process_migration_mid_decode_is_exact():
    model = tiny_policy()
    unmigrated = RolloutEngine(model, EngineConfig()).generate([request()])[0]
    a = RolloutEngine(model, EngineConfig(engine_id="A"))
    b = RolloutEngine(tiny_policy(), EngineConfig(engine_id="B"))
    run_until_k_tokens(a)
    state = a.export_session("s")
    assert state.decode is not None and len(state.decode.output_ids) == K
    assert len(state.tokens) == 40 + K - 1 and state.kv[0][0].shape == (2, 40 + K - 1, 8)
    b.import_session(state)
    migrated = finish(b)["m"]
    assert migrated.output_ids == unmigrated.output_ids
    torch.testing.assert_close(
        torch.tensor(migrated.output_logprobs), torch.tensor(unmigrated.output_logprobs)
    )
    assert b.stats.prefilled_tokens == 0 and b.stats.migrations_in == 1 and migrated.migrated
    assert migrated.engine_id == "B" and migrated.prefilled_tokens == 40  # A's prefill, carried along
    left = finish(a)
    assert left["m"].finish_reason == "migrated" and len(left["m"].output_ids) == K
    assert left["other"].finish_reason == "length"  # A's other request was not disturbed
    assert "s" not in a.sessions and a.stats.migrations_out == 1
    # the session lives on B now: its next turn prefills only the new suffix
    turn2 = request().prompt_ids + migrated.output_ids + [5, 6, 7]
    follow = b.generate([GenerateRequest(request_id="m2", session_id="s", prompt_ids=turn2)])[0]
    assert follow.prefilled_tokens == 4 and follow.cached_prompt_tokens == len(turn2) - 4


def test_idle_session_over_shm_in_process_and_bf16_pack_roundtrip():
    model = tiny_policy()
    a, b = RolloutEngine(model, EngineConfig()), RolloutEngine(model, EngineConfig())
    first = a.generate([request()])[0]
    handle = ShmTransport().send(a.export_session("s"))
    state = ShmTransport().receive(handle)
    assert state.decode is None and len(state.tokens) == 40 + 25 - 1
    b.import_session(state)
    turn2 = request().prompt_ids + first.output_ids + [9]
    out = b.generate([GenerateRequest(request_id="t2", session_id="s", prompt_ids=turn2)])[0]
    assert out.prefilled_tokens == 2 and b.stats.cached_tokens == len(turn2) - 2
    state.kv = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in state.kv]
    header, pieces = pack(state)
    flat = torch.zeros(header["nbytes"], dtype=torch.uint8)
    for offset, raw in pieces:
        flat[offset : offset + raw.numel()] = raw
    back = unpack(header, flat)
    assert back.tokens == state.tokens and back.kv[1][1].dtype == torch.bfloat16
    assert torch.equal(back.kv[1][1], state.kv[1][1])


def test_torch_ipc_transport_moves_a_request_mid_decode_exactly():
    """The transport for CUDA IPC, here over CPU shared memory: a request moved after K tokens
    continues exactly as if it had never moved, and B prefills none of the context."""
    model = tiny_policy()
    unmigrated = RolloutEngine(model, EngineConfig()).generate([request()])[0]
    a = RolloutEngine(model, EngineConfig(engine_id="A"))
    b = RolloutEngine(model, EngineConfig(engine_id="B"))
    run_until_k_tokens(a)
    transport = TorchIpcTransport()
    handle = transport.send(a.export_session("s"))
    wire = TorchIpcHandle.model_validate_json(handle.model_dump_json())  # JSON-able, as a gateway sends it
    b.import_session(transport.receive(wire))
    transport.release("s")
    prefilled = b.stats.prefilled_tokens
    migrated = finish(b)["m"]
    assert migrated.migrated
    assert migrated.output_ids == unmigrated.output_ids
    assert b.stats.prefilled_tokens == prefilled == 0  # the moved context was not recomputed


def _engine_b(model_dir: str, port: int, handles, results) -> None:
    """Process B: receive a session over shm, then one over gloo; finish each request, report."""
    torch.set_num_threads(1)
    gloo = GlooTransport(rank=1, peer=0, port=port)
    for transport in (ShmTransport(), gloo):
        engine = RolloutEngine(model_dir, EngineConfig(engine_id="B"))
        engine.import_session(transport.receive(handles.get(timeout=60)))
        out = finish(engine)["m"]
        stats = engine.stats
        results.put((out.output_ids, out.output_logprobs, stats.prefilled_tokens, stats.migrations_in))


def test_migration_across_two_processes_over_shm_then_gloo(tmp_path):
    model = tiny_policy()
    model.save_pretrained(tmp_path / "hf")
    unmigrated = RolloutEngine(model, EngineConfig()).generate([request()])[0]
    context = multiprocessing.get_context("spawn")
    handles, results = context.Queue(), context.Queue()
    port = free_port()
    child = context.Process(target=_engine_b, args=(str(tmp_path / "hf"), port, handles, results))
    child.start()
    try:
        gloo = GlooTransport(rank=0, peer=1, port=port)
        for transport in (ShmTransport(), gloo):
            a = RolloutEngine(str(tmp_path / "hf"), EngineConfig(engine_id="A"))
            run_until_k_tokens(a)
            handles.put(transport.send(a.export_session("s")))
            output_ids, logprobs, prefilled, migrations_in = results.get(timeout=120)
            assert output_ids == unmigrated.output_ids, type(transport).__name__
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(unmigrated.output_logprobs))
            assert prefilled == 0 and migrations_in == 1
        gloo.wait_sent()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
