"""llmc IR ops as ONNX nodes, shared by the standalone ONNX export (codegen/ort/onnx_export.py) and the
ONNX Runtime kernel family's plan segments (codegen/ort/ort_lowering.py). An export holds its weights
and keeps to standard ONNX where it can; a segment takes its weights from the artifact at load and
uses ONNX Runtime's contrib ops where they are the fast path (MatMulNBits with int8 compute for int4
and int8 weights, fused skip + RMS norm). onnx is imported inside functions: the runtime imports
codegen modules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import numpy as np
import torch

from llmc.codegen.ort.onnx_weights import initializer, integral_zeros
from llmc.codegen.ort.ort_int8 import signed_int8_exact
from llmc.compiler.ops import qlinear_inputs
from llmc.compiler.schemes import SCHEMES
from llmc.compiler.weight_store import WeightStore, values_of

OPSET = 17
MS_DOMAIN = "com.microsoft"
# MatMulNBits' accuracy_level: 4 quantises the activations to int8 per block and multiplies codes
# (the fast CPU path, ~0.5% off the fp32 product); 1 keeps them fp32 and dequantises the weights
# block by block (exact to float rounding; MLAS has a fast 4-bit path for it, 8-bit runs ~50x slower)
INT8_COMPUTE = 4
FP32_COMPUTE = 1
AFFINE_BITS = {s.name: s.bits for s in SCHEMES.values() if s.gguf}   # a GGUF's blocks kept (compiler/schemes.py)
NBITS_INT8_BLOCKS = (32, 16)    # the block size an int8 row's K is cut into (the first that divides K)


class OnnxBuilder:
    """Collects the nodes and initializers of one ONNX graph. `segment`: weights become external
    initializers (name -> (param, transform) in `sources`, their tensors in `values`) and the
    translations take ORT's contrib ops; otherwise weights are embedded and ops stay standard where
    an equal standard form exists."""

    def __init__(self, graph, weights: dict, segment: bool = False, nbits_level: int = INT8_COMPUTE):
        self.graph, self.weights, self.segment, self.nbits_level = graph, weights, segment, nbits_level
        self.env = {v.name: v.name for v in graph.inputs}
        self.nodes, self.initializers = [], []
        self.sources: dict[str, tuple[str, str]] = {}
        self.values = LazyInitializers()
        self._inits, self._cache, self._count = set(), {}, 0
        self.uses_ms = False

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}/{self._count}"

    def add(self, op: str, inputs: list[str], outputs: list[str] | None = None, domain: str = "", **attrs) -> list[str]:
        from onnx import helper  # onnx: `llmc --help` and the engine import this module
        outputs = outputs or [self.fresh(op)]
        self.uses_ms |= domain == MS_DOMAIN
        self.nodes.append(helper.make_node(op, inputs, outputs, name=self.fresh(f"n/{op}"), domain=domain or None,
                                           **attrs))
        return outputs

    def one(self, op: str, *inputs: str, **attrs) -> str:
        return self.add(op, list(inputs), **attrs)[0]

    def const(self, name: str, array) -> str:
        """An initializer (added once per name)."""
        from onnx import numpy_helper  # onnx: `llmc --help` and the engine import this module
        if name not in self._inits:
            self._inits.add(name)
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, *values: int) -> str:
        return self.const(f"const/i64/{'_'.join(map(str, values))}", np.array(values, dtype=np.int64))

    def i64(self, value: int) -> str:
        """A scalar int64 constant (Range and Gather's index take scalars, not ints' 1-d tensors)."""
        return self.const(f"const/i64s/{value}", np.array(value, dtype=np.int64))

    def scalar(self, value: float) -> str:
        return self.const(f"const/f32/{value!r}", np.array(value, dtype=np.float32))

    def weight(self, name: str, transform: str = "same", dims: tuple[int, ...] | None = None) -> str:
        """The param `name` under `transform` (codegen/ort/onnx_weights.py), shaped `dims` (default: as
        the transform gives it), as an initializer."""
        key = name if transform == "same" and dims is None else \
            f"{name}.{transform}" + ("" if dims is None else "." + "x".join(map(str, dims)))
        if key in self._inits:
            return key
        if not self.segment:
            return self.const(key, initializer(self.weights[name].detach().cpu(), transform, dims).numpy())
        self._inits.add(key)
        # declared from its shape alone: the weight is read (a lazy one from its source) and made
        # only if a session is built here, and not held by the builder before that
        entry = self.weights.entry(name) if isinstance(self.weights, WeightStore) else self.weights[name]
        shape = torch.empty(tuple(entry.shape), dtype=entry.dtype, device="meta")
        self.initializers.append(_external(key, initializer(shape, transform, dims)))
        self.sources[key] = (name, transform)
        self.values.add(key, lambda: initializer(values_of(entry).detach().cpu(), transform, dims))
        return key

    def value(self, ir_name: str) -> str:
        if ir_name in self.graph.params:
            return self.weight(ir_name)
        return self.env[ir_name]

    def bind(self, node, *names: str) -> None:
        for v, name in zip(node.outputs, names):
            self.env[v.name] = name

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


class LazyInitializers(Mapping):
    """A segment's external initializers by name, each made from its parameter on first read: a
    compile whose kernel timings are all cached builds no session and reads none (transforming
    SmolLM2's Q8_0 head into nibble halves alone took seconds)."""

    def __init__(self):
        self._make: dict[str, Callable[[], torch.Tensor]] = {}
        self._made: dict[str, torch.Tensor] = {}

    def add(self, key: str, make: Callable[[], torch.Tensor]) -> None:
        self._make[key] = make

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._made:
            self._made[key] = self._make[key]()
        return self._made[key]

    def __iter__(self):
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


# An external initializer's data location: never read, the runtime supplies every such tensor
# (SessionOptions.add_external_initializers) before the session is built.
EXTERNAL_LOCATION = "llmc-plan-param"


def _external(name: str, value):
    """A TensorProto declaring `value`'s dims and dtype with its data left external."""
    from onnx import TensorProto, helper  # onnx: `llmc --help` and the engine import this module

    t = TensorProto()
    t.name = name
    t.data_type = helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=value.dtype).numpy().dtype)
    t.dims.extend(value.shape)
    t.data_location = TensorProto.EXTERNAL
    nbytes = value.numel() * value.element_size()
    for key, v in (("location", EXTERNAL_LOCATION), ("offset", "0"), ("length", str(nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, v
    return t


# -- translations: one per op family --------------------------------------------------------------
def _embedding(b: OnnxBuilder, n) -> None:
    b.bind(n, b.one("Gather", b.value(n.inputs[1]), b.value(n.inputs[0]), axis=0))


def _qembedding(b: OnnxBuilder, n) -> None:
    """Gather the rows' codes (int4: unpacked, one uint8 a code) and scales, then dequantise as
    compiler/quant.py does: int8 q * s per row, int4 (q - z) * s per group along the hidden dim."""
    ids = b.value(n.inputs[0])
    qweight, scales = n.inputs[1:3]
    rows = lambda name: b.one("Gather", name, ids, axis=0)
    dim = n.attrs["embedding_dim"]
    if n.attrs["scheme"] == "int8":
        codes = b.one("Cast", rows(b.weight(qweight)), to=1)
        out = b.one("Mul", codes, b.one("Unsqueeze", rows(b.weight(scales, "f32")), b.ints(-1)))
    elif n.attrs["scheme"] in AFFINE_BITS:
        out = _affine_rows(b, n, rows)
    else:
        groups = b.graph.type_of(scales).shape[1]
        codes = b.one("Reshape", b.one("Cast", rows(b.weight(qweight, "int4_codes")), to=1),
                      b.ints(0, groups, dim // groups))
        z, s = (b.one("Unsqueeze", rows(b.weight(t, "f32")), b.ints(-1)) for t in (n.inputs[3], scales))
        out = b.one("Reshape", b.one("Mul", b.one("Sub", codes, z), s), b.ints(0, dim))
    b.bind(n, out)


def _affine_rows(b: OnnxBuilder, n, rows) -> str:
    """The selected rows of a grouped affine table, dequantised as compiler.quant.dequantize_affine."""
    dim, qweight, scales = n.attrs["embedding_dim"], n.inputs[1], n.inputs[2]
    mins = n.inputs[3] if n.attrs.get("has_zeros") else None
    vocab, groups = b.graph.type_of(qweight).shape[0], dim // n.attrs["group_size"]
    four = n.attrs["scheme"] == "affine4"
    codes = b.one("Cast", rows(b.weight(qweight, "int4_codes" if four else "same")), to=1)
    codes = b.one("Reshape", codes, b.ints(0, groups, dim // groups))
    if four and mins is None:
        codes = b.one("Sub", codes, b.scalar(8.0))
    out = b.one("Mul", codes, b.one("Unsqueeze", rows(b.weight(scales, "f32", (vocab, groups))), b.ints(-1)))
    if mins is not None:
        out = b.one("Add", out, b.one("Unsqueeze", rows(b.weight(mins, "f32", (vocab, groups))), b.ints(-1)))
    return b.one("Reshape", out, b.ints(0, dim))


def _rms(b: OnnxBuilder, x: str, weight: str, eps: float) -> str:
    mean = b.one("ReduceMean", b.one("Mul", x, x), axes=[-1], keepdims=1)
    inv = b.one("Reciprocal", b.one("Sqrt", b.one("Add", mean, b.scalar(eps))))
    return b.one("Mul", b.value(weight), b.one("Mul", x, inv))


def _rms_norm(b: OnnxBuilder, n) -> None:
    x, eps = b.value(n.inputs[0]), float(n.attrs["eps"])
    if b.segment:   # ORT's fused kernel (registered in the ONNX domain by onnxruntime)
        b.bind(n, b.one("SimplifiedLayerNormalization", x, b.value(n.inputs[1]), axis=-1, epsilon=eps))
        return
    b.bind(n, _rms(b, x, n.inputs[1], eps))


def _add_rms_norm(b: OnnxBuilder, n) -> None:
    x, residual, eps = b.value(n.inputs[0]), b.value(n.inputs[1]), float(n.attrs["eps"])
    if b.segment:   # output 3 is input + skip, the residual stream going on
        norm, summed = b.fresh("skip_norm"), b.fresh("skip_sum")
        b.add("SkipSimplifiedLayerNormalization", [x, residual, b.value(n.inputs[2])], [norm, "", "", summed],
              domain=MS_DOMAIN, epsilon=eps)
        b.bind(n, norm, summed)
        return
    summed = b.one("Add", x, residual)
    b.bind(n, _rms(b, summed, n.inputs[2], eps), summed)


def _linear(b: OnnxBuilder, n) -> None:
    x = b.value(n.inputs[0])
    bias = [b.value(n.inputs[2])] if len(n.inputs) == 3 else []
    if len(b.graph.type_of(n.inputs[0]).shape) == 2:    # Gemm reads the [N, K] weight as stored
        b.bind(n, b.one("Gemm", x, b.weight(n.inputs[1]), *bias, transB=1))
        return
    y = b.one("MatMul", x, b.weight(n.inputs[1], "T"))
    b.bind(n, b.one("Add", y, bias[0]) if bias else y)


def _qlinear(b: OnnxBuilder, n) -> None:
    x, qweight, scales, zeros, _, bias = qlinear_inputs(list(n.inputs), n.attrs)
    k, out, scheme = n.attrs["in_features"], n.attrs["out_features"], n.attrs["scheme"]
    if scheme == "int4":
        y = _matmul_nbits4(b, b.value(x), qweight, scales, zeros, k, out, n.attrs["group_size"])
    elif scheme == "w8a8":
        y = _w8a8_matmul(b, b.value(x), qweight, scales, k)
    elif scheme in AFFINE_BITS:
        y = _affine_matmul(b, b.value(x), n.attrs, qweight, scales, zeros)
    elif b.segment:
        y = _matmul_nbits8(b, b.value(x), qweight, scales, k, out)
    else:
        # Cast * scales, not DequantizeLinear: ORT's QDQ fusion would turn DequantizeLinear + MatMul into
        # an integer matmul over dynamically quantised activations, which the artifact does not do.
        w = b.one("Mul", b.one("Cast", b.weight(qweight, "T"), to=1), b.weight(scales, "f32", (1, out)))
        y = b.one("MatMul", b.value(x), w)
    if bias is not None:
        y = b.one("Add", y, b.value(bias))
    b.bind(n, y)


def _nbits_level(b: OnnxBuilder) -> dict:
    return {"accuracy_level": b.nbits_level} if b.segment else {}


def _matmul_nbits4(b: OnnxBuilder, x: str, qweight: str, scales: str, zeros: str, k: int, n: int, block: int) -> str:
    """com.microsoft MatMulNBits: llmc's packing (uint8 [N, K/2], low nibble = even k) is ORT's B
    [N, K/block, block/2]; scales [N * K/block]; integer zero points packed two a byte like the codes."""
    blocks = k // block
    qb = b.weight(qweight, "same", (n, blocks, block // 2))
    sc = b.weight(scales, "f32", (n * blocks,))
    if integral_zeros(b.weights[zeros]):
        zp = b.weight(zeros, "nibble_zeros", (n * ((blocks + 1) // 2),))
    else:
        zp = b.weight(zeros, "f32", (n * blocks,))
    return b.add("MatMulNBits", [x, qb, sc, zp], domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=block,
                 **_nbits_level(b))[0]


def nbits_int8_block(k: int) -> int | None:
    """The MatMulNBits block an int8 row of `k` inputs is cut into; None when none divides k."""
    return next((block for block in NBITS_INT8_BLOCKS if k % block == 0), None)


def _matmul_nbits8(b: OnnxBuilder, x: str, qweight: str, scales: str, k: int, n: int) -> str:
    """int8 per-row weights as MatMulNBits bits=8: codes + 128 as unsigned (its default zero point),
    each row's scale repeated over its blocks."""
    block = nbits_int8_block(k)
    blocks = k // block
    qb = b.weight(qweight, "u8", (n, blocks, block))
    sc = b.weight(scales, "scales_per_block", (n * blocks,))
    return b.add("MatMulNBits", [x, qb, sc], domain=MS_DOMAIN, K=k, N=n, bits=8, block_size=block,
                 **_nbits_level(b))[0]


def _affine_matmul(b: OnnxBuilder, x: str, attrs: dict, qweight: str, scales: str, mins: str | None) -> str:
    """GGUF's grouped affine codes (compiler/quant.py), w = q * s + m per group of g along K, without
    widening them: MatMulNBits over the codes with zero point 0 (affine4 with minimums), 8 (affine4
    without: w = (q - 8) * s) or 128 (affine8 on int8 activations, carried as uint8 q + 128; on fp32
    ones, two 4-bit halves: _split_affine8), plus, with minimums, sum_g m_g * (the sum of x over
    group g): a [tokens, K/g] x [K/g, N] product. (Float zero points -m/s would be exact too, but
    ORT runs them about 200x slower.)"""
    k, n, group, bits = attrs["in_features"], attrs["out_features"], attrs["group_size"], AFFINE_BITS[attrs["scheme"]]
    blocks = k // group
    if bits == 8 and (not b.segment or b.nbits_level != INT8_COMPUTE):
        y = _split_affine8(b, x, qweight, scales, k, n, group)
    else:
        codes = (b.weight(qweight, "same", (n, blocks, group // 2)) if bits == 4
                 else b.weight(qweight, "u8", (n, blocks, group)))
        inputs = [x, codes, b.weight(scales, "f32", (n * blocks,))]
        if bits == 4 and mins is not None:
            inputs.append(_zero_points(b, n, blocks))
        y = b.add("MatMulNBits", inputs, domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=group,
                  **_nbits_level(b))[0]
    if mins is None:
        return y
    group_sums = b.one("ReduceSum", b.one("Reshape", x, b.ints(0, blocks, group)), b.ints(-1), keepdims=0)
    return b.one("Add", y, b.one("Gemm", group_sums, b.weight(mins, "f32", (n, blocks)), transB=1))


def _zero_points(b: OnnxBuilder, n: int, blocks: int) -> str:
    """4-bit MatMulNBits zero points of 0 for every block (packed two a byte)."""
    return b.const(f"const/u8/zeros/{n}x{blocks}", np.zeros(n * ((blocks + 1) // 2), np.uint8))


def _split_affine8(b: OnnxBuilder, x: str, qweight: str, scales: str, k: int, n: int, group: int) -> str:
    """x @ (q * s)^T for 8-bit codes on fp32 activations, as two 4-bit MatMulNBits over the codes'
    halves q = 16 h + l: exact, and ORT runs it 15-30x faster than bits=8 on fp32 activations, which
    has no fast x86 kernel (SmolLM2's Q8_0 head, one token: 2.5-5.6 ms against 82 ms; torch's dense
    fp32 GEMM 8-9 ms)."""
    blocks = k // group
    high = b.add("MatMulNBits", [x, b.weight(qweight, "high_nibbles", (n, blocks, group // 2)),
                                 b.weight(scales, "f32_x16", (n * blocks,))],
                 domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=group, **_nbits_level(b))[0]
    low = b.add("MatMulNBits", [x, b.weight(qweight, "low_nibbles", (n, blocks, group // 2)),
                                b.weight(scales, "f32", (n * blocks,)), _zero_points(b, n, blocks)],
                domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=group, **_nbits_level(b))[0]
    return b.one("Add", high, low)


def _w8a8_matmul(b: OnnxBuilder, x: str, qweight: str, scales: str, k: int) -> str:
    """compiler.quant.fake_quant_int8_per_token's codes, multiplied exactly: per-token scale
    max|x| / 127 (1 where a row is zero), codes round(x / s) in -127..127, int32 sums times both
    scales. The activations' codes are carried as uint8 + 128 (zero point 128); the weights' as
    int8 in a segment on a machine where u8 x s8 is exact (codegen/ort/ort_int8.py), else as uint8 + 128
    too: MLAS's u8 x s8 kernel saturates int16 pair sums on AVX2 machines without VNNI (measured:
    sums off by 10^5), u8 x u8 does not."""
    amax = b.one("ReduceMax", b.one("Abs", x), axes=[-1], keepdims=1)
    s = b.one("Div", amax, b.scalar(127.0))
    s = b.one("Where", b.one("Greater", s, b.scalar(0.0)), s, b.scalar(1.0))
    unsigned = _codes_per_token(b, x, s, k)
    zero = b.const("const/u8/128", np.array(128, np.uint8))
    signed = b.segment and signed_int8_exact()   # the weights' own int8 codes: VNNI's u8 x s8 kernel
    codes = b.weight(qweight, "T" if signed else "T_u8")
    zeros = [zero] if signed else [zero, zero]
    if b.segment:   # the int32 sums times the weights' scales in the GEMM's epilogue (1.2x the Cast/Mul)
        y = b.add("MatMulIntegerToFloat", [unsigned, codes, b.scalar(1.0), b.weight(scales, "f32"), *zeros],
                  domain=MS_DOMAIN)[0]
        return b.one("Mul", y, s)
    acc = b.one("MatMulInteger", unsigned, codes, *zeros)
    return b.one("Mul", b.one("Mul", b.one("Cast", acc, to=1), s), b.weight(scales, "f32"))


def _codes_per_token(b: OnnxBuilder, x: str, s: str, k: int) -> str:
    """uint8 round(x / s) + 128 for each token's row of x and its scale s [.., 1], in one
    QuantizeLinear along the token axis (4x the Div/Round/Clip/Add/Cast chain at 512 x 576). Its
    division and round-half-to-even are the chain's, and |x / s| <= 127 by s's construction, so
    its saturation at 0..255 never binds: the codes are the same."""
    from onnx import numpy_helper  # onnx: `llmc --help` and the engine import this module
    rows = b.one("Reshape", x, b.ints(-1, k))
    scale = b.one("Reshape", s, b.ints(-1))
    zeros = b.one("ConstantOfShape", b.one("Shape", scale), value=numpy_helper.from_array(np.array([128], np.uint8)))
    return b.one("Reshape", b.one("QuantizeLinear", rows, scale, zeros, axis=0), b.one("Shape", x))


def _elementwise(op: str):
    def build(b: OnnxBuilder, n) -> None:
        b.bind(n, b.one(op, *(b.value(i) for i in n.inputs)))
    return build


def _silu(b: OnnxBuilder, x: str) -> str:
    return b.one("Mul", x, b.one("Sigmoid", x))


def _swiglu(b: OnnxBuilder, n) -> None:
    if len(n.inputs) == 2:
        gate, up = (b.value(i) for i in n.inputs)
    else:
        half = n.outputs[0].type.shape[-1]
        gate, up = b.add("Split", [b.value(n.inputs[0]), b.ints(half, half)], [b.fresh("gate"), b.fresh("up")],
                         axis=-1)
    b.bind(n, b.one("Mul", _silu(b, gate), up))


def _split(b: OnnxBuilder, n) -> None:
    sizes = n.attrs["sizes"]
    b.bind(n, *b.add("Split", [b.value(n.inputs[0]), b.ints(*sizes)], [b.fresh("split") for _ in sizes], axis=-1))


def _select_rows(b: OnnxBuilder, n) -> None:
    if b.segment:
        b.bind(n, b.one("Gather", b.value(n.inputs[0]), b.value(n.inputs[1]), axis=0))
        return
    b.bind(n, b.value(n.inputs[0]))  # the export returns the logits of every token


def rope_angles(b: OnnxBuilder, positions: str, inv_freq: str) -> str:
    """position x inv_freq, [tokens, head_dim / 2] (once per graph)."""
    return b.cached(("rope_angles", positions, inv_freq), lambda: b.one(
        "Mul", b.one("Unsqueeze", b.one("Cast", b.value(positions), to=1), b.ints(1)), b.value(inv_freq)))


def cos_sin(b: OnnxBuilder, positions: str, inv_freq: str, scaling: float) -> tuple[str, str]:
    """cos/sin [tokens, 1, head_dim] as rope_cos_sin makes them (rotate-half tables)."""
    def make():
        freqs = rope_angles(b, positions, inv_freq)
        emb = b.one("Concat", freqs, freqs, axis=-1)
        cos, sin = (b.one("Unsqueeze", b.one("Mul", b.one(f, emb), b.scalar(scaling)), b.ints(1))
                    for f in ("Cos", "Sin"))
        return cos, sin
    return b.cached(("rope", positions, inv_freq, scaling), make)


def apply_rope(b: OnnxBuilder, x: str, cos: str, sin: str, head_dim: int) -> str:
    """x [tokens, heads * head_dim] -> x * cos + rotate_half(x) * sin, as [tokens, heads, head_dim]."""
    h = b.one("Reshape", x, b.ints(0, -1, head_dim))
    half = head_dim // 2
    x1, x2 = b.add("Split", [h, b.ints(half, half)], [b.fresh("x1"), b.fresh("x2")], axis=-1)
    rotated = b.one("Concat", b.one("Neg", x2), x1, axis=-1)
    return b.one("Add", b.one("Mul", h, cos), b.one("Mul", rotated, sin))


def _rope(b: OnnxBuilder, n) -> None:
    cos, sin = cos_sin(b, n.inputs[1], n.inputs[2], n.attrs.get("scaling", 1.0))
    out = apply_rope(b, b.value(n.inputs[0]), cos, sin, n.attrs["head_dim"])
    b.bind(n, b.one("Reshape", out, b.ints(0, -1)))


# op -> translation(builder, node); attention (which reads a KV cache) is the export's own
TRANSLATIONS = {
    "embedding": _embedding, "qembedding": _qembedding, "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm,
    "linear": _linear, "qlinear": _qlinear, "split": _split, "swiglu": _swiglu, "select_rows": _select_rows,
    "rope": _rope, "silu": lambda b, n: b.bind(n, _silu(b, b.value(n.inputs[0]))),
    "mul": _elementwise("Mul"), "add": _elementwise("Add"),
}

# (domain, op) of every node a segment's translations emit: what the runtime lets a segment run
SEGMENT_OPS = {("", op) for op in (
    "Abs", "Add", "And", "Cast", "Clip", "Concat", "ConstantOfShape", "Cos", "Div", "Gather", "Gemm", "Greater",
    "GreaterOrEqual", "Identity", "Less", "MatMul", "MatMulInteger", "Mul", "Neg", "QuantizeLinear", "Range",
    "ReduceMax", "ReduceMean", "ReduceSum", "Reciprocal", "Reshape", "Round", "Shape", "Sigmoid", "Slice",
    "SimplifiedLayerNormalization", "Sin", "Softmax", "Split", "Sqrt", "Sub", "Transpose", "Unsqueeze", "Where")} | {
    (MS_DOMAIN, op) for op in ("FusedMatMul", "MatMulIntegerToFloat", "MatMulNBits", "RotaryEmbedding",
                               "SkipSimplifiedLayerNormalization")}

__all__ = ["OnnxBuilder", "TRANSLATIONS", "SEGMENT_OPS", "OPSET", "MS_DOMAIN", "EXTERNAL_LOCATION", "cos_sin",
           "apply_rope", "rope_angles", "nbits_int8_block", "INT8_COMPUTE", "FP32_COMPUTE"]
