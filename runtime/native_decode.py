"""A decode step's layers as one native call (codegen/native/decode_program.c) instead of ~9 Python
launches a layer. At load the longest run of plan steps the native kernels cover (fp32, int8 and 4-bit
GEMVs, norms, SwiGLU, AWQ's scales, split, attention over an fp32 paged cache, the LM head's row
selection: on a decode step, the identity, checked each step) is encoded once as ops over a fixed arena
of activations, MAX_ROWS rows each; on a step of at most MAX_ROWS rows that each read a causal prefix
(decodes, and short prefill chunks such as a speculative verification's) the walk runs the
steps before the run (the embedding, ORT segments), this one call, and any steps after; what leaves
the arena is a copy, unless the caller borrows it (the engine's step). Every op runs the kernel the
walk's own launch would for those rows, so the result is the walk's to fp32 rounding (the norms and
SwiGLU round as the native kernels do); anything the kernels do not cover keeps its launch.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch

from llmc.codegen.native import cpu_native
from llmc.codegen.torch_cpu.cpu_kernels import RopeCache
from llmc.runtime.host_memory import huge_pages

OP_FIELDS = 16
OP_GEMV_Q8, OP_GEMV_F32, OP_ATTENTION, OP_ADD_RMS_NORM, OP_SWIGLU, OP_GEMV_Q4, OP_SCALE = 1, 2, 3, 4, 5, 6, 7
OP_KINDS = 8   # decode_program.c's OP_KINDS: per-kind timing slots, one past the largest kind
OP_NAMES = {OP_GEMV_Q8: "int8 GEMV", OP_GEMV_F32: "fp32 GEMV", OP_ATTENTION: "attention",
            OP_ADD_RMS_NORM: "add_rms_norm", OP_SWIGLU: "swiglu", OP_GEMV_Q4: "4-bit GEMV", OP_SCALE: "AWQ scales"}
F32 = torch.float32
COVERED = ("cpu.qlinear", "cpu.linear", "cpu.add_rms_norm", "cpu.rms_norm", "cpu.split", "cpu.swiglu",
           "cpu.flash_attention", "cpu.mul", "cpu.select_rows")


class View(NamedTuple):
    """Where a value's rows lie in the arena (in floats)."""
    offset: int
    stride: int
    width: int


class At(NamedTuple):
    """An op field that is an arena offset (in floats): an address once the arena is allocated."""
    offset: int


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


class _Encoder:
    """Encodes a run of launches into ops, placing each activation in the arena: values whose last
    reader has run give their region back to the next value of the same width."""

    def __init__(self, executor):
        self.ex = executor
        self.views: dict[str, View] = {}      # value -> its view
        self.root: dict[str, str] = {}        # value -> the value owning its region (split views)
        self.free: dict[int, list[int]] = {}  # width -> free region offsets
        self.size = 0
        self.inputs: list[tuple[str, View]] = []   # values computed before the run, copied in
        self.rope: tuple[str, str, float] | None = None
        self.selects: list[str] = []               # select_rows' indices, the identity on a decode step
        self.heads = self.head_dim = 0             # the largest, for the attention's scratch
        self.weights: list[torch.Tensor] = []      # what the GEMVs stream, put on huge pages

    def param(self, name: str) -> torch.Tensor | None:
        reg = self.ex._registers[name]
        return self.ex._params[reg] if reg < len(self.ex._params) else None

    def output(self, name: str, width: int, fresh: bool = False) -> At:
        free = None if fresh else self.free.get(width)
        if free:
            offset = free.pop()
        else:
            offset, self.size = self.size, self.size + cpu_native.MAX_ROWS * width
        self.views[name], self.root[name] = View(offset, width, width), name
        return At(offset)

    def activation(self, name: str, width: int) -> View:
        """The view of an activation the run reads. One computed before the run is copied in as the run
        starts, so its region is a fresh one: a freed one may still be written before this first read."""
        view = self.views.get(name)
        if view is None:
            view = View(self.output(name, width, fresh=True).offset, width, width)
            self.inputs.append((name, view))
        if view.width != width:
            raise _Uncovered(f"value of width {view.width} read as {width}")
        return view

    def release(self, last_use: dict[str, int], index: int) -> None:
        """Free the regions whose values (the owner's and its split views') are all read for the last time."""
        members: dict[str, list[str]] = {}
        for name, root in self.root.items():
            members.setdefault(root, []).append(name)
        for root, names in members.items():
            if max(last_use.get(n, -1) for n in names) == index:
                self.free.setdefault(self.views[root].width, []).append(self.views[root].offset)
                for n in names:
                    del self.root[n]


class _Uncovered(Exception):
    """A launch the native ops do not cover (the run ends before it)."""


def _width(plan, name: str) -> int:
    t = plan.type_of(name) if name in plan.types else None
    if t is None or t.dtype != "float32" or t.rank != 2 or not isinstance(t.shape[-1], int):
        raise _Uncovered(f"{name} is not an fp32 [tokens, n] activation")
    return t.shape[-1]


def _f32_param(t: torch.Tensor | None, shape: tuple | None = None) -> int:
    if t is None or t.dtype is not F32 or not t.is_contiguous() or (shape is not None and tuple(t.shape) != shape):
        raise _Uncovered("a parameter that is not a contiguous fp32 tensor of the expected shape")
    return t.data_ptr()


def _encode(enc: _Encoder, step, launch) -> list[list]:
    """The ops of one launch (split: none, it only names views), or _Uncovered."""
    plan, kernel, attrs = enc.ex.plan, step.kernel, launch.attrs
    ins, outs = step.inputs, step.outputs
    if kernel == "cpu.split":
        parent = enc.activation(ins[0], _width(plan, ins[0]))
        col = 0
        for name, size in zip(outs, attrs["sizes"]):
            enc.views[name] = View(parent.offset + col, parent.stride, size)
            enc.root[name] = enc.root.get(ins[0], ins[0])
            col += size
        if col != parent.width or len(outs) != len(attrs["sizes"]):
            raise _Uncovered("a split that does not cover its input")
        return []
    if kernel == "cpu.select_rows":
        # On a decode step each row is its sequence's last token, so the rows whose logits are wanted are
        # all of them in order: the output is the input's view. run() checks the indices every step.
        n = _width(plan, ins[0])
        if _width(plan, outs[0]) != n:
            raise _Uncovered("select_rows changing the row width")
        enc.views[outs[0]], enc.root[outs[0]] = enc.activation(ins[0], n), enc.root.get(ins[0], ins[0])
        enc.selects.append(ins[1])
        return []
    if kernel in ("cpu.rms_norm", "cpu.add_rms_norm"):
        residual = kernel == "cpu.add_rms_norm"
        n = _width(plan, ins[0])
        x = enc.activation(ins[0], n)
        r = enc.activation(ins[1], n) if residual else None
        weight = _f32_param(enc.param(ins[2 if residual else 1]), (n,))
        out = enc.output(outs[0], n)
        summed = enc.output(outs[1], n) if residual else None
        return [[OP_ADD_RMS_NORM, At(x.offset), x.stride, None if r is None else At(r.offset),
                 0 if r is None else r.stride, weight, out, summed, n, _bits(attrs["eps"])]]
    if kernel == "cpu.swiglu":
        if len(ins) != 1:
            raise _Uncovered("swiglu of two inputs")
        n = _width(plan, ins[0])
        x = enc.activation(ins[0], n)
        return [[OP_SWIGLU, At(x.offset), x.stride, enc.output(outs[0], n // 2), n // 2]]
    if kernel == "cpu.mul":   # an activation times a vector (AWQ's inverse scales)
        n = _width(plan, ins[0])
        scale = _f32_param(enc.param(ins[1]), (n,))
        x = enc.activation(ins[0], n)
        return [[OP_SCALE, At(x.offset), x.stride, scale, enc.output(outs[0], n), n]]
    if kernel == "cpu.linear":
        return [_linear(enc, step)]
    if kernel == "cpu.qlinear":
        return [_qlinear(enc, step, attrs)]
    return [_attention(enc, step, attrs)]


def _linear(enc: _Encoder, step) -> list:
    k, n = _width(enc.ex.plan, step.inputs[0]), _width(enc.ex.plan, step.outputs[0])
    x = enc.activation(step.inputs[0], k)
    w = enc.param(step.inputs[1])
    weight = _f32_param(w, (n, k))
    enc.weights.append(w)
    bias = _f32_param(enc.param(step.inputs[2]), (n,)) if len(step.inputs) > 2 else 0
    return [OP_GEMV_F32, At(x.offset), x.stride, weight, n, k, enc.output(step.outputs[0], n), bias]


def _qlinear(enc: _Encoder, step, attrs: dict) -> list:
    w = attrs.get("native_gemv")
    if w is None or attrs.get("has_act_scale"):
        raise _Uncovered("a qlinear without the native GEMV")
    k, n = _width(enc.ex.plan, step.inputs[0]), _width(enc.ex.plan, step.outputs[0])
    bias = _f32_param(enc.param(step.inputs[-1]), (n,)) if attrs.get("has_bias") else 0
    x = enc.activation(step.inputs[0], k)
    y = enc.output(step.outputs[0], n)
    if type(w) is cpu_native.Q4Weights and w.packed.shape == (n, k // 2):
        enc.weights += [w.packed, w.scales, w.other] + ([w.tiles] if w.tiles is not None else [])
        # the AMX tiles where w has them (Q4_TILES in the flags), the stored codes last for the VNNI GEMV
        return [OP_GEMV_Q4, At(x.offset), x.stride, (w.packed if w.tiles is None else w.tiles).data_ptr(),
                w.scales.data_ptr(), cpu_native.param_format(w.scales, w.group), n, k, w.group, y, bias,
                int(w.zero_point), w.other.data_ptr(), cpu_native.q4_other_row(w), cpu_native.q4_flags(w),
                w.packed.data_ptr()]
    if type(w) is cpu_native.Q8Weights and w.codes.shape == (n, k):
        enc.weights += [w.codes, w.scales]
        return [OP_GEMV_Q8, At(x.offset), x.stride, w.codes.data_ptr(), w.scales.data_ptr(),
                cpu_native.param_format(w.scales, w.group), n, k, w.group, y, bias]
    raise _Uncovered("a qlinear whose codes do not match its shapes")


def _attention(enc: _Encoder, step, a: dict) -> list:
    if a.get("kv_cache") is not None or a.get("softcap") is not None or not a.get("causal", True):
        raise _Uncovered("attention with a quantised cache, softcap or no causal mask")
    heads, kv_heads, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    plan, ins = enc.ex.plan, step.inputs
    if _width(plan, ins[0]) != heads * hd or heads % kv_heads or hd % 2:
        raise _Uncovered("attention of unexpected shapes")
    q = enc.activation(ins[0], heads * hd)
    k, v = (enc.activation(name, kv_heads * hd) for name in ins[1:3])
    rope = a.get("rope")
    if rope is not None:
        key = (ins[3], ins[4], float(rope["scaling"]))
        if enc.rope not in (None, key):
            raise _Uncovered("layers rotating by different tables")
        enc.rope = key
    enc.heads, enc.head_dim = max(enc.heads, heads), max(enc.head_dim, hd)
    return [OP_ATTENTION, At(q.offset), q.stride, At(k.offset), k.stride, At(v.offset), v.stride, a["layer"],
            a.get("window") or 0,
            heads, kv_heads, hd, _bits(a["scale"]), enc.output(step.outputs[0], heads * hd), int(rope is not None),
            int(getattr(enc.ex, "batch_invariant", False))]


class NativeDecode:
    """The encoded run [start, end) of an executor's launches, and what a step needs to call it."""

    def __init__(self, executor, start: int, end: int, enc: _Encoder, ops: list[list], outputs: list[str]):
        self.start, self.end = start, end
        self.arena = torch.empty(max(enc.size, 1), dtype=F32)
        base = self.arena.data_ptr()
        registers = executor._registers
        self._inputs = [(registers[name], view) for name, view in enc.inputs]
        self._outputs = [(registers[name], enc.views[name]) for name in outputs]
        self._selects = [registers[name] for name in enc.selects]
        self._iota = torch.arange(cpu_native.MAX_ROWS)
        self._rope = None if enc.rope is None else (registers[enc.rope[0]], registers[enc.rope[1]], enc.rope[2])
        self._heads, self._head_dim = enc.heads, enc.head_dim
        self._layers = 1 + max(op[7] for op in ops if op[0] == OP_ATTENTION)
        table = torch.zeros(len(ops), OP_FIELDS, dtype=torch.int64)
        for i, op in enumerate(ops):
            table[i, :len(op)] = torch.tensor(_resolve(op, base), dtype=torch.int64)
        self._ops = table
        self._caches: tuple[object, torch.Tensor | None] | None = None
        self._lib = cpu_native._load()[0]
        self.op_seconds: torch.Tensor | None = None   # float64 [OP_KINDS]: set to add up each kind's wall time
        self.huge_page_bytes = huge_pages(enc.weights)

    def _cache_table(self, cache) -> torch.Tensor | None:
        """[layers, 2] pointers to each layer's key and value rows; None where the cache is not native."""
        if self._caches is None or self._caches[0] is not cache:
            pointers = [cache.native_pointers(layer) for layer in range(self._layers)]
            table = None if any(p is None for p in pointers) else torch.tensor(
                [p[:2] for p in pointers], dtype=torch.int64)
            self._caches = (cache, table)
        return self._caches[1]

    def run(self, regs: list, backend, rope_cache: RopeCache, borrow: bool = False) -> bool:
        """Run the encoded launches for this step, leaving their outputs read later in regs: copies, or with
        `borrow` the arena views the next run overwrites (a later launch may hold its input past this run:
        a pipeline stage's send is not waited for); False (nothing run) where the step is not one of at
        most MAX_ROWS rows over a native cache, each reading a causal prefix (decode rows, and short
        prefill chunks such as a speculative verification's, each row as a decode row)."""
        metadata, cache = getattr(backend, "metadata", None), getattr(backend, "cache", None)
        if metadata is None or cache is None or getattr(backend, "scored", None):
            return False   # (scored: an H2O policy reads each layer's queries, runtime/kv_policy.py)
        step = metadata.native_step(cache.block_size)
        if step is None and metadata.slot_mapping.shape[0] <= cpu_native.MAX_ROWS:
            # a few rows of prefill chunks (speculative verification): each row as a decode row (a long
            # prefill is not asked: its per-row tables would be built for nothing)
            step = metadata.native_row_step(cache.block_size)
        caches = None if step is None else self._cache_table(cache)
        if caches is None:
            return False
        rows = step.rows
        for reg in self._selects:
            indices = regs[reg]
            if indices.dtype is not torch.int64 or indices.shape != (rows,) or not torch.equal(indices,
                                                                                           self._iota[:rows]):
                return False
        for reg, view in self._inputs:
            x = regs[reg]
            if x.dtype is not F32 or x.shape != (rows, view.width):
                return False
        for reg, view in self._inputs:
            self._view(view, rows).copy_(regs[reg])
        cos = sin = None
        if self._rope is not None:
            positions, inv_freq, scaling = self._rope
            cos, sin = (t.contiguous() for t in rope_cache.cos_sin(regs[positions], regs[inv_freq], scaling, F32))
            if cos.shape != (rows, self._head_dim) or sin.shape != cos.shape:
                return False   # the C kernel reads head_dim floats a row
        scratch = torch.empty(rows * self._heads * (self._head_dim + step.max_len), dtype=F32)
        threads = torch.get_num_threads() if self._lib.openmp else 1
        fields = torch.tensor([rows, _ptr(cos), _ptr(sin), step.slots, step.tables, step.width, step.lens, step.block,
                               scratch.data_ptr(), caches.data_ptr(), threads, _ptr(self.op_seconds)],
                              dtype=torch.int64)
        self._lib.llmc_decode_program(self._ops.data_ptr(), self._ops.shape[0], fields.data_ptr())
        for reg, view in self._outputs:
            regs[reg] = self._view(view, rows) if borrow else self._view(view, rows).clone()
        return True

    def _view(self, view: View, rows: int) -> torch.Tensor:
        return self.arena.as_strided((rows, view.width), (view.stride, 1), view.offset)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _resolve(op: list, base: int) -> list[int]:
    """An op's fields as the C program reads them: arena offsets as addresses, None as NULL."""
    return [base + 4 * f.offset if type(f) is At else 0 if f is None else f for f in op]


def build(executor) -> NativeDecode | None:
    """The executor's longest run of launches the native ops cover that holds an attention (None: no
    such run, or the native kernels are not built). Outputs of the run that later launches or the plan
    read are left in the registers as arena views."""
    if cpu_native._load()[0] is None or executor.device.type != "cpu" or executor.family != "cpu":
        return None
    last_use = _last_uses(executor)
    best, start = None, 0
    while start < len(executor.plan.steps):
        end, found = _encode_run(executor, start, last_use)
        if found is not None and (best is None or end - start > best[1] - best[0]):
            best = (start, end, *found)
        start = max(end, start + 1)
    return None if best is None else NativeDecode(executor, *best)


def _encode_run(executor, start: int, last_use: dict[str, int]) -> tuple[int, tuple | None]:
    """(where the covered run from `start` ends, its (encoder, ops, outputs read later or by the plan's
    caller) or None: no attention in it)."""
    steps, program, plan = executor.plan.steps, executor._program, executor.plan
    enc, ops, end = _Encoder(executor), [], start
    for i in range(start, len(steps)):
        if steps[i].kernel not in COVERED:
            break
        try:
            ops += _encode(enc, steps[i], program[i])
        except _Uncovered:
            break
        enc.release(last_use, i)
        end = i + 1
    if not any(op[0] == OP_ATTENTION for op in ops):
        return end, None
    produced = {v for i in range(start, end) for v in steps[i].outputs}
    later = {v for step in steps[end:] for v in step.inputs} | set(plan.outputs)
    return end, (enc, ops, sorted(produced & later))


def _last_uses(executor) -> dict[str, int]:
    """value -> the index of the last step that reads it."""
    return {name: i for i, step in enumerate(executor.plan.steps) for name in step.inputs}


__all__ = ["NativeDecode", "build", "View", "At", "COVERED"]
