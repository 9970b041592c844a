"""The student of a distillation as torch trains it: the artifact's own graph run node by node with
each op's reference semantics (compiler/ops.py, plain differentiable torch), its float weights as
fp32 leaf tensors that require grad. What is trained is exactly what the artifact serves (fused,
pruned, GQA-converted shapes that no Hugging Face module has), under the names its graph and plan
read, so the trained weights drop back into the same graph and plan."""

from __future__ import annotations

from typing import Callable

import torch

from llmc.compiler.artifact import Artifact
from llmc.compiler.driver.distill_options import DistillError
from llmc.compiler.ir import Graph
from llmc.compiler.ops import ATTENTION_OPS, run_reference

# The inputs of each op that are learned weights; everything else (rotary inv_freq, KV-cache
# scales) is a constant of the model and stays as stored.
TRAINED_INPUTS = {"embedding": (1,), "vocab_embedding": (1,), "linear": (1, 2), "rms_norm": (1,),
                  "add_rms_norm": (2,), "layer_norm": (1, 2), "qk_norm": (1,), "moe": (1, 2, 3)}
QUANTISED_OPS = ("qlinear", "qembedding", "qmoe")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRAPH_INPUTS = ("input_ids", "positions", "logits_indices")


class StudentGraph:
    """The student artifact's graph with trainable fp32 master weights. Tied weights (a weight
    alias, such as an LM head sharing the embedding) share one master."""

    def __init__(self, art: Artifact):
        self.path = art.path
        self.graph = Graph.from_json(art.graph_json)
        self.graph.verify()
        refuse_untrainable(self.graph, art.manifest, f"student '{art.path}'")
        self.stored = art.weights
        aliases = art.manifest.get("weight_aliases") or {}
        self.canonical = {name: aliases.get(name, name) for name in trained_names(self.graph)}
        self.masters = {c: self.stored[c].detach().float().clone().requires_grad_(True)
                        for c in sorted(set(self.canonical.values()))}
        self._dtype = {name: self.stored[name].dtype for name in self.canonical}

    def parameters(self) -> list[torch.Tensor]:
        return [self.masters[name] for name in sorted(self.masters)]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.masters.values())

    def weight(self, name: str) -> torch.Tensor:
        """What a node reads for `name`: its master (in the stored dtype), or the stored constant."""
        if name not in self.canonical:
            return self.stored[name]
        master = self.masters[self.canonical[name]]
        return master if self._dtype[name] == torch.float32 else master.to(self._dtype[name])

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [t] at positions 0..t-1 -> float32 logits [t, vocab] of every position, differentiable
        in the masters (run under torch.no_grad() to measure)."""
        return run_graph(self.graph, self.weight, ids)[0]

    def forward(self, ids: torch.Tensor, keep: tuple[str, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The logits and the values named in `keep` (hidden states), differentiable in the masters."""
        return run_graph(self.graph, self.weight, ids, keep)

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """Every weight of the graph as it is to be stored: masters cast back to the stored dtype
        (tied names get one tensor, which the writer stores once), constants as they were."""
        cast: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        out = {}
        for name in self.graph.params:
            if name not in self.canonical:
                out[name] = self.stored[name]
                continue
            key = (self.canonical[name], self._dtype[name])
            if key not in cast:
                cast[key] = self.masters[key[0]].detach().to(key[1]).contiguous()
            out[name] = cast[key]
        return out


def run_graph(graph: Graph, weight: Callable[[str], torch.Tensor], ids: torch.Tensor,
              keep: tuple[str, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run a whole model's graph on ids [t] at positions 0..t-1 through each op's reference semantics,
    reading each param through `weight`: float32 logits [t, vocab] of every position, and the values
    named in `keep` as float32 [t, hidden]."""
    rows = torch.arange(len(ids), dtype=torch.long)
    feeds = {"input_ids": ids, "positions": rows, "logits_indices": rows}
    env = {v.name: feeds[v.name] for v in graph.inputs}
    kept = {}
    last_use = {name: i for i, node in enumerate(graph.nodes) for name in node.inputs}
    for i, node in enumerate(graph.nodes):
        outs = run_reference(node, [env[x] if x in env else weight(x) for x in node.inputs])
        env.update({value.name: out for value, out in zip(node.outputs, outs)})
        kept.update({value.name: out for value, out in zip(node.outputs, outs) if value.name in keep})
        for name in node.inputs:   # autograd keeps what backward needs; the env need not
            if last_use[name] == i and name not in graph.outputs:
                env.pop(name, None)
    return env[graph.outputs[0]].float(), [kept[name].float() for name in keep]


def trained_names(graph: Graph) -> list[str]:
    """The params read as learned weights (TRAINED_INPUTS), in graph order."""
    names = {}
    for node in graph.nodes:
        for i in TRAINED_INPUTS.get(node.op, ()):
            if i < len(node.inputs) and node.inputs[i] in graph.params:
                names[node.inputs[i]] = True
    return list(names)


def refuse_untrainable(graph: Graph, manifest: dict, where: str) -> None:
    """Refuse, in one line saying what to compile instead, a student gradients cannot train as it is
    stored: quantised weights (integer codes), a quantised KV cache (its rounding passes no gradient
    to the keys and values), a sharded artifact (one rank holds part of each layer)."""
    if manifest.get("parallel"):
        raise DistillError(f"{where} is sharded across ranks (--tp/--pp); distil an unsharded student "
                           f"(compile it without --tp/--pp)")
    quantised = sorted({n.op for n in graph.nodes if n.op in QUANTISED_OPS}) or \
        [f"param {p.name}" for p in graph.params.values() if p.quant is not None][:1]
    if quantised:
        recipe = (manifest.get("weights") or {}).get("quant") or "quantised"
        raise DistillError(f"{where} stores {recipe} weights ({', '.join(quantised)}), which gradients cannot "
                           f"train; compile the student with --quant none (keeping its --prune, --kv-heads or "
                           f"--draft-of flags) and distil that")
    if any(n.attrs.get("kv_cache") for n in graph.nodes if n.op in ATTENTION_OPS):
        raise DistillError(f"{where} quantises its KV cache (--kv-cache), whose rounding passes no gradient; "
                           f"compile the student without --kv-cache and distil that")
    stray = sorted(v.name for v in graph.inputs if v.name not in GRAPH_INPUTS)
    if stray:
        raise DistillError(f"{where}: its graph takes input(s) {', '.join(stray)} besides {', '.join(GRAPH_INPUTS)}; "
                           f"only a whole model's graph can be distilled")
    odd = sorted({name for name in trained_names(graph) if graph.params[name].type.dtype not in
                  ("float32", "bfloat16", "float16")})
    if odd:
        raise DistillError(f"{where}: weight {odd[0]} is {graph.params[odd[0]].type.dtype}, not a float type "
                           f"gradients can train; compile the student with --quant none")


__all__ = ["StudentGraph", "run_graph", "trained_names", "refuse_untrainable", "TRAINED_INPUTS"]
