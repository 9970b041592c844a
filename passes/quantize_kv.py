"""`quantize_kv_cache`: static per-layer, per-KV-head scales for an int8 or fp8 KV cache, from
the absmax of each attention's keys and values (after rope) on the calibration sequences. Each
attention node then reads its layer's scales (param `kv_scales.<layer>`, fp32 [2, kv_heads]:
keys, values) as its last input and carries the cache dtype in its `kv_cache` attr, so the IR
computes what the quantised cache gives back and no pass can drop the scales. An int4 cache scales
each token's groups of channels as it writes them (compiler/schemes.py), so its nodes get the attr
alone; the calibration text then only measures what it costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.interpreter import interpret_many
from llmc.compiler.ir import DTYPE_BYTES, Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS, attention_prologue
from llmc.compiler.schemes import KV_CACHE_FORMATS, kv_format
from llmc.errors import PassError
from llmc.passes.accuracy import check_budget, mean_kl, perplexity, significant, top1_agreement
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.options import PassOptions, option

# --kv-cache name -> (storage dtype, largest magnitude it holds)
KV_FORMATS = {f.name: (f.storage, f.qmax) for f in KV_CACHE_FORMATS.values()}
# --kv-cache names whose scales are calibrated (the others' are dynamic)
STATIC_KV_FORMATS = tuple(f.name for f in KV_CACHE_FORMATS.values() if f.static)
SCALE_PARAMS = "kv_scales.{layer}"
# A head that never left zero on calibration still needs a positive scale.
MIN_ABSMAX = 1e-6


def attention_layers(graph: Graph) -> dict[int, Node]:
    """Attention nodes (plain or fused) by their `layer` attr (the runtime's cache index)."""
    layers: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op not in ATTENTION_OPS:
            continue
        layer = node.attrs.get("layer")
        if layer is None or layer in layers:
            raise PassError(f"quantize_kv_cache: attention node {node.name} has layer={layer!r}, which is "
                            f"missing or shared; the KV cache needs one distinct layer index per attention")
        layers[layer] = node
    return layers


def calibration_of(ctx: PassContext) -> list[torch.Tensor]:
    if ctx.calibration is None or len(ctx.calibration) == 0:
        raise PassError("quantize_kv_cache needs calibration text to set its scales, and the pipeline "
                        "gave none; compile with `llmc compile --kv-cache int8|fp8|int4` (which supplies it "
                        "from --calib FILE or self-generated text)")
    return [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in ctx.calibration]


def run_logits(graph: Graph, seqs: list[torch.Tensor], hook) -> list[torch.Tensor]:
    """Logits [T, vocab] of every row of each calibration sequence (run node by node: each
    weight is read once for all of them)."""
    inputs = []
    for seq in seqs:
        positions = torch.arange(seq.numel())
        known = {"input_ids": seq, "positions": positions, "logits_indices": positions}
        inputs.append({v.name: known[v.name] for v in graph.inputs if v.name in known})
    return [out[graph.outputs[0]].float() for out in interpret_many(graph, inputs, hook=hook)]


def split_heads(x: torch.Tensor, node: Node) -> torch.Tensor:
    return x.reshape(-1, node.attrs["num_kv_heads"], node.attrs["head_dim"])


def observe_absmax(graph: Graph, seqs: list[torch.Tensor], layers: dict[int, Node]):
    """(absmax fp32 [2, kv_heads] per layer, reference logits per sequence)."""
    by_name = {n.name: layer for layer, n in layers.items()}
    absmax = {layer: torch.zeros(2, n.attrs["num_kv_heads"]) for layer, n in layers.items()}

    def hook(node, args, outs):
        if node.name in by_name:
            # what the cache holds: keys after rope, also where a fused op rotates them itself
            for row, x in enumerate(attention_prologue(args, node.attrs)[1:3]):
                amax = split_heads(x, node).abs().amax(dim=(0, 2)).float()
                torch.maximum(absmax[by_name[node.name]][row], amax, out=absmax[by_name[node.name]][row])
    return absmax, run_logits(graph, seqs, hook)


def accuracy_of(seqs, ref_logits, logits) -> dict:
    """The accuracy figures lossy passes report, against the graph as this pass found it."""
    ref, ours = [lg[:-1] for lg in ref_logits], [lg[:-1] for lg in logits]
    return {"ppl_before": significant(perplexity(ref, seqs)), "ppl_after": significant(perplexity(ours, seqs)),
            "kl": significant(mean_kl(ref, ours)), "top1_agreement": significant(top1_agreement(ref, ours)),
            "tokens": sum(len(s) - 1 for s in seqs)}


@register_pass
class QuantizeKVCache(Pass):
    name = "quantize_kv_cache"
    description = ("int8/fp8 KV cache with static per-layer, per-KV-head scales from calibration; int4 with "
                   "a dynamic scale per token, KV head and 32 channels")
    # Not metered by the PassManager (that would make every --kv-cache compile's reference the
    # graph before the first lossy pass); the pass measures its own cost against the graph it got.
    stage = Stage.KV_CACHE
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        dtype: str = option("int8", "dtype the KV cache stores", choices=tuple(KV_FORMATS))

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        storage, qmax = KV_FORMATS[self.options.dtype]
        layers = attention_layers(graph)
        if not layers:
            return PassResult(0, False, {"reason": "no attention op; the graph keeps no KV cache"})
        self._check_fresh(graph, layers)
        seqs = calibration_of(ctx)
        absmax, ref_logits = observe_absmax(graph, seqs, layers)
        for layer, node in sorted(layers.items()):
            node.attrs["kv_cache"] = storage
            if self.options.dtype not in STATIC_KV_FORMATS:
                continue
            scales = absmax[layer].clamp(min=MIN_ABSMAX) / qmax
            name = SCALE_PARAMS.format(layer=layer)
            graph.add_param(name, TensorType((2, scales.shape[1]), "float32"), scales.contiguous())
            node.inputs.append(name)
        accuracy = accuracy_of(seqs, ref_logits, run_logits(graph, seqs, None))
        check_budget(self.name, accuracy, ctx.options.get("max_ppl_increase"))
        return PassResult(len(layers), True, self._details(graph, layers, absmax, storage), accuracy=accuracy)

    @staticmethod
    def _check_fresh(graph: Graph, layers: dict[int, Node]) -> None:
        taken = [SCALE_PARAMS.format(layer=i) for i in layers if SCALE_PARAMS.format(layer=i) in graph.params]
        if taken or any(n.attrs.get("kv_cache") for n in layers.values()):
            raise PassError(f"quantize_kv_cache: the graph already has KV cache scales ({taken[:3]}); "
                            f"run the pass once per pipeline")

    @staticmethod
    def _details(graph: Graph, layers: dict[int, Node], absmax: dict, storage: str) -> dict:
        node = next(iter(layers.values()))
        heads = 2 * len(layers) * node.attrs["num_kv_heads"]
        head_dim = node.attrs["head_dim"]
        act = graph.type_of(node.inputs[1]).dtype
        return {"dtype": storage, "layers": len(layers),
                "kv_bytes_per_token_before": heads * head_dim * DTYPE_BYTES[act],
                "kv_bytes_per_token_after": heads * kv_format(storage).head_bytes(head_dim),
                "absmax_k_max": significant(max(float(a[0].max()) for a in absmax.values())),
                "absmax_v_max": significant(max(float(a[1].max()) for a in absmax.values()))}


__all__ = ["QuantizeKVCache", "KV_FORMATS", "STATIC_KV_FORMATS", "SCALE_PARAMS"]
