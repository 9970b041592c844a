"""Starting a disaggregated server's engines: the options each engine loads with, the engine processes
on this machine (or, under torchrun, those already running elsewhere), the process group they join
with the router, and their shutdown."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.device import resolve_device
from llmc.runtime.engine import EngineConfig
from llmc.runtime.kv_transfer import Channel
from llmc.runtime.parallel.group import free_port, wait_loaded
from llmc.runtime.server.disaggregate.front import RoutedModel
from llmc.runtime.server.disaggregate.group import ROUTER, Roles, join_groups, parse_roles
from llmc.runtime.server.disaggregate.metrics import DisaggregateMetrics
from llmc.runtime.server.disaggregate.router import Router
from llmc.runtime.threads import resolve_threads

# set by __main__ under torchrun: every rank is already running, join by its env rendezvous
rendezvous: str | None = None
# serve's options that need what only a colocated engine has, and what to do instead
REFUSED = {
    "--semantic-cache-threshold": "its embeddings are the served model's hidden states, which only the engines "
                                  "have; serve without --disaggregate to use it (--result-cache works with both)",
}


@dataclass
class Engines:
    """The router's side of started engines: the model for the server's front, the core, and the
    processes started on this machine (none under torchrun)."""
    model: RoutedModel
    core: Router
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)

    def close(self) -> None:
        self.core.stop()
        stop_processes(self.processes)


def engine_options(roles: Roles, options: dict, refused: dict) -> dict:
    """Each engine's llmc.load options: --threads (the machine's) split between the engines; serve's
    options that do not combine with --disaggregate (`refused`: flag -> value) are an error."""
    given = [flag for flag, value in refused.items() if value is not None]
    if given:
        raise RuntimeLlmcError(f"{given[0]} does not combine with --disaggregate: {REFUSED[given[0]]}")
    threads = max(1, resolve_threads(options.get("threads")) // (roles.prefill + roles.decode))
    return options | {"threads": threads}


def options_of(roles: Roles, rank: int, options: dict) -> dict:
    """Engine `rank`'s options: only decode engines speculate (a prefill engine samples one token)."""
    return options if roles.role(rank) == "decode" else {k: v for k, v in options.items() if k != "speculative"}


def start_engines(path, roles_text: str, served_name: str, max_queue: int, options: dict,
                  refused: dict | None = None, ttft_slo_ms: float | None = None) -> Engines:
    """Parse --disaggregate, start the engine processes (on this machine; under torchrun, join those
    already running), and make the router (which refuses requests predicted to miss `ttft_slo_ms`)."""
    roles = parse_roles(roles_text)
    options = engine_options(roles, options, refused or {})
    model = RoutedModel(path)
    backend = _kv_backend(model, options, roles)
    processes, port = ({}, None) if rendezvous is not None else _start_processes(path, roles, options)
    try:
        join_groups(ROUTER, roles.world, rendezvous or f"tcp://127.0.0.1:{port}", backend)
    except BaseException:
        stop_processes(processes)
        raise
    metrics = DisaggregateMetrics(served_name, roles)
    router = Router(roles, Channel(), metrics, max_queue, options.get("max_num_seqs", 64), processes, ttft_slo_ms,
                    options.get("block_size", EngineConfig.block_size), options.get("enable_prefix_caching", True))
    return Engines(model, router, processes)


def _kv_backend(model: RoutedModel, options: dict, roles: Roles) -> str:
    device = resolve_device(model.manifest, options.get("device"), model.path)
    if device.type != "cuda":
        return "gloo"
    engines = roles.prefill + roles.decode
    if rendezvous is None and torch.cuda.device_count() < engines:
        raise RuntimeLlmcError(f"--disaggregate {roles}: {engines} engines need a GPU each, this machine has "
                               f"{torch.cuda.device_count()}")
    return "nccl"


def _start_processes(path, roles: Roles, options: dict) -> tuple[dict[int, subprocess.Popen], int]:
    """The engine processes, each loaded (or the error that stopped one), and their rendezvous port."""
    port = free_port()
    procs = {}
    try:
        for rank in roles.engine_ranks:
            own = json.dumps(options_of(roles, rank, options))
            command = [sys.executable, "-m", "llmc.runtime.server.disaggregate.engine", f"--rank={rank}",
                       f"--port={port}", f"--roles={roles}", f"--options={own}", str(path)]
            procs[rank] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        wait_loaded(procs, roles.name)
    except BaseException:
        stop_processes(procs)
        raise
    return procs, port


def stop_processes(procs: dict[int, subprocess.Popen]) -> None:
    """Close the engines' stdin (they exit at its end), then wait for them; kill what stays."""
    for p in procs.values():
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()
