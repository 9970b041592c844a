"""Export an artifact's IR as a standalone ONNX decoder: input ids, positions and every layer's past
keys/values in; logits for every token and the present keys/values out, so plain onnxruntime runs
it without llmc. onnx is imported inside the functions (the runtime imports codegen modules)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llmc.codegen.ort.onnx_ops import MS_DOMAIN, OPSET, TRANSLATIONS, OnnxBuilder, apply_rope, cos_sin
from llmc.compiler.artifact import OutputKind, read_artifact, staged_output
from llmc.compiler.ir import Graph
from llmc.compiler.progress import Stages, echo_stderr
from llmc.compiler.schemes import schemes_where
from llmc.errors import LlmcError

MARKER = "llmc_onnx.json"           # what a previous export holds; --force replaces only such a directory
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with headroom
QLINEAR_SCHEMES = schemes_where(exports=True)   # affine: a GGUF's own blocks, kept


class ExportError(LlmcError):
    """The artifact holds something this exporter does not translate, or the output is taken."""


def export_onnx(artifact_path, output, force: bool = False, quiet: bool = True) -> Path:
    """Write DIR/model.onnx, DIR/tokenizer/ and DIR/llmc_onnx.json for the artifact at `artifact_path`,
    via a staging sibling renamed into place (nothing is left behind on failure); unless `quiet`, a
    line on stderr for each stage that runs longer than a moment (compiler/progress.py)."""
    import onnx  # onnx: only a running export (test_exporter_module_does_not_import_onnx)

    with Stages(echo_stderr, quiet) as stages:
        stages.start(f"reading {artifact_path}")
        artifact = read_artifact(artifact_path)
        refuse_target(artifact.manifest["target"], artifact_path)
        graph = Graph.from_json(artifact.graph_json)
        with staged_output(Path(output), force, EXPORT) as staging:
            stages.start(f"building the ONNX graph of {len(graph.nodes)} nodes")
            model, config = build_model(graph, artifact.weights)
            large = not _fits_protobuf(model)
            stages.start("writing model.onnx" + (" (weights in model.onnx.data)" if large else ""))
            onnx.save_model(model, str(staging / "model.onnx"), save_as_external_data=large,
                            all_tensors_to_one_file=True, location="model.onnx.data")
            stages.start("checking model.onnx with onnx.checker")
            onnx.checker.check_model(str(staging / "model.onnx"), full_check=True)
            shutil.copytree(artifact.tokenizer_dir, staging / "tokenizer")
            (staging / MARKER).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return Path(output)


def refuse_target(target: dict, path) -> None:
    """The export writes a float32 graph: an artifact compiled for bf16 activations (the GPU targets,
    cpu-bf16) holds casts and bf16 weights it has no float32 form of."""
    activations = target.get("activation_dtype")
    if activations != "fp32":
        raise ExportError(f"artifact '{path}' was compiled for target {target.get('name')!r}, whose activations are "
                          f"{activations}; ONNX export takes float32 activations: compile the model for --target "
                          f"cpu and export that artifact")


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
    from onnx import TensorProto, helper  # onnx: only a running export (test_exporter_module_does_not_import_onnx)

    _refuse_unsupported(graph)
    meta = graph.meta
    b = OnnxBuilder(graph, weights)
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
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if b.uses_ms else [])
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
            why = (f"quantisation scheme {n.attrs['scheme']} does not export (int8, int4 and a GGUF's kept "
                   f"formats do); export an fp32, int8, int4 or GGUF-kept artifact")
        elif any(v.type.dtype not in ("float32", "int64", "int32") for v in n.outputs):
            why = "only float32 activations export; compile for --target cpu without cast passes (cast_bf16)"
        elif n.op in ("attention", "flash_attention") and any(
                len(graph.type_of(i).shape) != 2 for i in n.inputs[:3]):
            why = "attention inputs with leading batch dims do not export"
        if why:
            raise ExportError(f"node {n.name} ({n.op}): {why}")


def _mask(b: OnnxBuilder, past: str, q: str, window) -> str:
    """Additive mask [tokens, past_len + tokens]: query i (position past_len + i) sees keys
    0..past_len + i, and with a window only the last `window` of them."""
    def make():
        zero, one = b.i64(0), b.i64(1)
        past_len = b.one("Gather", b.one("Shape", past), zero, axis=0)
        tokens = b.one("Gather", b.one("Shape", q), zero, axis=0)
        qpos = b.one("Unsqueeze", b.one("Add", b.one("Range", zero, tokens, one), past_len), b.ints(1))
        kpos = b.one("Unsqueeze", b.one("Range", zero, b.one("Add", past_len, tokens), one), b.ints(0))
        diff = b.one("Sub", qpos, kpos)
        allowed = b.one("GreaterOrEqual", diff, zero)
        if window is not None:
            allowed = b.one("And", allowed, b.one("Less", diff, b.i64(window)))
        return b.one("Where", allowed, b.scalar(0.0), b.scalar(float("-inf")))
    return b.cached(("mask", window), make)


def _attention(b: OnnxBuilder, n) -> None:
    a = n.attrs
    heads, kv, hd, layer = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["layer"]
    q, k, v = (b.value(i) for i in n.inputs[:3])
    q3 = b.one("Reshape", q, b.ints(0, heads, hd))
    k3 = b.one("Reshape", k, b.ints(0, kv, hd))
    if n.op == "flash_attention" and a.get("rope") is not None:
        cos, sin = cos_sin(b, n.inputs[3], n.inputs[4], a["rope"]["scaling"])
        q3, k3 = apply_rope(b, q3, cos, sin, hd), apply_rope(b, k3, cos, sin, hd)
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


BUILDERS = {**TRANSLATIONS, "attention": _attention, "flash_attention": _attention}

__all__ = ["export_onnx", "build_model", "ExportError", "BUILDERS"]
