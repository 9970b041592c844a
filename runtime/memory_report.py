"""What a loaded model holds in memory, as `llmc bench` and `llmc inspect --memory` print it: the process's
resident memory (RSS) split into weights (the pages of the artifact's weights file the kernels read as
stored; the copies they read instead: 4-bit weights in the AMX GEMM's tiles, ONNX Runtime initializers
made by a transform; what ONNX Runtime's sessions hold of their own, its packed weights, measured as they
were built), the KV cache, activations (the native decode arena, the dequantisation scratch) and the rest
(Python, torch, the tokenizer, freed activations the heap keeps for the next step). `expected` says what
a load will hold, from the artifact's plan alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from llmc.codegen.native import cpu_native
from llmc.codegen.torch_cpu.cpu_qlinear_dense import scratch_bytes
from llmc.compiler.schemes import NATIVE, SCHEMES
from llmc.runtime.block_manager import num_blocks_for_budget, parse_bytes
from llmc.runtime.host_memory import cpu_tensors, file_mappings, resident_bytes

# qlinear schemes the native GEMV reads (cpu_qlinear_native.py): the native family's packed ones
NATIVE_4BIT = tuple(s.name for s in SCHEMES.values() if NATIVE in s.families and s.packed)


@dataclass(frozen=True)
class MemorySplit:
    """Bytes of the process's RSS by what holds them."""
    rss: int
    weights_mapped: int      # resident pages of the weights files' mappings: weights read as stored
    weights_file: int        # the mapped weights' bytes, resident or not
    weights_repacked: int    # copies made at load that the kernels read instead of the stored weights
    weights_ort: int         # what ONNX Runtime's sessions hold of their own (their packed weights), measured at load
    kv_cache: int            # its resident pages: a CPU cache's pages are zero-filled as tokens first fill them
    kv_cache_allocated: int
    activations: int         # the native decode arena and the dequantisation scratch

    @property
    def rest(self) -> int:
        return (self.rss - self.weights_mapped - self.weights_repacked - self.weights_ort - self.kv_cache
                - self.activations)

    def to_dict(self) -> dict:
        return {**asdict(self), "rest": self.rest}

    def line(self) -> str:
        return memory_line(self.to_dict())


def memory_line(split: dict) -> str:
    """One line of a MemorySplit's dict (as `llmc bench --json` holds it)."""
    ort = f" + {_mib(split['weights_ort'])} in ONNX Runtime" if split["weights_ort"] else ""
    return (f"RSS {_mib(split['rss'])}: weights {_mib(split['weights_mapped'])} mapped (of "
            f"{_mib(split['weights_file'])} in the file) + {_mib(split['weights_repacked'])} repacked{ort}, KV cache "
            f"{_mib(split['kv_cache'])} (of {_mib(split['kv_cache_allocated'])}), activations "
            f"{_mib(split['activations'])}, rest {_mib(split['rest'])}")


def measure(engine) -> MemorySplit:
    """The split of this process's RSS now, for an engine and its draft model, if any."""
    runners = [(engine.executor, engine.cache)]
    draft = getattr(getattr(engine.speculator, "proposer", None), "runner", None)
    if draft is not None:
        runners.append((draft.executor, draft.cache))
    mappings = file_mappings()
    mapped, copies = {}, {}
    for executor, _ in runners:
        params = [executor.weight(name) for name in executor.plan.params]
        for t in cpu_tensors(params + executor.held()):
            if t.layout is not torch.strided:   # oneDNN's blocked copies (speculation's fp32 linears): opaque
                copies[id(t)] = t.numel() * t.element_size()
            else:
                (mapped if _mapping_of(t, mappings) else copies)[t.untyped_storage().data_ptr()] = _storage_bytes(t)
    kv = list(cpu_tensors([[cache.k_cache, cache.v_cache, cache.kv_scales] for _, cache in runners]))
    arenas = sum(ex.native_decode.arena.nbytes for ex, _ in runners if ex.native_decode is not None)
    return MemorySplit(psutil.Process().memory_info().rss, _resident(mapped, mappings), sum(mapped.values()),
                       sum(copies.values()), sum(ex.ort_packed_bytes() for ex, _ in runners),
                       sum(map(resident_bytes, kv)), sum(t.nbytes for t in kv), arenas + scratch_bytes())


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _mapping_of(t: torch.Tensor, mappings: list[tuple[int, int]]) -> tuple[int, int] | None:
    address = t.untyped_storage().data_ptr()
    return next(((start, end) for start, end in mappings if start <= address < end), None)


def _resident(storages: dict[int, int], mappings: list[tuple[int, int]]) -> int:
    """Resident bytes of the file mappings that hold these storages (by their start addresses), from
    /proc/self/smaps."""
    held = {start for start, end in mappings if any(start <= a < end for a in storages)}
    total, current = 0, None
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            current = int(head.split("-")[0], 16)
        elif head == "Rss:" and current in held:
            total += int(line.split()[1]) * 1024
    return total


def expected(plan: dict, model: dict, kv_memory: str | int = "1GiB", block_size: int = 16) -> dict:
    """What a load of a CPU artifact will hold, from its plan.json and its manifest's model section: the
    weights the plan reads (bytes in the file), of them the 4-bit qlinears' zero points the native kernels
    hold converted (integer ones; codes, scales and offsets they read in place), the KV cache
    a `kv_memory` budget allocates, the activations the memory plan peaks at (held by the heap once a
    step reaches them), and the ONNX Runtime sessions, each of which packs its own copy of the weights
    its MatMulNBits read."""
    types = plan["types"]
    nbytes = {p: _type_bytes(types[p]) for p in plan["params"] if p in types}
    # the native GEMV reads 4-bit codes in place, and fp16, fp32 or K-quant packed (uint8) scales and zero points
    # or offsets; on int8 activations where AMX runs here and the weights sit in the last-level cache, all three
    # go into tiles
    four_bit = [s for s in plan["steps"] if s["kernel"] == "cpu.qlinear" and s["attrs"].get("scheme") in NATIVE_4BIT]
    tiled = (plan["meta"].get("q4_activations", "int16") == "int8"
             and cpu_native.tiles_wanted(cpu_native.weights_fit_cache(sum(nbytes.values()))))
    repacked = {p for s in four_bit for p in (s["inputs"][1:4] if tiled else s["inputs"][2:4])
                if p in nbytes and (tiled or types[p]["dtype"] not in ("float16", "float32", "uint8"))}
    per_token = model["kv_bytes_per_token"]
    blocks = num_blocks_for_budget(parse_bytes(kv_memory), per_token, block_size)
    sessions = sum(s["kernel"] == "ort.segment" for s in plan["steps"])
    decode_graph = (plan["meta"].get("decode_graph") or {}).get("chosen") is True
    return {"weights_file": sum(nbytes.values()), "weights_repacked": sum(nbytes[p] for p in repacked),
            "kv_cache": blocks * block_size * per_token, "kv_memory": kv_memory, "kv_blocks": blocks,
            "activations_planned": plan["memory"]["peak_bytes"], "ort_sessions": sessions + decode_graph}


def _type_bytes(t: dict) -> int:
    count = 1
    for d in t["shape"]:
        count *= d
    return count * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


__all__ = ["MemorySplit", "measure", "memory_line", "expected"]
