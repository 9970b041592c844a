"""Export an artifact's IR as a standalone ONNX decoder: input ids, positions and every layer's past
keys/values in; logits for every token and the present keys/values out, so plain onnxruntime runs
it without llmc. onnx is imported inside the functions (the runtime imports codegen modules)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from llmc.compiler.artifact import OutputKind, read_artifact, staged_output
from llmc.errors import LlmcError

OPSET = 17
MARKER = "llmc_onnx.json"           # what a previous export holds; --force replaces only such a directory
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with headroom
QLINEAR_SCHEMES = ("int8", "int4")


class ExportError(LlmcError):
    """The artifact holds something this exporter does not translate, or the output is taken."""


def export_onnx(artifact_path, output, force: bool = False) -> Path:
    """Write DIR/model.onnx, DIR/tokenizer/ and DIR/llmc_onnx.json for the artifact at `artifact_path`,
    via a staging sibling renamed into place (nothing is left behind on failure)."""
    import onnx

    from llmc.compiler.ir import Graph

    artifact = read_artifact(artifact_path)
    graph = Graph.from_json(artifact.graph_json)
    with staged_output(Path(output), force, EXPORT) as staging:
        model, config = build_model(graph, artifact.weights)
        large = not _fits_protobuf(model)
        onnx.save_model(model, str(staging / "model.onnx"), save_as_external_data=large,
                        all_tensors_to_one_file=True, location="model.onnx.data")
        onnx.checker.check_model(str(staging / "model.onnx"), full_check=True)
        shutil.copytree(artifact.tokenizer_dir, staging / "tokenizer")
        (staging / MARKER).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return Path(output)


def _fits_protobuf(model) -> bool:
    return sum(t.ByteSize() for t in model.graph.initializer) < EXTERNAL_DATA_BYTES


def export_problem(path: Path) -> str | None:
    """Why `path` is not a previous ONNX export (for --force), or None when it is."""
    if path.is_symlink() or not path.is_dir() or not (path / MARKER).is_file():
        return f"is not a previous ONNX export (no {MARKER})"
    return None


EXPORT = OutputKind("ONNX export", "export", export_problem)


# -- IR -> ONNX --------------------------------------------------------------------------------
def build_model(graph, weights: dict):
    """(onnx ModelProto, config dict) for an llmc IR graph and its weights."""
    from onnx import TensorProto, helper

    _refuse_unsupported(graph)
    meta = graph.meta
    b = _Builder(graph, weights)
    shapes = _kv_shapes(graph)
    layers = sorted(shapes)
    kv_type = lambda name, dim, layer: helper.make_tensor_value_info(name, TensorProto.FLOAT, [dim, *shapes[layer]])
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["tokens"]),
              helper.make_tensor_value_info("positions", TensorProto.INT64, ["tokens"])]
    outputs = []
    for layer in layers:
        inputs += [kv_type(f"past_{kind}.{layer}", "past_len", layer) for kind in ("key", "value")]
    for node in graph.nodes:
        BUILDERS[node.op](b, node)
    vocab = graph.type_of(graph.outputs[0]).shape[-1]
    b.add("Identity", [b.env[graph.outputs[0]]], ["logits"])
    outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["tokens", vocab]))
    for layer in layers:
        outputs += [kv_type(f"present_{kind}.{layer}", "total_len", layer) for kind in ("key", "value")]
    onnx_graph = helper.make_graph(b.nodes, graph.name or "llmc", inputs, outputs, b.initializers)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid("com.microsoft", 1)] if b.uses_ms else [])
    model = helper.make_model(onnx_graph, opset_imports=opsets, producer_name="llmc")
    model.ir_version = 8
    kv_heads, head_dim = shapes[layers[0]]
    if len(set(shapes.values())) > 1:  # pruned heads: per layer
        kv_heads = [shapes[layer][0] for layer in layers]
    config = {"format": "llmc-onnx", "version": 1, "model": "model.onnx", "opset": OPSET,
              "num_layers": len(layers), "num_kv_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
              "eos_token_ids": meta.get("eos_token_ids", []), "bos_token_id": meta.get("bos_token_id"),
              "inputs": {"input_ids": "int64[tokens]", "positions": "int64[tokens]",
                         "past_key.L / past_value.L": f"float32[past_len, {kv_heads}, {head_dim}]"},
              "outputs": {"logits": f"float32[tokens, {vocab}] (every token)",
                          "present_key.L / present_value.L": f"float32[past_len + tokens, {kv_heads}, {head_dim}] "
                                                             "(past then this step; keys after rotary)"},
              "attention": "causal: query i sits at position past_len + i and sees keys 0..past_len + i"}
    return model, config


def _kv_shapes(graph) -> dict[int, tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's cache, by the attention nodes' `layer`."""
    shapes = {n.attrs["layer"]: (n.attrs["num_kv_heads"], n.attrs["head_dim"])
              for n in graph.nodes if n.op in ("attention", "flash_attention")}
    if not shapes:
        raise ExportError(f"graph {graph.name} has no attention node; only decoder LLMs export to ONNX")
    return shapes


def _refuse_unsupported(graph) -> None:
    for n in graph.nodes:
        why = None
        if n.op not in BUILDERS:
            why = f"op {n.op}{' ' + n.attrs.get('target', '') if n.op == 'aten' else ''} has no ONNX translation"
        elif n.op in ("attention", "flash_attention") and n.attrs.get("kv_cache") is not None:
            why = f"a quantised KV cache ({n.attrs['kv_cache']}) does not export; compile without --kv-cache"
        elif n.op == "qlinear" and (n.attrs["scheme"] not in QLINEAR_SCHEMES or n.attrs.get("has_act_scale")):
            why = (f"quantisation scheme {n.attrs['scheme']} does not export (int8 and int4 do); "
                   f"export an fp32, int8 or int4 artifact")
        elif any(v.type.dtype not in ("float32", "int64", "int32") for v in n.outputs):
            why = "only float32 activations export; compile without --dtype/cast passes"
        elif n.op in ("attention", "flash_attention") and any(
                len(graph.type_of(i).shape) != 2 for i in n.inputs[:3]):
            why = "attention inputs with leading batch dims do not export"
        if why:
            raise ExportError(f"node {n.name} ({n.op}): {why}")


class _Builder:
    def __init__(self, graph, weights: dict):
        self.graph, self.weights = graph, weights
        self.env = {v.name: v.name for v in graph.inputs}
        self.nodes, self.initializers = [], []
        self._inits, self._cache, self._count = set(), {}, 0
        self.uses_ms = False

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}/{self._count}"

    def add(self, op: str, inputs: list[str], outputs: list[str] | None = None, domain: str = "", **attrs) -> list[str]:
        from onnx import helper
        outputs = outputs or [self.fresh(op)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=self.fresh(f"n/{op}"), domain=domain or None,
                                           **attrs))
        return outputs

    def one(self, op: str, *inputs: str, **attrs) -> str:
        return self.add(op, list(inputs), **attrs)[0]

    def const(self, name: str, array) -> str:
        """An initializer (added once per name)."""
        from onnx import numpy_helper
        if name not in self._inits:
            self._inits.add(name)
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, *values: int) -> str:
        return self.const(f"const/i64/{'_'.join(map(str, values))}", np.array(values, dtype=np.int64))

    def scalar(self, value: float) -> str:
        return self.const(f"const/f32/{value!r}", np.array(value, dtype=np.float32))

    def weight(self, name: str, transform=None, suffix: str = "") -> str:
        """The param `name` as an initializer, optionally transformed (a numpy function)."""
        key = name + suffix
        if key not in self._inits:
            array = self.weights[name].detach().cpu().numpy()
            self.const(key, transform(array) if transform else array)
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


# -- builders: one per op family ----------------------------------------------------------------
def _embedding(b: _Builder, n) -> None:
    b.bind(n, b.one("Gather", b.value(n.inputs[1]), b.value(n.inputs[0]), axis=0))


def _qembedding(b: _Builder, n) -> None:
    """Gather the rows' codes (int4: unpacked at export, one uint8 a code) and scales, then dequantise
    as compiler/quant.py does: int8 q * s per row, int4 (q - z) * s per group along the hidden dim."""
    from llmc.compiler.quant import unpack_int4

    ids, qweight, scales = (b.value(i) if i not in b.graph.params else i for i in n.inputs[:3])
    rows = lambda name, **kw: b.one("Gather", name, ids, axis=0)
    dim = n.attrs["embedding_dim"]
    if n.attrs["scheme"] == "int8":
        codes = b.one("Cast", rows(b.weight(qweight)), to=1)
        out = b.one("Mul", codes, b.one("Unsqueeze", rows(b.weight(scales, lambda s: s.astype(np.float32),
                                                                    ".f32")), b.ints(-1)))
    else:
        import torch
        groups = b.graph.type_of(scales).shape[1]
        codes = b.weight(qweight, lambda q: unpack_int4(torch.from_numpy(q)).numpy(), ".codes")
        codes = b.one("Reshape", b.one("Cast", rows(codes), to=1), b.ints(0, groups, dim // groups))
        z, s = (b.one("Unsqueeze", rows(b.weight(t, lambda a: a.astype(np.float32), ".f32")), b.ints(-1))
                for t in (n.inputs[3], scales))
        out = b.one("Reshape", b.one("Mul", b.one("Sub", codes, z), s), b.ints(0, dim))
    b.bind(n, out)


def _rms(b: _Builder, x: str, weight: str, eps: float) -> str:
    mean = b.one("ReduceMean", b.one("Mul", x, x), axes=[-1], keepdims=1)
    inv = b.one("Reciprocal", b.one("Sqrt", b.one("Add", mean, b.scalar(eps))))
    return b.one("Mul", b.value(weight), b.one("Mul", x, inv))


def _rms_norm(b: _Builder, n) -> None:
    b.bind(n, _rms(b, b.value(n.inputs[0]), n.inputs[1], n.attrs["eps"]))


def _add_rms_norm(b: _Builder, n) -> None:
    summed = b.one("Add", b.value(n.inputs[0]), b.value(n.inputs[1]))
    b.bind(n, _rms(b, summed, n.inputs[2], n.attrs["eps"]), summed)


def _linear(b: _Builder, n) -> None:
    y = b.one("MatMul", b.value(n.inputs[0]), b.weight(n.inputs[1], lambda w: w.T, ".T"))
    if len(n.inputs) == 3:
        y = b.one("Add", y, b.value(n.inputs[2]))
    b.bind(n, y)


def _qlinear(b: _Builder, n) -> None:
    from llmc.compiler.ops import qlinear_inputs

    x, qweight, scales, zeros, _, bias = qlinear_inputs(list(n.inputs), n.attrs)
    k, out = n.attrs["in_features"], n.attrs["out_features"]
    if n.attrs["scheme"] == "int8":
        # Cast * scales, not DequantizeLinear: ORT's QDQ fusion would turn DequantizeLinear + MatMul into
        # an integer matmul over dynamically quantised activations, which the artifact does not do.
        w = b.one("Mul", b.one("Cast", b.weight(qweight, lambda q: q.T, ".T"), to=1),
                  b.weight(scales, lambda s: s.reshape(1, -1).astype(np.float32), ".row"))
        y = b.one("MatMul", b.value(x), w)
    else:
        y = _matmul_nbits(b, b.value(x), qweight, scales, zeros, k, out, n.attrs["group_size"])
    if bias is not None:
        y = b.one("Add", y, b.value(bias))
    b.bind(n, y)


def _matmul_nbits(b: _Builder, x: str, qweight: str, scales: str, zeros: str, k: int, n: int, block: int) -> str:
    """com.microsoft MatMulNBits: llmc's packing (uint8 [N, K/2], low nibble = even k) is ORT's B
    [N, K/block, block/2]; scales [N * K/block]; integer zero points packed two a byte like the codes."""
    b.uses_ms = True
    blocks = k // block
    qb = b.weight(qweight, lambda q: q.reshape(n, blocks, block // 2), ".nbits")
    sc = b.weight(scales, lambda s: s.astype(np.float32).reshape(-1), ".nbits")
    z = b.weights[zeros].detach().cpu().float().numpy()
    if np.array_equal(z, np.round(z)) and z.min() >= 0 and z.max() <= 15:
        def pack(zs):
            codes = np.round(zs).astype(np.uint8)
            if blocks % 2:
                codes = np.concatenate([codes, np.zeros((n, 1), np.uint8)], axis=1)
            return (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1)
        zp = b.weight(zeros, pack, ".nbits")
    else:
        zp = b.weight(zeros, lambda zs: zs.astype(np.float32).reshape(-1), ".nbits")
    return b.add("MatMulNBits", [x, qb, sc, zp], domain="com.microsoft", K=k, N=n, bits=4, block_size=block)[0]


def _elementwise(op: str):
    def build(b: _Builder, n) -> None:
        b.bind(n, b.one(op, *(b.value(i) for i in n.inputs)))
    return build


def _silu(b: _Builder, x: str) -> str:
    return b.one("Mul", x, b.one("Sigmoid", x))


def _swiglu(b: _Builder, n) -> None:
    if len(n.inputs) == 2:
        gate, up = (b.value(i) for i in n.inputs)
    else:
        half = n.outputs[0].type.shape[-1]
        gate, up = b.add("Split", [b.value(n.inputs[0]), b.ints(half, half)], [b.fresh("gate"), b.fresh("up")],
                         axis=-1)
    b.bind(n, b.one("Mul", _silu(b, gate), up))


def _split(b: _Builder, n) -> None:
    sizes = n.attrs["sizes"]
    b.bind(n, *b.add("Split", [b.value(n.inputs[0]), b.ints(*sizes)], [b.fresh("split") for _ in sizes], axis=-1))


def _select_rows(b: _Builder, n) -> None:
    b.bind(n, b.value(n.inputs[0]))  # the export returns the logits of every token


def _cos_sin(b: _Builder, positions: str, inv_freq: str, scaling: float) -> tuple[str, str]:
    """cos/sin [tokens, 1, head_dim] as rope_cos_sin makes them (rotate-half tables)."""
    def make():
        freqs = b.one("Mul", b.one("Unsqueeze", b.one("Cast", b.value(positions), to=1), b.ints(1)),
                      b.value(inv_freq))
        emb = b.one("Concat", freqs, freqs, axis=-1)
        cos, sin = (b.one("Unsqueeze", b.one("Mul", b.one(f, emb), b.scalar(scaling)), b.ints(1))
                    for f in ("Cos", "Sin"))
        return cos, sin
    return b.cached(("rope", positions, inv_freq, scaling), make)


def _apply_rope(b: _Builder, x: str, cos: str, sin: str, head_dim: int) -> str:
    """x [tokens, heads * head_dim] -> x * cos + rotate_half(x) * sin, as [tokens, heads, head_dim]."""
    h = b.one("Reshape", x, b.ints(0, -1, head_dim))
    half = head_dim // 2
    x1, x2 = b.add("Split", [h, b.ints(half, half)], [b.fresh("x1"), b.fresh("x2")], axis=-1)
    rotated = b.one("Concat", b.one("Neg", x2), x1, axis=-1)
    return b.one("Add", b.one("Mul", h, cos), b.one("Mul", rotated, sin))


def _rope(b: _Builder, n) -> None:
    cos, sin = _cos_sin(b, n.inputs[1], n.inputs[2], n.attrs.get("scaling", 1.0))
    out = _apply_rope(b, b.value(n.inputs[0]), cos, sin, n.attrs["head_dim"])
    b.bind(n, b.one("Reshape", out, b.ints(0, -1)))


def _mask(b: _Builder, past: str, q: str, window) -> str:
    """Additive mask [tokens, past_len + tokens]: query i (position past_len + i) sees keys
    0..past_len + i, and with a window only the last `window` of them."""
    def make():
        zero, one = b.const("const/i64s/0", np.array(0, np.int64)), b.const("const/i64s/1", np.array(1, np.int64))
        past_len = b.one("Gather", b.one("Shape", past), zero, axis=0)
        tokens = b.one("Gather", b.one("Shape", q), zero, axis=0)
        qpos = b.one("Unsqueeze", b.one("Add", b.one("Range", zero, tokens, one), past_len), b.ints(1))
        kpos = b.one("Unsqueeze", b.one("Range", zero, b.one("Add", past_len, tokens), one), b.ints(0))
        diff = b.one("Sub", qpos, kpos)
        allowed = b.one("GreaterOrEqual", diff, zero)
        if window is not None:
            allowed = b.one("And", allowed, b.one("Less", diff, b.const(f"const/i64s/{window}",
                                                                       np.array(window, np.int64))))
        return b.one("Where", allowed, b.scalar(0.0), b.scalar(float("-inf")))
    return b.cached(("mask", window), make)


def _attention(b: _Builder, n) -> None:
    a = n.attrs
    heads, kv, hd, layer = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["layer"]
    q, k, v = (b.value(i) for i in n.inputs[:3])
    q3 = b.one("Reshape", q, b.ints(0, heads, hd))
    k3 = b.one("Reshape", k, b.ints(0, kv, hd))
    if n.op == "flash_attention" and a.get("rope") is not None:
        cos, sin = _cos_sin(b, n.inputs[3], n.inputs[4], a["rope"]["scaling"])
        q3, k3 = _apply_rope(b, q3, cos, sin, hd), _apply_rope(b, k3, cos, sin, hd)
    v3 = b.one("Reshape", v, b.ints(0, kv, hd))
    past_k, past_v = f"past_key.{layer}", f"past_value.{layer}"
    keys = b.add("Concat", [past_k, k3], [f"present_key.{layer}"], axis=0)[0]
    values = b.add("Concat", [past_v, v3], [f"present_value.{layer}"], axis=0)[0]
    group = heads // kv
    # GQA without repeating K/V: q as [kv, group, tokens, hd] against k as [kv, 1, hd, ctx]
    qg = b.one("Transpose", b.one("Reshape", q3, b.ints(0, kv, group, hd)), perm=[1, 2, 0, 3])
    kt = b.one("Unsqueeze", b.one("Transpose", keys, perm=[1, 2, 0]), b.ints(1))
    vt = b.one("Unsqueeze", b.one("Transpose", values, perm=[1, 0, 2]), b.ints(1))
    scores = b.one("Mul", b.one("MatMul", qg, kt), b.scalar(float(a["scale"])))
    if a.get("causal", True):
        scores = b.one("Add", scores, _mask(b, past_k, q, a.get("window")))
    out = b.one("MatMul", b.one("Softmax", scores, axis=-1), vt)
    out = b.one("Transpose", out, perm=[2, 0, 1, 3])
    b.bind(n, b.one("Reshape", out, b.ints(0, heads * hd)))


BUILDERS = {
    "embedding": _embedding, "qembedding": _qembedding, "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm,
    "linear": _linear,
    "qlinear": _qlinear, "split": _split, "swiglu": _swiglu, "select_rows": _select_rows, "rope": _rope,
    "attention": _attention, "flash_attention": _attention,
    "silu": lambda b, n: b.bind(n, _silu(b, b.value(n.inputs[0]))),
    "mul": _elementwise("Mul"), "add": _elementwise("Add"),
}

__all__ = ["export_onnx", "build_model", "ExportError", "BUILDERS"]
