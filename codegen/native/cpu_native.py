"""llmc's native CPU kernels (codegen/native/decode_kernels.c) for decode-sized work: built with the
machine's C compiler at first use, cached per source, compiler and CPU in a private directory whose
libraries are loaded only after their owner, mode and sha256 check (native_cache.py), and called
through ctypes.
A decode step's attention runs ~15 small torch operators a layer (rotary, the cache write, the
attention itself), each costing 2-5 us of dispatch for about a microsecond of arithmetic; one call
here. Likewise a residual add and its norm where quantised GEMMs read the norm, and the int8 and 4-bit
GEMVs themselves: on activations rounded to int16 codes per block of 64 where the CPU has AVX-512 BW or AVX2
(gemv_int16.c: at most 2^-16 of a block's largest value off, where torch's int8 kernel rounds them to
bf16, 2^-9 of each), the 4-bit ones to int8 codes per block of 32 where the artifact asks (its
--q4-activations, int8 by default: llama.cpp's Q8_1 rounding, 2^-8; with AVX-512 BW or AVX2, the same bits
on either: gemv_avx2.c), else on fp32 ones. Without a
compiler (or with LLMC_NATIVE=0) the torch kernels run instead: both compute the same function to fp32
rounding (to those roundings for the GEMVs), and `llmc bench` prints which ran (`status`).

What the C code trusts, these wrappers check: dtype float32, the strides it reads, sizes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager, suppress
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from llmc.cache import cache_root
from llmc.codegen.native_cache import CacheRefused, digest_path, private_directory, record, verified_open, warn
from llmc.compiler.quant import K_SUPER, group_params, is_packed, kv_int4_row_bytes, packed_groups
from llmc.errors import LlmcError

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("decode_kernels.c", "gemv_int16.c", "gemv_avx2.c", "decode_program.c",
                             "decode_int4.c", "gemm_amx.c"))
# included by the sources: in the cache key
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("half_params.h", "gemv_rows.h", "gemv_int16.h", "gemv_q4_int8.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-Wno-psabi", "-fPIC", "-shared")
F32 = torch.float32
BF16 = torch.bfloat16
MAX_ROWS = 8    # more rows than this go to torch's GEMMs and norms (the bf16 decode attention takes any)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "llmc_decode_attention": [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _I, _I,
                              _I, _I, _I, _I, _F, _P, _P, _I, _I],
    "llmc_decode_attention_bf16": [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I],
    "llmc_decode_attention_int4": [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I],
    "llmc_add_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _F],
    "llmc_gemv_q8": [_P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I],
    "llmc_gemv_q4": [_P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _I, _I],
    "llmc_gemv_f32": [_P, _I, _I, _P, _P, _I, _I, _P, _I],
    "llmc_swiglu": [_P, _I, _I, _I, _P],
    "llmc_decode_program": [_P, _I, _P],
    "llmc_openmp": [],
    "llmc_gemv_int16": [_I],
    "llmc_gemv_int16_built": [],
    "llmc_gemv_q4_int8_fits": [_I, _I],
    "llmc_amx_ready": [],
    "llmc_q4_tiles_bytes": [_I] * 5,
    "llmc_q4_repack": [_P, _P, _P] + [_I] * 6 + [_P, _I],
    "llmc_gemm_q4_amx": [_P, _I, _I, _P] + [_I] * 4 + [_P, _I],
    "llmc_gemm_q4_stored": [_P, _I, _I, _P, _P, _P] + [_I] * 6 + [_P, _I],
}
AMX_ENV = "LLMC_AMX"   # "0": the 4-bit weights stay on the VNNI GEMV (an A/B); "all": AMX tiles for every model
OPENMP = ("-fopenmp",)   # for the GEMV's threads; without it (a compiler lacking OpenMP) that GEMV stays off


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in text.splitlines() if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _source_text() -> str:
    return "\0".join(p.read_text() for p in SOURCES + HEADERS)


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    """The cached library for these sources, flags, compiler and CPU, built into the private cache
    directory (native_cache.py) unless one is there whose recorded sha256 still holds."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([_source_text(), " ".join(flags), version, _cpu_id()]).encode()).hexdigest()
    target = private_directory(cache_root() / "native") / f"decode_kernels-{key[:16]}.so"
    try:
        with verified_open(target):
            return target
    except FileNotFoundError:
        pass
    except (CacheRefused, OSError):   # a file llmc did not build, or one changed since: built afresh below
        if not target.is_file() or target.is_symlink():
            _remove(target)   # a link or directory; a file is replaced atomically (a concurrent run may load it)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            _compile_and_link(compiler, flags, Path(objects), tmp)
        record(Path(tmp), target)   # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile_and_link(compiler: str, flags: tuple[str, ...], objects: Path, out: str) -> None:
    """Each source compiled in its own process, all at once (gemv_int16.c alone takes most of the 11 s
    the one-process build took), then linked into `out`."""
    compile_flags = tuple(f for f in flags if f != "-shared")
    outputs = [objects / f"{source.stem}.o" for source in SOURCES]
    jobs = [subprocess.Popen([compiler, *compile_flags, "-c", str(source), "-o", str(obj)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for source, obj in zip(SOURCES, outputs)]
    for job in jobs:   # behind the work it overlaps (build_in_background): it takes the cores that work leaves
        with suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, job.pid, BUILD_NICENESS)
    failed = []
    for source, job in zip(SOURCES, jobs):
        try:
            _, err = job.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            job.kill()
            _, err = job.communicate()
        if job.returncode:
            failed.append(f"{source.name}: {err.strip()[:300]}")
    if failed:
        raise RuntimeError(f"{compiler} failed on {'; '.join(failed)}")
    done = subprocess.run([compiler, *flags, *map(str, outputs), "-o", out, "-lm"], capture_output=True, text=True,
                          timeout=120)
    if done.returncode:
        names = " ".join(o.name for o in outputs)
        raise RuntimeError(f"{compiler} failed to link {names}: {done.stderr.strip()[:300]}")


def _remove(target: Path) -> None:
    for path in (target, digest_path(target)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(path)


def _built_library(compiler: str, flags: tuple[str, ...]) -> tuple[Path, ctypes.CDLL]:
    """The built library, loaded; built once more where a concurrent build replaced it between our
    check and our load (builds are deterministic, so that settles it)."""
    try:
        target = _build(compiler, flags)
        return target, _open_library(target)
    except CacheRefused:
        target = _build(compiler, flags)
        return target, _open_library(target)


def _open_library(target: Path) -> ctypes.CDLL:
    """The library at `target`, loaded from the very file whose owner, mode and sha256 were checked."""
    with verified_open(target) as checked:
        return ctypes.CDLL(checked)


BUILD_NICENESS = 19
_LOADING = threading.Lock()   # one build at a time: a compile starts it on a thread (build_in_background)


def build_in_background() -> None:
    """Build (or find built) the native library on a thread while the caller goes on: a compile's load,
    calibration and passes then overlap the C compiler, which takes 8-11 s on a fresh cache."""
    threading.Thread(target=_load, name="llmc-native-build", daemon=True).start()


@lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    with _LOADING:   # a caller that finds a build under way waits for it, then loads what it built
        return _load_now()


def _load_now() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("LLMC_NATIVE", "1") == "0":
        return None, "off (LLMC_NATIVE=0)"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "off (no C compiler: set CC or install gcc)"
    try:
        try:
            target, lib = _built_library(compiler, FLAGS + OPENMP)
        except (OSError, RuntimeError):
            target, lib = _built_library(compiler, FLAGS)
    except CacheRefused as e:
        warn(f"native kernels off, the torch kernels run instead: {e}")
        return None, f"off ({e})"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"off ({e})"
    _bind(lib, target)
    lib.openmp = bool(lib.llmc_openmp())
    lib.llmc_gemv_int16(os.environ.get("LLMC_INT16_ACTIVATIONS", "1") != "0")
    threads = "OpenMP" if lib.openmp else "no OpenMP: the int8 GEMV runs on one thread only"
    return lib, f"on ({Path(compiler).name}, {' '.join(FLAGS[:2])}, {threads})"


def _bind(lib: ctypes.CDLL, target: Path) -> None:
    """Give each kernel its C signature; a library without one is an error naming the file."""
    for name, argtypes in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LlmcError(f"native kernel library '{target}' has no symbol {name} (built from other sources?); "
                            f"delete it to rebuild, or set LLMC_NATIVE=0 to run the torch kernels") from None
        fn.argtypes, fn.restype = argtypes, None
    for name in ("llmc_openmp", "llmc_gemv_int16", "llmc_gemv_int16_built", "llmc_gemv_q4_int8_fits", "llmc_amx_ready",
                 "llmc_q4_tiles_bytes", "llmc_q4_repack", "llmc_gemm_q4_amx", "llmc_gemm_q4_stored"):
        getattr(lib, name).restype = ctypes.c_int64


def set_int16_activations(on: bool) -> bool:
    """Whether the 4-bit and int8 GEMVs quantise their activations to int16 codes per block of 64 where
    the CPU has AVX-512 BW or AVX2 (the default; LLMC_INT16_ACTIVATIONS=0 turns it off) or multiply fp32 ones;
    returns the previous setting."""
    lib = _load()[0]
    return bool(lib.llmc_gemv_int16(int(on))) if lib is not None else False


@contextmanager
def fp32_activations():
    """The 4-bit and int8 GEMVs on fp32 activations inside the block (tests compare the two)."""
    previous = set_int16_activations(False)
    try:
        yield
    finally:
        set_int16_activations(previous)


# how the 4-bit GEMVs round their activations (an artifact's `--q4-activations`): int8 codes per block of 32
# as llama.cpp's Q8 activations (2^-8 of a block's largest value off; the default), or int16 codes per 64
Q4_ACTIVATIONS = ("int8", "int16")


def takes_int8(k: int, group: int) -> bool:
    """Whether the 4-bit GEMV of K `k` in groups of `group` runs on int8 activations where asked (AVX-512 BW or
    AVX2, K a multiple of 64, groups of 32, 64 or a multiple of 128; else it stays on int16 ones)."""
    lib = _load()[0]
    return lib is not None and bool(lib.llmc_gemv_q4_int8_fits(k, group))


def int16_activations() -> bool:
    """Whether the GEMVs take int16 activations: built for them (AVX-512 BW or AVX2) and not turned off. (Shapes
    decide per call: K a multiple of 64, groups of 32 codes or multiples of 64.)"""
    lib = _load()[0]
    if lib is None or not lib.llmc_gemv_int16_built():
        return False
    return bool(lib.llmc_gemv_int16(-1))


def available() -> bool:
    return _load()[0] is not None


def status() -> str:
    """'on (...)' or 'off (why)', for `llmc bench`."""
    return _load()[1]


@lru_cache(maxsize=1)
def timing_key() -> str:
    """What kernel timings measured through these kernels depend on: whether they are built, and
    their source (a changed kernel is timed anew, not recalled from the machine's timing cache)."""
    return f"{status()} {hashlib.sha256(_source_text().encode()).hexdigest()[:16]}"


class DecodeStep(NamedTuple):
    """A decode-only step's cache addressing as the attention kernel reads it, checked once a step."""
    slots: int          # pointers: int64 [b] cache slot of each new token
    tables: int         # int64 [b, width] block tables
    width: int
    lens: int           # int32 [b] keys each sequence sees, its new one included
    rows: int           # b
    max_len: int
    block: int


def decode_step(slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, max_len: int,
                block: int) -> DecodeStep | None:
    """The step's DecodeStep; None where the native kernel does not apply (too many rows, not built)."""
    b = slots.shape[0]
    if b > MAX_ROWS:
        return None
    if slots.dtype != torch.int64 or not slots.is_contiguous() or tables.shape[0] != b:
        raise ValueError(f"decode metadata the native attention cannot read: slots {slots.dtype} "
                         f"{list(slots.shape)} for {tables.shape[0]} block tables")
    step = read_step(tables, lens, max_len, block)
    return None if step is None else step._replace(slots=slots.data_ptr())


def read_step(tables: torch.Tensor, lens: torch.Tensor, max_len: int, block: int) -> DecodeStep | None:
    """A DecodeStep for a kernel that only reads the cache (any number of rows, no slots); None where
    the kernels are not built."""
    if _load()[0] is None:
        return None
    b = tables.shape[0]
    if not (tables.dtype == torch.int64 and lens.dtype == torch.int32 and tables.is_contiguous()
            and lens.is_contiguous() and lens.shape == (b,) and max_len <= tables.shape[1] * block
            and int(lens.max()) <= max_len):
        raise ValueError(f"decode metadata the native attention cannot read: tables {tables.dtype} "
                         f"{list(tables.shape)}, lens {lens.dtype} {list(lens.shape)}, max_len {max_len}, "
                         f"block {block}")
    return DecodeStep(0, tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, max_len, block)


def decode_attention_bf16(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, step: DecodeStep,
                          window: int | None, num_heads: int, num_kv_heads: int, head_dim: int,
                          scale: float) -> torch.Tensor | None:
    """Decode attention for q [b, heads * hd] (bf16) over one layer's bf16 cache rows [slots, kv_heads * hd]
    that hold the step's keys and values already, through `step` (read_step). Out [b, heads * hd] bf16,
    computed in fp32 and rounded once; None where the kernel does not apply."""
    b, row = step.rows, num_kv_heads * head_dim
    if (q.dtype is not BF16 or k_rows.dtype is not BF16 or v_rows.dtype is not BF16 or q.dim() != 2
            or q.stride(1) != 1 or q.shape != (b, num_heads * head_dim) or not k_rows.is_contiguous()
            or not v_rows.is_contiguous() or k_rows.shape != v_rows.shape or k_rows.dim() != 2
            or k_rows.shape[1] != row or num_heads % num_kv_heads or not q.is_cpu or not k_rows.is_cpu):
        return None
    lib = _load()[0]
    out = torch.empty(b, num_heads * head_dim, dtype=BF16)
    scratch = torch.empty(b * num_heads * (head_dim + step.max_len), dtype=F32)
    lib.llmc_decode_attention_bf16(
        q.data_ptr(), q.stride(0), k_rows.data_ptr(), v_rows.data_ptr(), step.tables, step.width, step.lens,
        step.block, window or 0, b, num_heads, num_kv_heads, head_dim, scale, out.data_ptr(), scratch.data_ptr(),
        torch.get_num_threads() if lib.openmp else 1)
    return out


def decode_attention_int4(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, step: DecodeStep,
                          window: int | None, num_heads: int, num_kv_heads: int, head_dim: int, group: int,
                          scale: float) -> torch.Tensor | None:
    """Decode attention for q [b, heads * hd] (fp32) over one layer's int4 cache rows [slots, kv_heads * head
    bytes] (runtime/kv_quant.quantize_kv_int4's packing, `group` channels a scale) that hold the step's keys and
    values already, through `step` (read_step). Out [b, heads * hd] fp32; None where the kernel does not apply."""
    b, row = step.rows, num_kv_heads * kv_int4_row_bytes(head_dim, group)
    if (q.dtype is not F32 or k_rows.dtype is not torch.uint8 or v_rows.dtype is not torch.uint8 or q.dim() != 2
            or q.stride(1) != 1 or q.shape != (b, num_heads * head_dim) or not k_rows.is_contiguous()
            or not v_rows.is_contiguous() or k_rows.shape != v_rows.shape or k_rows.dim() != 2
            or k_rows.shape[1] != row or num_heads % num_kv_heads or head_dim % group or group % 2
            or not q.is_cpu or not k_rows.is_cpu):
        return None
    lib = _load()[0]
    if lib is None:   # the native kernels are not built here: the torch path reads the cache
        return None
    out = torch.empty(b, num_heads * head_dim, dtype=F32)
    scratch = torch.empty(b * num_kv_heads * 2 * head_dim, dtype=F32)
    lib.llmc_decode_attention_int4(
        q.data_ptr(), q.stride(0), k_rows.data_ptr(), v_rows.data_ptr(), step.tables, step.width, step.lens,
        step.block, window or 0, b, num_heads, num_kv_heads, head_dim, group, scale, out.data_ptr(),
        scratch.data_ptr(), torch.get_num_threads() if lib.openmp else 1)
    return out


def cache_pointers(k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple[int, int, int] | None:
    """(keys, values, row width) of one layer's fp32 cache rows [slots, kv_heads * hd]; None where the
    native kernel cannot read them."""
    if not (k_rows.dtype == v_rows.dtype == torch.float32 and k_rows.is_contiguous() and v_rows.is_contiguous()
            and k_rows.shape == v_rows.shape and k_rows.device.type == "cpu"):
        return None
    return k_rows.data_ptr(), v_rows.data_ptr(), k_rows.shape[1]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: tuple | None,
                     cache: tuple[int, int, int], step: DecodeStep, window: int | None, num_heads: int,
                     num_kv_heads: int, head_dim: int, scale: float, invariant: bool = False) -> torch.Tensor | None:
    """One decode step's attention for q [b, heads * hd], k/v [b, kv_heads * hd] (b sequences, one
    token each): rotary by `rotary` (cos, sin [b, hd]; None: none), k and v written to the layer's
    `cache` (cache_pointers) at the step's slots, then attention over each sequence's keys through its
    block table (`step`). Out [b, heads * hd]; None where the native kernel does not apply (the
    caller then runs torch's). `invariant`: each row's context split as for a batch of one, so its
    output does not depend on the other rows (the rows may then be a prefill chunk's queries)."""
    b, row = step.rows, num_kv_heads * head_dim
    if (q.dtype is not F32 or k.dtype is not F32 or v.dtype is not F32 or q.dim() != 2 or k.dim() != 2 or v.dim() != 2
            or q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1 or q.shape[0] != b or k.shape[0] != b
            or v.shape[0] != b or q.shape[1] != num_heads * head_dim or k.shape[1] != row or v.shape[1] != row
            or cache[2] != row or num_heads % num_kv_heads or head_dim % 2):
        return None
    cos = sin = None
    if rotary is not None:
        c, s = rotary
        if c.dtype is not F32 or s.dtype is not F32 or not c.is_contiguous() or not s.is_contiguous() \
                or c.shape != (b, head_dim) or s.shape != (b, head_dim):
            return None
        cos, sin = c.data_ptr(), s.data_ptr()
    out = torch.empty(b, num_heads * head_dim, dtype=F32)
    scratch = torch.empty(b * num_heads * (head_dim + step.max_len), dtype=F32)
    lib = _load()[0]
    lib.llmc_decode_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos, sin, cache[0], cache[1],
        step.slots, step.tables, step.width, step.lens, step.block, window or 0, b, num_heads, num_kv_heads, head_dim,
        scale, out.data_ptr(), scratch.data_ptr(), torch.get_num_threads() if lib.openmp else 1, int(invariant))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, any_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rms_norm(x + residual) * weight, x + residual) for a few fp32 rows [rows, n] (residual None:
    rms_norm(x) * weight, None), in one call; None where the native kernel does not apply. Its sum
    of squares runs in vector lanes, so it is F.rms_norm's to fp32 rounding, not bitwise. (Checks
    and allocations here cost more than the arithmetic: each torch call is ~1.4 us.)"""
    lib = _load()[0]
    if lib is None or x.dtype is not F32 or x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu:
        return None
    rows, n = x.shape
    if (rows > MAX_ROWS and not any_rows) or weight.dtype is not F32 or weight.dim() != 1 or weight.shape[0] != n \
            or not weight.is_contiguous():
        return None
    out = torch.empty(rows, n, dtype=F32)
    if residual is None:
        lib.llmc_add_rms_norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, rows, n, x.stride(0), 0,
                              eps)
        return out, None
    if residual.dtype is not F32 or residual.shape != x.shape or residual.stride(1) != 1 or not residual.is_cpu:
        return None
    summed = torch.empty(rows, n, dtype=F32)
    lib.llmc_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), summed.data_ptr(),
                          rows, n, x.stride(0), residual.stride(0), eps)
    return out, summed


class Q8Weights(NamedTuple):
    """An int8 GEMV's weights: w = q * s per group of `group` codes along K."""
    codes: torch.Tensor    # int8 [N, K], contiguous
    scales: torch.Tensor   # float16 or float32 [N, K / group], or K-quant packed (uint8), contiguous
    group: int


def param_format(params: torch.Tensor, group: int) -> int:
    """How the GEMVs read a weight's group params (half_params.h): 0 fp32, 1 fp16, else K-quant packed
    (compiler/quant.py's pack_k_params) with that many groups a super-block."""
    if is_packed(params):
        return K_SUPER // group
    return int(params.dtype is torch.float16)


def _groups(params: torch.Tensor, n: int, k: int) -> int:
    """Groups a row of these params covers (packed rows hold their super-block factors too)."""
    return packed_groups(params.shape[-1], k) if is_packed(params) else params.numel() // n


def q8_weights(codes: torch.Tensor, scales: torch.Tensor) -> Q8Weights | None:
    """int8 codes [N, K] with scales [N] (per channel) or [N, groups] in gemv_q8's form; None where it
    cannot run them (groups not a multiple of 16 codes)."""
    if codes.dtype != torch.int8 or codes.dim() != 2 or scales.numel() == 0 or scales.numel() % codes.shape[0]:
        return None
    n, k = codes.shape
    s, groups = scales.reshape(n, -1), _groups(scales, n, k)
    if groups <= 0 or k % groups or (k // groups) % 16:
        return None
    s = s if s.dtype in (torch.float16, F32) or is_packed(s) else s.float()
    return Q8Weights(codes.contiguous(), s.contiguous(), k // groups)


def _gemv_lib(x: torch.Tensor, k: int, any_rows: bool = False) -> tuple[ctypes.CDLL | None, int]:
    """(the library, threads) for a native GEMV of x [rows, k] (fp32 CPU rows, unit column stride, at most
    MAX_ROWS unless `any_rows`); (None, 0) where it does not apply."""
    lib = _load()[0]
    threads = torch.get_num_threads()
    if (lib is None or x.dtype is not F32 or x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu
            or not 0 < x.shape[0] <= (x.shape[0] if any_rows else MAX_ROWS) or x.shape[1] != k
            or (threads > 1 and not lib.openmp)):
        return None, 0
    return lib, threads


def gemv_q8(x: torch.Tensor, w: Q8Weights, out: torch.Tensor | None = None,
            any_rows: bool = False) -> torch.Tensor | None:
    """x [rows, K] (fp32, a few rows) @ w.T in fp32, the weight rows split over torch's thread count:
    the reference's arithmetic (dequantise, fp32 GEMM) on x or its int16 codes (int16_activations),
    reading one byte a weight. torch's own int8 kernel rounds x to bf16 and measured 1.45x slower over
    SmolLM2's layers (2 threads, weights from memory). `any_rows`: more than MAX_ROWS rows in one call,
    which only the int16 path takes (q8_takes_int16). None where it does not apply."""
    lib, threads = _gemv_lib(x, w.codes.shape[1], any_rows and q8_takes_int16(w))
    if lib is None:
        return None
    (rows, k), n = x.shape, w.codes.shape[0]
    y = torch.empty(rows, n, dtype=F32) if out is None else out
    lib.llmc_gemv_q8(x.data_ptr(), x.stride(0), rows, w.codes.data_ptr(), w.scales.data_ptr(),
                     param_format(w.scales, w.group), n, k, w.group, y.data_ptr(), threads)
    return y


def q8_takes_int16(w: Q8Weights) -> bool:
    """Whether the int8 GEMV runs these weights on int16 activation codes now (llmc_gemv_q8_int16's shapes:
    K a multiple of 64, groups of 32 or multiples of 64; not inside fp32_activations)."""
    k = w.codes.shape[1]
    return k % 64 == 0 and (w.group == 32 or w.group % 64 == 0) and int16_activations()


class Q4Weights(NamedTuple):
    """A 4-bit GEMV's weights: per group of `group` codes along K, w = (q - z) * s (zero_point) or q * s + m.
    All three arrays are the artifact's own where it stores them so (a GGUF's Q4_0 and Q4_1 blocks: fp16
    scales and minimums), read in place from its mapped file: nothing is copied or reordered at load."""
    packed: torch.Tensor   # uint8 [N, K / 2] as stored: byte j holds code 2j (low nibble) and 2j + 1 (high)
    scales: torch.Tensor   # float16 or float32 [N, K / group], or K-quant packed (uint8)
    other: torch.Tensor    # zero points or offsets, scales' dtype: [N, K / group], or [1, K / group] for all rows
    zero_point: bool
    group: int
    int8: bool = False     # activations rounded to int8 codes per block of 32 (else int16 per 64): Q4_ACTIVATIONS
    cached: bool = False   # the model's weights sit in the last-level cache: the int8 GEMV fetches rows ahead
    # int8 activations on AMX: the weights repacked once into 16-column tiles (gemm_amx.c), which every row
    # count reads instead of the stored codes; None: the VNNI GEMV on the stored ones
    tiles: torch.Tensor | None = None


def q4_weights(qweight: torch.Tensor, scales: torch.Tensor, second: torch.Tensor | float,
               zero_point: bool, activations: str = "int16", cached: bool = False) -> Q4Weights | None:
    """4-bit codes as stored (uint8 [N, K / 2], two a byte, the even k in the low nibble) with scales and zero
    points or offsets [N, K / group] (or a number: the same zero point everywhere) in gemv_q4's form: as they
    are where both are fp16, else fp16 copies where every value is exactly one, else fp32 ones; None where it
    cannot run them (groups not a multiple of 32 codes). `activations` (Q4_ACTIVATIONS): how the GEMV rounds
    its activations, int8 only where it takes them (takes_int8); `cached`: the model's weights fit the
    last-level cache (weights_fit_cache)."""
    if activations not in Q4_ACTIVATIONS:
        raise LlmcError(f"4-bit GEMV activations {activations!r}: use one of {', '.join(Q4_ACTIVATIONS)}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or scales.numel() == 0 or scales.numel() % qweight.shape[0]:
        return None
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    groups = _groups(scales, n, k)
    if groups <= 0 or k % groups or (k // groups) % 32:
        return None
    s = scales.reshape(n, -1)
    other = (second.reshape(n, -1) if isinstance(second, torch.Tensor)
             else torch.full((1, groups), float(second), dtype=s.dtype if s.is_floating_point() else F32))
    s, other = _q4_params(s, other, k)
    w = Q4Weights(qweight.contiguous(), s, other, zero_point, k // groups,
                  activations == "int8" and takes_int8(k, k // groups), cached)
    return w._replace(tiles=amx_tiles(w)) if w.int8 and tiles_wanted(cached) else w


def tiles_wanted(cached: bool) -> bool:
    """Whether 4-bit weights on int8 activations go into AMX tiles: where the model's weights sit in the
    last-level cache (`cached`; a 64-row step of SmolLM2's 4-bit GEMMs 93 -> 48 ms, batch 1 even; streaming
    from DRAM at one row the tiles ran 12% slower than the VNNI GEMV on Llama-3B), or every model with
    LLMC_AMX=all (for the GEMM's prefill and batched speed); never with LLMC_AMX=0 or without AMX."""
    return (cached or os.environ.get(AMX_ENV, "").strip() == "all") and amx_ready()


def amx_ready() -> bool:
    """Whether the 4-bit GEMM on AMX tiles runs here: built with AMX-INT8 and the kernel's permission
    granted (Linux's arch_prctl), unless LLMC_AMX=0."""
    lib = _load()[0]
    return lib is not None and os.environ.get(AMX_ENV, "1").strip() != "0" and bool(lib.llmc_amx_ready())


def amx_tiles(w: Q4Weights) -> torch.Tensor | None:
    """w's codes, scales and offsets or zero points repacked into gemm_amx.c's 16-column tiles (about their
    stored size), where AMX runs here and the shapes fit; else None."""
    if not amx_ready():
        return None
    lib = _load()[0]
    n, k = w.packed.shape[0], 2 * w.packed.shape[1]
    # the tiles hold fp16 or fp32 params: packed ones are unpacked for the repack (a layer's worth at a time)
    scales, other = (group_params(w.scales, k), group_params(w.other, k)) if is_packed(w.scales) else (w.scales,
                                                                                                        w.other)
    f16, other_row = int(scales.dtype is torch.float16), 0 if other.shape[0] == 1 else other.stride(0)
    size = lib.llmc_q4_tiles_bytes(n, k, w.group, f16, other_row)
    if size <= 0:
        return None
    tiles = torch.empty(size + 64, dtype=torch.uint8)
    start = -tiles.data_ptr() % 64   # a cache line's start: the kernel's tile loads
    tiles = tiles[start:start + size]
    done = lib.llmc_q4_repack(w.packed.data_ptr(), scales.data_ptr(), other.data_ptr(), other_row, f16,
                              int(w.zero_point), n, k, w.group, tiles.data_ptr(), torch.get_num_threads())
    return tiles if done == size else None


def kernel_tensors(w: Q4Weights) -> tuple[torch.Tensor, ...]:
    """The tensors the 4-bit kernels read for w: its tiles where it has them (the stored codes, scales and
    offsets are then read only by other paths, and their pages may leave the RSS), else the stored ones."""
    return (w.tiles,) if w.int8 and w.tiles is not None else (w.packed, w.scales, w.other)


def _q4_params(scales: torch.Tensor, other: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points or offsets in one format the GEMV reads: K-quant packed or fp16 where both are
    (as they are, contiguous, where they are stored so), else fp16 where both are exactly fp16, else fp32."""
    if scales.dtype == other.dtype == torch.float16 or (is_packed(scales) and is_packed(other)):
        return scales.contiguous(), other.contiguous()
    s, o = group_params(scales, k).float(), group_params(other, k).float()
    hs, ho = s.half(), o.half()
    exact = all(bool(torch.isfinite(h).all()) and torch.equal(h.float(), f) for h, f in ((hs, s), (ho, o)))
    return (hs, ho) if exact else (s.contiguous(), o.contiguous())


def gemv_q4(x: torch.Tensor, w: Q4Weights, out: torch.Tensor | None = None,
            any_rows: bool = False) -> torch.Tensor | None:
    """x [rows, K] (fp32, a few rows) @ w.T in fp32, as gemv_q8, reading half a byte a weight: on fp32
    activations each group's weights made exactly as the reference dequantises them; on int16 codes
    s * sum(q * x) + o * sum(x) per group (o = -s * z, or the offset m). `any_rows`: more than MAX_ROWS rows
    in one call, which only the int8 path (w.int8) takes. None where it does not apply."""
    lib, threads = _gemv_lib(x, 2 * w.packed.shape[1], any_rows and w.int8)
    if lib is None:
        return None
    (rows, k), n = x.shape, w.packed.shape[0]
    y = torch.empty(rows, n, dtype=F32) if out is None else out
    if w.int8 and w.tiles is not None and takes_int8(k, w.group):   # not inside fp32_activations
        if lib.llmc_gemm_q4_amx(x.data_ptr(), x.stride(0), rows, w.tiles.data_ptr(), n, k, w.group,
                                int(w.zero_point), y.data_ptr(), threads) != 1:
            raise RuntimeError(f"the AMX 4-bit GEMM declined its own tiles ({n} x {k}, groups of {w.group}): "
                               "a bug in llmc")
        return y
    lib.llmc_gemv_q4(x.data_ptr(), x.stride(0), rows, w.packed.data_ptr(), w.scales.data_ptr(), w.other.data_ptr(),
                     q4_other_row(w), param_format(w.scales, w.group), w.zero_point, n, k, w.group, y.data_ptr(),
                     threads, q4_flags(w))
    return y


def gemm_q4_stored(x: torch.Tensor, w: Q4Weights) -> torch.Tensor | None:
    """x [rows, K] (fp32) @ w.T on AMX from the stored codes, transposed per 16 columns as read (gemm_amx.c's
    llmc_gemm_q4_stored: no repacked copy; 2.3x the GEMV's rate at 512 rows of Llama-8B's shapes on the
    2-core Xeon), the same bits as llmc_gemm_q4_amx on tiles; None where it does not apply (no AMX, fp32 or
    int16 activations, or tiles, which the GEMV path reads)."""
    k = 2 * w.packed.shape[1]
    if not (w.int8 and w.tiles is None and takes_int8(k, w.group) and amx_ready()):
        return None
    lib, threads = _gemv_lib(x, k, True)
    if lib is None:
        return None
    y = torch.empty(x.shape[0], w.packed.shape[0], dtype=F32)
    done = lib.llmc_gemm_q4_stored(x.data_ptr(), x.stride(0), x.shape[0], w.packed.data_ptr(), w.scales.data_ptr(),
                                   w.other.data_ptr(), int(q4_other_row(w) != 0), param_format(w.scales, w.group),
                                   w.zero_point, w.packed.shape[0], k, w.group, y.data_ptr(), threads)
    return y if done else None


def q4_flags(w: Q4Weights) -> int:
    """llmc_gemv_q4's flags for these weights: Q4_INT8 (1), Q4_CACHED (2), Q4_TILES (4: the decode program
    passes w.tiles to the AMX GEMM instead)."""
    return int(w.int8) | 2 * int(w.cached) | 4 * int(w.int8 and w.tiles is not None)


def weights_fit_cache(weight_bytes: int) -> bool:
    """Whether a model of `weight_bytes` would sit in this CPU's last-level cache, with half of it left for
    the KV cache and activations (Linux's sysfs; unknown: no)."""
    index = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for level in index.glob("index*"):
        try:
            text = (level / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return bool(sizes) and weight_bytes <= max(sizes) // 2


def q4_other_row(w: Q4Weights) -> int:
    """Values between two weight rows' zero points or offsets: 0 where one row serves all (a packed row
    counts as its groups: the kernels find row j's bytes from j * groups)."""
    if w.other.shape[0] == 1:
        return 0
    return _groups(w.other, w.other.shape[0], 2 * w.packed.shape[1]) if is_packed(w.other) else w.other.stride(0)


def gemv(x: torch.Tensor, w: Q8Weights | Q4Weights, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """gemv_q8 or gemv_q4 by the weights' kind (`out`: the fp32 [rows, N] to write, else a fresh one)."""
    return (gemv_q4 if type(w) is Q4Weights else gemv_q8)(x, w, out)


def gemv_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight.T (+ bias) in fp32, one dot product per output in a fixed order whatever the row
    count (MKL's GEMM rounds a row differently at 1, 2-15 and 16+ rows): the batch-invariant fp32 linear,
    the decode program's own (OP_GEMV_F32). None where it does not apply."""
    lib = _load()[0]
    threads = torch.get_num_threads()
    if (lib is None or x.dtype is not F32 or weight.dtype is not F32 or weight.dim() != 2 or not x.is_cpu
            or not weight.is_contiguous() or x.shape[-1] != weight.shape[1] or (threads > 1 and not lib.openmp)
            or (bias is not None and (bias.dtype is not F32 or not bias.is_contiguous()
                                      or bias.shape != (weight.shape[0],)))):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], weight.shape[0], dtype=F32)
    if rows.shape[0]:
        lib.llmc_gemv_f32(rows.data_ptr(), rows.stride(0), rows.shape[0], weight.data_ptr(),
                          None if bias is None else bias.data_ptr(), weight.shape[0], weight.shape[1], y.data_ptr(),
                          threads)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def swiglu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for fp32 rows [rows, 2 * inter] holding gate then up, as the decode program's
    OP_SWIGLU rounds it, for any number of rows; None where it does not apply."""
    lib = _load()[0]
    if lib is None or gate_up.dtype is not F32 or gate_up.dim() != 2 or gate_up.stride(1) != 1 \
            or gate_up.shape[1] % 2 or not gate_up.is_cpu:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=F32)
    lib.llmc_swiglu(gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr())
    return out


def gemv_runs() -> bool:
    """Whether the GEMVs run at torch's thread count now: built, and with OpenMP or on one thread."""
    lib = _load()[0]
    return lib is not None and (lib.openmp or torch.get_num_threads() == 1)


def gemm(x: torch.Tensor, w: Q8Weights | Q4Weights, invariant: bool = True) -> torch.Tensor | None:
    """gemv over any number of rows x [rows, K]: one call where the activations round to integer codes (4-bit
    weights on int8 ones, int8 weights on int16 ones: the weights read once, MAX_ROWS rows against each
    weight row at a time), else MAX_ROWS rows a call; None where it does not apply. Not `invariant` (a
    prefill outside batch-invariant mode): 4-bit weights on int8 activations without tiles take the AMX GEMM
    on the stored codes (gemm_q4_stored), whose rows round differently from the GEMV's."""
    if x.shape[0] <= MAX_ROWS:
        return gemv(x, w)
    if not invariant and type(w) is Q4Weights:
        y = gemm_q4_stored(x, w)
        if y is not None:
            return y
    if type(w) is Q4Weights and w.int8 and takes_int8(2 * w.packed.shape[1], w.group):   # not inside fp32_activations
        return gemv_q4(x, w, any_rows=True)
    if type(w) is Q8Weights and q8_takes_int16(w):
        return gemv_q8(x, w, any_rows=True)
    y = torch.empty(x.shape[0], (w.packed if type(w) is Q4Weights else w.codes).shape[0], dtype=F32)
    for start in range(0, x.shape[0], MAX_ROWS):
        if gemv(x[start:start + MAX_ROWS], w, y[start:start + MAX_ROWS]) is None:
            return None
    return y


__all__ = ["available", "status", "timing_key", "read_step", "decode_attention_bf16", "add_rms_norm", "q8_weights",
           "gemv_q8", "Q8Weights", "set_int16_activations", "int16_activations", "Q4_ACTIVATIONS", "takes_int8",
           "q4_flags", "weights_fit_cache", "q8_takes_int16", "amx_ready", "amx_tiles", "tiles_wanted",
           "kernel_tensors",
           "gemv_runs", "gemm", "gemm_q4_stored",
           "fp32_activations", "q4_weights", "gemv_q4", "Q4Weights", "q4_other_row", "gemv", "decode_step",
           "cache_pointers",
           "decode_attention", "DecodeStep", "MAX_ROWS", "gemv_f32", "swiglu"]
