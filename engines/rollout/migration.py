"""KV migration: a session's context, KV cache and in-flight decode state, moved between engines.

    state = engine_a.export_session("s1")      # SessionState; the session leaves engine A
    handle = transport.send(state)             # small, JSON-able; travels over any control channel
    engine_b.import_session(transport.receive(handle))   # B decodes on exactly where A stopped

A `SessionState` holds the session's tokens, per-layer KV tensors [kv_heads, tokens, head_dim] and,
if a request is mid-decode, its `DecodeState`: the output ids, logprobs and policy versions so far,
the sampling params and the state of the request's torch.Generator (a CPU byte tensor, so a sampled
request continues with the very random numbers it would have drawn on A). B feeds the last sampled
token on its next step: it prefills none of the migrated context (stats.prefilled_tokens unchanged).

On the wire a state is ONE contiguous byte buffer (tokens, then keys/values of every layer, then the
generator state, each at a 64-byte aligned offset) plus a small JSON header describing it (`pack`,
`unpack`). Transports:

    ShmTransport    same host: the buffer is a file in /dev/shm (tmpfs, RAM only); the handle is its path.
                    receive maps it (torch.from_file), unpacks zero-copy views and unlinks the file.
    TorchIpcTransport  same device, another process: the KV is copied once into one tensor on the
                    exporter's device and shared through torch.multiprocessing (a CUDA IPC handle on a
                    GPU: nothing crosses the host; CPU shared memory elsewhere).
    GlooTransport   any two hosts: a torch.distributed ProcessGroupGloo built from a TCPStore +
                    PrefixStore (no global init_process_group); the header goes through the store,
                    the buffer through one point-to-point send/recv. Both engines must join the
                    same group first, which the gateway's migrations do not do.
    TcpTransport    any two hosts, no rendezvous: the exporting engine keeps the buffer and its
                    handle names the URL that serves it once (GET /admin/kv/{key} on the engine's
                    own HTTP server); the importing engine streams it from there. What the engines
                    and the gateway use between hosts (SessionExport.transport = "tcp").

An RDMA transport (NIXL, UCX) implements the same two methods: ``send`` registers the KV buffers with
the NIC (no packing copy: one descriptor per layer tensor, or the engine's KV pool registered once)
and returns a handle carrying the remote memory descriptors; ``receive`` issues one-sided READs into
the importing engine's pre-registered KV pool and completes on the transfer notification. The engine
side (export_session / import_session and the SessionState layout) stays unchanged.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import struct
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from pydantic import BaseModel

from engines.rollout.kv import KVShape
from engines.rollout.messages import GenerateRequest
from engines.rollout.state import RequestState

_MAGIC = b"GYREKV01"
_ALIGN = 64
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)
}


@dataclass
class DecodeState:
    """A request in flight: everything needed to continue sampling it bit-exactly elsewhere."""

    request: GenerateRequest
    output_ids: list[int]
    output_logprobs: list[float]
    policy_versions: list[int]
    generator_state: bytes  # torch.Generator.get_state() of the request's CPU generator
    cached_prompt_tokens: int
    prefilled_tokens: int
    started: bool

    @classmethod
    def capture(cls, state: RequestState) -> DecodeState:
        return cls(
            request=state.request,
            output_ids=list(state.output_ids),
            output_logprobs=list(state.output_logprobs),
            policy_versions=list(state.policy_versions),
            generator_state=state.generator.get_state().numpy().tobytes(),
            cached_prompt_tokens=state.cached_prompt_tokens,
            prefilled_tokens=state.prefilled_tokens,
            started=state.started,
        )

    def restore(self, session_key: str) -> RequestState:
        generator = torch.Generator(device="cpu")
        generator.set_state(torch.frombuffer(bytearray(self.generator_state), dtype=torch.uint8))
        return RequestState(
            self.request,
            generator,
            session_key,
            list(self.output_ids),
            list(self.output_logprobs),
            list(self.policy_versions),
            self.cached_prompt_tokens,
            self.prefilled_tokens,
            self.started,
            migrated=True,
        )


@dataclass
class SessionState:
    """One session as it leaves an engine. ``kv`` is None when the session held no KV (evicted or
    asleep): the importer then recomputes it from ``tokens``. Tensors may be views of the exporting
    engine's buffers (no copy); a transport copies them once."""

    session_id: str
    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer [kv_heads, len(tokens), head_dim]
    signature: dict  # layers, kv_heads, head_dim, dtype of the exporting model
    policy_version: int  # the exporter's version (its KV was computed by this or older weights)
    source_engine_id: str
    ephemeral: bool = False
    decode: DecodeState | None = None

    @property
    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv or [])

    def check_compatible(self, shape: KVShape) -> None:
        """Layers, KV heads and head dim must match the importer's model (the dtype may differ)."""
        mine = {k: v for k, v in shape.signature().items() if k != "dtype"}
        theirs = {k: self.signature.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(
                f"session {self.session_id!r} comes from a model with KV shape {theirs}, not {mine}"
            )


def pack(state: SessionState) -> tuple[dict, list[tuple[int, torch.Tensor]]]:
    """The JSON header and (offset, CPU uint8 tensor) pieces of the one contiguous buffer."""
    tensors = [torch.tensor(state.tokens, dtype=torch.int64)]
    for k, v in state.kv or []:
        tensors += [k, v]
    if state.decode is not None:
        tensors.append(torch.frombuffer(bytearray(state.decode.generator_state), dtype=torch.uint8))
    specs, pieces, offset = [], [], 0
    for tensor in tensors:
        data = tensor.detach().to("cpu").contiguous()
        specs.append(
            {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape), "offset": offset}
        )
        raw = data.reshape(-1).view(torch.uint8)
        pieces.append((offset, raw))
        offset = -(-(offset + raw.numel()) // _ALIGN) * _ALIGN
    decode = None
    if state.decode is not None:
        d = state.decode
        decode = {
            "request": d.request.model_dump(mode="json"),
            "output_ids": d.output_ids,
            "output_logprobs": d.output_logprobs,
            "policy_versions": d.policy_versions,
            "cached_prompt_tokens": d.cached_prompt_tokens,
            "prefilled_tokens": d.prefilled_tokens,
            "started": d.started,
        }
    header = {
        "session_id": state.session_id,
        "signature": state.signature,
        "policy_version": state.policy_version,
        "source_engine_id": state.source_engine_id,
        "ephemeral": state.ephemeral,
        "has_kv": state.kv is not None,
        "decode": decode,
        "tensors": specs,
        "nbytes": offset,
    }
    return header, pieces


def unpack(header: dict, buffer: torch.Tensor) -> SessionState:
    """Inverse of pack; the tensors are views of ``buffer`` (uint8, header['nbytes'] long)."""
    views = []
    for spec in header["tensors"]:
        dtype = _DTYPES[spec["dtype"]]
        n = torch.Size(spec["shape"]).numel() * torch.empty((), dtype=dtype).element_size()
        views.append(buffer[spec["offset"] : spec["offset"] + n].view(dtype).view(spec["shape"]))
    tokens = views[0].tolist()
    kv = None
    if header["has_kv"]:
        layers = header["signature"]["layers"]
        kv = [(views[1 + 2 * i], views[2 + 2 * i]) for i in range(layers)]
    decode = None
    if header["decode"] is not None:
        d = dict(header["decode"])
        d["request"] = GenerateRequest.model_validate(d["request"])
        decode = DecodeState(generator_state=views[-1].numpy().tobytes(), **d)
    return SessionState(
        session_id=header["session_id"],
        tokens=tokens,
        kv=kv,
        signature=header["signature"],
        policy_version=header["policy_version"],
        source_engine_id=header["source_engine_id"],
        ephemeral=header["ephemeral"],
        decode=decode,
    )


class KVTransport(ABC):
    """Moves a SessionState between engines: ``send`` returns a small JSON-able handle that the
    receiving side passes to ``receive`` (over HTTP, a queue, the gateway...)."""

    @abstractmethod
    def send(self, state: SessionState) -> BaseModel: ...

    @abstractmethod
    def receive(self, handle: BaseModel) -> SessionState: ...


class ShmHandle(BaseModel):
    kind: Literal["shm"] = "shm"
    path: str
    nbytes: int
    session_id: str


class ShmTransport(KVTransport):
    """Same host: one file in /dev/shm (or the temp dir where /dev/shm is missing) per state:
    8-byte magic, 8-byte header length, JSON header, then the buffer at a 64-byte aligned offset.
    ``receive`` consumes the file (it is unlinked once mapped)."""

    def __init__(self, directory: str | None = None):
        default = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        self.directory = directory or default

    def send(self, state: SessionState) -> ShmHandle:
        header, pieces = pack(state)
        head = json.dumps(header).encode()
        start = -(-(16 + len(head)) // _ALIGN) * _ALIGN
        path = os.path.join(self.directory, f"gyre-kv-{uuid.uuid4().hex}.bin")
        with open(path + ".tmp", "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(head)) + head)
            for offset, raw in pieces:
                f.seek(start + offset)
                f.write(memoryview(raw.numpy()))
            f.truncate(start + header["nbytes"])
        os.replace(path + ".tmp", path)  # a reader never sees a half-written file
        return ShmHandle(path=path, nbytes=start + header["nbytes"], session_id=state.session_id)

    def receive(self, handle: ShmHandle) -> SessionState:
        with open(handle.path, "rb") as f:
            prefix = f.read(16)
            if prefix[:8] != _MAGIC:
                raise ValueError(f"{handle.path} is not a KV migration file")
            (length,) = struct.unpack("<Q", prefix[8:])
            header = json.loads(f.read(length))
        start = -(-(16 + length) // _ALIGN) * _ALIGN
        mapped = torch.from_file(handle.path, shared=False, size=handle.nbytes, dtype=torch.uint8)
        os.unlink(handle.path)
        return unpack(header, mapped[start:])


class TorchIpcHandle(BaseModel):
    kind: Literal["torch_ipc"] = "torch_ipc"
    header: dict  # pack's header of the state without its KV (tokens, decode state)
    meta: str  # base64 of that header's small buffer (tokens, generator state)
    payload: str  # base64 of the pickled KV buffer: a CUDA IPC memory handle, or a shared-memory fd on CPU
    session_id: str


class TorchIpcTransport(KVTransport):
    """Another process on the same device: the KV is copied ONCE into one tensor [layers, 2, kv_heads,
    tokens, head_dim] on the exporter's device and shared through torch.multiprocessing's reductions
    (CUDA IPC on a GPU: the importer maps the exporter's memory, nothing crosses the host). The
    importer's import_session copies it into its own cache. The exporter keeps each buffer until
    ``release`` (call it once the importer said it is done)."""

    def __init__(self) -> None:
        import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

        self._sent: dict[str, torch.Tensor] = {}

    def send(self, state: SessionState) -> TorchIpcHandle:
        from multiprocessing.reduction import ForkingPickler

        header, pieces = pack(dataclasses.replace(state, kv=None))
        meta = bytearray(header["nbytes"])
        for offset, raw in pieces:
            meta[offset : offset + raw.numel()] = raw.numpy().tobytes()
        payload = b""
        if state.kv is not None:
            keys = state.kv[0][0]
            buffer = torch.empty((len(state.kv), 2, *keys.shape), dtype=keys.dtype, device=keys.device)
            for layer, (k, v) in enumerate(state.kv):
                buffer[layer, 0].copy_(k)
                buffer[layer, 1].copy_(v)
            payload = bytes(ForkingPickler.dumps(buffer))
            self._sent[state.session_id] = buffer
        return TorchIpcHandle(
            header=header,
            meta=base64.b64encode(bytes(meta)).decode(),
            payload=base64.b64encode(payload).decode(),
            session_id=state.session_id,
        )

    def receive(self, handle: TorchIpcHandle) -> SessionState:
        meta = torch.frombuffer(bytearray(base64.b64decode(handle.meta)), dtype=torch.uint8)
        state = unpack(handle.header, meta)
        if handle.payload:
            buffer = pickle.loads(base64.b64decode(handle.payload))
            state.kv = [(buffer[layer, 0], buffer[layer, 1]) for layer in range(buffer.shape[0])]
        return state

    def release(self, session_id: str | None = None) -> None:
        """Drops the buffer sent for ``session_id`` (every buffer when None)."""
        if session_id is None:
            self._sent.clear()
        else:
            self._sent.pop(session_id, None)


class GlooHandle(BaseModel):
    kind: Literal["gloo"] = "gloo"
    src: int
    tag: int
    nbytes: int
    session_id: str


class GlooTransport(KVTransport):
    """A point-to-point link between two ranks over gloo (TCP). Rank 0 hosts the TCPStore.
    ``send`` posts the transfer and returns at once; the receiver's ``receive`` completes it
    (call ``wait_sent`` on the sender before dropping the transport)."""

    def __init__(
        self,
        rank: int,
        peer: int,
        port: int,
        host: str = "127.0.0.1",
        world_size: int = 2,
        timeout_s: float = 120,
    ):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.peer = rank, peer
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("gyre-kv", self.store)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        self._next_tag = 0
        self._in_flight: list[tuple[object, torch.Tensor]] = []

    def send(self, state: SessionState) -> GlooHandle:
        header, pieces = pack(state)
        flat = torch.zeros(header["nbytes"], dtype=torch.uint8)
        for offset, raw in pieces:
            flat[offset : offset + raw.numel()] = raw
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        self.store.set(f"header/{self.rank}/{tag}", json.dumps(header))
        self._in_flight.append((self.group.send([flat], self.peer, tag), flat))
        return GlooHandle(src=self.rank, tag=tag, nbytes=flat.numel(), session_id=state.session_id)

    def receive(self, handle: GlooHandle) -> SessionState:
        key = f"header/{handle.src}/{handle.tag}"
        header = json.loads(self.store.get(key))
        flat = torch.empty(handle.nbytes, dtype=torch.uint8)
        self.group.recv([flat], handle.src, handle.tag).wait()
        self.store.delete_key(key)
        return unpack(header, flat)

    def wait_sent(self) -> None:
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()


class TcpHandle(BaseModel):
    kind: Literal["tcp"] = "tcp"
    url: str  # GET it once, with the engines' admin token, for the buffer
    header: dict  # pack's header
    nbytes: int
    session_id: str


class TcpTransport(KVTransport):
    """Any two hosts, over the engines' own HTTP (TCP): ``offer`` keeps the packed buffer in the
    exporting engine's memory and returns a handle with the URL that serves it once
    (GET /admin/kv/{key} of that engine, behind the engines' admin token); the importing engine's
    ``receive`` streams it into one buffer and unpacks it. A buffer nobody fetched within ``ttl_s``
    is dropped at the next offer (the export it belonged to is lost: the gateway re-runs that
    session's context on the target instead). The handle is small and JSON-able like the others,
    so the gateway passes it through unread; it carries no tensor."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        ttl_s: float = 300.0,
        timeout_s: float = 120.0,
    ):
        self.base_url, self.token, self.ttl_s, self.timeout_s = base_url, token, ttl_s, timeout_s
        self._offered: dict[str, tuple[float, bytearray]] = {}

    def offer(self, state: SessionState, base_url: str) -> TcpHandle:
        """The buffer, kept under a new key; the handle names ``base_url``'s route that serves it."""
        now = time.monotonic()
        for key in [k for k, (t, _) in self._offered.items() if now - t > self.ttl_s]:
            del self._offered[key]
        header, pieces = pack(state)
        buffer = bytearray(header["nbytes"])
        view = memoryview(buffer)
        for offset, raw in pieces:
            view[offset : offset + raw.numel()] = raw.numpy().tobytes()
        key = uuid.uuid4().hex
        self._offered[key] = (now, buffer)
        return TcpHandle(
            url=f"{base_url.rstrip('/')}/admin/kv/{key}",
            header=header,
            nbytes=len(buffer),
            session_id=state.session_id,
        )

    def send(self, state: SessionState) -> TcpHandle:
        """``offer`` at this transport's ``base_url`` (the engine's address as its peers reach it)."""
        if self.base_url is None:
            raise ValueError("TcpTransport.send needs base_url: the address its peers fetch the KV from")
        return self.offer(state, self.base_url)

    def take(self, key: str) -> bytearray | None:
        """The buffer offered under ``key``, once (the server's GET /admin/kv/{key})."""
        offered = self._offered.pop(key, None)
        return None if offered is None else offered[1]

    def receive(self, handle: TcpHandle) -> SessionState:
        import httpx

        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        buffer = bytearray(handle.nbytes)
        filled = 0
        with httpx.stream("GET", handle.url, headers=headers, timeout=self.timeout_s) as answer:
            if answer.status_code != 200:
                answer.read()
                raise ValueError(
                    f"KV of session {handle.session_id} at {handle.url}: HTTP {answer.status_code} {answer.text[:200]}"
                )
            for chunk in answer.iter_bytes(1 << 20):
                if filled + len(chunk) > handle.nbytes:
                    raise ValueError(
                        f"KV of session {handle.session_id}: more than the {handle.nbytes} bytes announced"
                    )
                buffer[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
        if filled != handle.nbytes:
            raise ValueError(f"KV of session {handle.session_id}: {filled} of {handle.nbytes} bytes arrived")
        return unpack(handle.header, torch.frombuffer(buffer, dtype=torch.uint8))
