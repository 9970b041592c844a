"""A request's KV cache moved between engines (disaggregated prefill and decode, `llmc serve
--disaggregate`): the prefill engine packs the prompt's blocks of a request whose first token it
sampled into one tensor and frees them (full ones stay in its prefix cache); the decode engine takes
the request in with blocks of its own (Engine.add_prefilled) and unpacks the tensor into them.
Messages between the processes (pickled objects: they come only from the processes this server
started) and the packed blocks go over torch.distributed point to point: gloo between CPUs, NCCL
between GPUs.

Not done: sending the KV while the prefill runs (Mooncake's layer-wise transfer). What it would take:
  - a point where a layer's KV of the step is final: the executor runs a step's layers in one call, so
    it needs a per-layer hook (runtime/executor.py) or, more simply, the step boundary of a chunked
    prefill: after each chunk the prompt's completed full blocks are final and could go while the next
    chunk computes (no executor change; only the last chunk's blocks then wait for the first token);
  - a handoff in parts: "begin" (request, decode engine, block count) before the prefill ends, KV
    slices (layers or blocks) as they are final, then "first token" with the sampling state; the
    decode engine assembles the parts in host memory and takes the request in on the last one;
  - the router's stages overlapping (a request in prefill and in transfer at once): an abort or a
    dead engine must then end both parts, and the decode engine drop a half-received request;
  - the prefix-cache answer before the first part (the decode engine's held blocks are not sent).
On this CPU build (gloo, two cores shared by the engines) a send competes with the prefill for the same
cores, so the overlap would save little; it pays with NCCL between GPUs, where copies run beside
compute."""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmc.runtime.outputs import Logprob
from llmc.runtime.sampling_params import SamplingParams


@dataclass
class Handoff:
    """A prefilled request as the decode engine needs it; its KV follows as a tensor of `kv_shape`
    (uint8: PagedKVCache.export_blocks' [2, layers, blocks, block bytes]) less the leading blocks the
    decode engine's prefix cache holds: the blocks after `expect_held` at once, then, once the decode
    engine has said how many it holds, those of the first `expect_held` it lacks."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    first_token: int
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    generator_state: torch.Tensor | None   # a seeded request's generator after its first draw
    num_cached_tokens: int                 # prompt tokens the prefill engine's prefix cache served
    kv_shape: tuple[int, ...]
    pack_seconds: float                    # gathering the blocks on the prefill engine
    # the leading blocks the router expects the decode engine to hold: the blocks after these are sent
    # at once, without waiting for its answer (Channel users: the disaggregated engine's _send_kv)
    expect_held: int = 0

    @property
    def kv_bytes(self) -> int:
        return math.prod(self.kv_shape)


def can_hand_off(engine, request_id: str) -> bool:
    """Whether the request has its first token, from one sample, and runs on (hand it off now)."""
    req = engine.requests.get(request_id)
    return (req is not None and not req.finished and len(req.samples) == 1
            and req.samples[0].seq.num_output_tokens == 1 and req.samples[0].seq.num_uncomputed_tokens == 1)


def export_request(engine, request_id: str) -> tuple[Handoff, torch.Tensor]:
    """The request (can_hand_off) as a Handoff and its prompt's KV blocks packed; it leaves `engine`,
    its blocks freed."""
    started = time.perf_counter()
    req = engine.requests[request_id]
    sample = req.samples[0]
    seq = sample.seq
    blocks = seq.block_table[:-(-seq.num_prompt_tokens // engine.config.block_size)]
    kv = engine.cache.export_blocks(blocks)
    generator = sample.state.generator
    handoff = Handoff(request_id, req.prompt, req.prompt_token_ids, req.params, seq.priority, seq.last_token,
                      sample.logprobs, sample.cumulative_logprob,
                      None if generator is None else generator.get_state(), seq.num_cached_tokens,
                      tuple(kv.shape), 0.0)
    engine.abort(request_id)
    handoff.pack_seconds = time.perf_counter() - started
    return handoff, kv


class Channel:
    """Pickled messages to and from other ranks on a gloo `group` (None: the default one): a message
    is its length (int64) and then its bytes (uint8). Sends to one rank are serialised, so a
    message's two parts stay together whichever thread sends; each rank is read by one thread."""

    def __init__(self, group=None):
        self.group = group
        self._locks: dict[int, threading.Lock] = defaultdict(threading.Lock)

    def send(self, dst: int, message) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        with self._locks[dst]:
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=self.group)
            dist.send(data, dst, group=self.group)

    def recv(self, src: int):
        """The next message from `src`; a RuntimeError once `src` is gone (its connection closed)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src, group=self.group)
        return pickle.loads(data.numpy().tobytes())


def send_kv(dst: int, kv: torch.Tensor, group) -> None:
    dist.send(kv.contiguous(), dst, group=group)


def recv_kv(src: int, shape: tuple[int, ...], device: torch.device, group) -> torch.Tensor:
    kv = torch.empty(shape, dtype=torch.uint8, device=device)
    dist.recv(kv, src, group=group)
    return kv


__all__ = ["Channel", "Handoff", "can_hand_off", "export_request", "recv_kv", "send_kv"]
