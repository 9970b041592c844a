"""Hidden-state matching for `llmc distill --hidden-weight W`: besides the KL on the logits, each
student layer's output (the residual stream it hands on) is pulled towards a mapped teacher layer's,
as DistilBERT (Sanh et al. 2019: cosine of the hidden states) and TinyBERT (Jiao et al. 2020: MSE of
them) do. The streams are found in each artifact's own graph (the value the norm before each
attention, and the final norm, reads), so the mapping holds for fused and pruned graphs alike.

Which teacher layer: a student that layer pruning or `--draft-of` cut from the teacher's model keeps
teacher layers `kept`; its stream after j layers is what teacher layer kept[j] reads in the teacher
(where a draft's next layer expects its input), the last one the teacher's final stream. Any other
student maps evenly: j -> j * L_teacher // L_student (TinyBERT's uniform map)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from llmc.compiler.artifact import Artifact
from llmc.compiler.driver.distill_options import DistillError
from llmc.compiler.driver.distill_student import StudentGraph, run_graph
from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import ATTENTION_OPS

NORM_OPS = ("rms_norm", "add_rms_norm", "layer_norm")
EPS = 1e-6


def layer_streams(graph: Graph, where: str) -> list[str]:
    """The values holding the residual stream after 0, 1, ..., L layers: what each layer's
    attention norm reads, then what the final norm reads."""
    producers = graph.producers()
    attentions = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    norms = [norm_above(producers, n.inputs, where, f"layer {n.attrs.get('layer', i)}'s attention")
             for i, n in enumerate(attentions)]
    norms.append(norm_above(producers, graph.outputs[:1], where, "the LM head"))
    return [n.outputs[1].name if n.op == "add_rms_norm" else n.inputs[0] for n in norms]


def norm_above(producers: dict[str, Node], values: list[str], where: str, what: str) -> Node:
    """The one norm node every path up from `values` meets first."""
    found, seen, todo = {}, set(), list(values)
    while todo:
        node = producers.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op in NORM_OPS:
            found[node.name] = node
        else:
            todo += node.inputs
    if len(found) != 1:
        raise DistillError(f"{where}: {what} reads {len(found)} norms ({', '.join(sorted(found)) or 'none'}), not "
                           f"one, so its hidden state cannot be told apart; distil without --hidden-weight")
    return next(iter(found.values()))


def kept_layers(manifest: dict, teacher_layers: int) -> list[int] | None:
    """The teacher layers a layer-pruned student (a --draft-of draft, --prune layers:N) kept, from
    its pipeline's record; None where it was not cut from a model of the teacher's depth."""
    for stage in manifest.get("pipeline") or []:
        details = stage.get("details") or {}
        if "removed_layers" in details and details.get("layers_before") == teacher_layers:
            removed = set(details["removed_layers"])
            return [layer for layer in range(teacher_layers) if layer not in removed]
    return None


def layer_map(manifest: dict, student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student stream, teacher stream) pairs, by layers applied, for every student layer's output."""
    kept = kept_layers(manifest, teacher_layers)
    if kept is not None and len(kept) == student_layers:
        return [(j, kept[j] if j < student_layers else teacher_layers) for j in range(1, student_layers + 1)]
    return [(j, j * teacher_layers // student_layers) for j in range(1, student_layers + 1)]


def hidden_loss(ours: list[torch.Tensor], theirs: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Mean over the mapped layers of the distance between the student's and the teacher's hidden
    states [t, hidden]: 1 - cosine, or the MSE of the RMS-normalised states (2 - 2 cosine where both
    norms are exact)."""
    losses = []
    for s, t in zip(ours, theirs):
        if kind == "cosine":
            losses.append((1 - F.cosine_similarity(s, t, dim=-1, eps=EPS)).mean())
        else:
            losses.append(F.mse_loss(rms_normalised(s), rms_normalised(t)))
    return torch.stack(losses).mean()


def rms_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


@dataclasses.dataclass
class HiddenMatch:
    """What matching hidden states needs: the mapped streams of both graphs, and the teacher's graph
    (run by reference semantics, no gradients, for its streams and logits in one pass)."""
    pairs: list[tuple[int, int]]
    student_values: tuple[str, ...]
    teacher_values: tuple[str, ...]
    teacher_graph: Graph
    teacher_weights: dict
    kind: str
    weight: float

    def teacher(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            return run_graph(self.teacher_graph, self.teacher_weights.__getitem__, ids, self.teacher_values)

    def loss(self, ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> torch.Tensor:
        return hidden_loss(ours, theirs, self.kind)

    def held_out(self, student: StudentGraph, windows: list[torch.Tensor]) -> float:
        """Mean hidden-state loss over held-out windows, the student's masters as they are now."""
        with torch.no_grad():
            return sum(self.loss(student.forward(ids, self.student_values)[1], self.teacher(ids)[1]).item()
                       for ids in windows) / len(windows)

    def record(self) -> dict:
        return {"loss": self.kind, "weight": self.weight, "layer_map": [list(p) for p in self.pairs]}


def hidden_match(student: Artifact, graph: StudentGraph, teacher: Artifact, kind: str, weight: float) -> HiddenMatch:
    """The student's and teacher's mapped streams, checked to be of one width."""
    ours = layer_streams(graph.graph, f"student '{student.path}'")
    teacher_graph = Graph.from_json(teacher.graph_json)
    theirs = layer_streams(teacher_graph, f"teacher '{teacher.path}'")
    pairs = layer_map(student.manifest, len(ours) - 1, len(theirs) - 1)
    widths = (stream_width(graph.graph, ours[-1]), stream_width(teacher_graph, theirs[-1]))
    if widths[0] != widths[1]:
        raise DistillError(f"student '{student.path}' has hidden states of {widths[0]} and teacher '{teacher.path}' "
                           f"of {widths[1]}; hidden-state matching needs one width: distil without --hidden-weight")
    return HiddenMatch(pairs, tuple(ours[j] for j, _ in pairs), tuple(theirs[k] for _, k in pairs), teacher_graph,
                       teacher.weights, kind, weight)


def stream_width(graph: Graph, value: str):
    types = {v.name: v.type for v in graph.inputs} | {v.name: v.type for n in graph.nodes for v in n.outputs}
    return types[value].shape[-1]


__all__ = ["HiddenMatch", "hidden_match", "hidden_loss", "layer_streams", "layer_map"]
