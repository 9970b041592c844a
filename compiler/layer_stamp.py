"""Tracing a deep decoder in the time of three layers. torch.export spends about the same time on
every decoder layer (a third of a second each on a laptop-class CPU), while the layers of most
models compute the same thing on their own weights. So when a model's layers 1 to N-1 are one
class with the same settings and its config gives every layer the same attention, the model is
exported with layers 0, 1 and N-1 alone, and layer 1's nodes are copied for layers 2..N-2, each
copy reading its own layer's params. The copies are made only when the trace itself shows layer 1
and layer N-1 as the same nodes over the same inputs (so a layer that knows it is the last, or an
alternating pattern, is caught); otherwise the whole model is exported. Nodes, params and their
order come out as a whole-model export gives them."""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass

import torch

from llmc.compiler.frontends.config_check import attention_windows
from llmc.compiler.ir import Graph, Node, Value
from llmc.compiler.trace import export_lm, translate

TRACED = 3  # layers 0, 1 and the last are exported; layer 1 is the copies' template
INDEX_SETTINGS = ("layer_idx",)  # a layer's own index: differs by design, read only by KV caches
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class LayerStack:
    """The model's ModuleList of decoder layers, found by its length (the config's layer count)."""
    path: str                      # its name in the model, e.g. "model.layers"
    layers: torch.nn.ModuleList

    def prefix(self, index: int) -> str:
        return f"{self.path}.{index}."

    @property
    def count(self) -> int:
        return len(self.layers)


def traced_graph(module: torch.nn.Module, max_tokens: int) -> tuple[Graph, int]:
    """The model as a graph of aten nodes, and how many of its layers were copied, not traced."""
    stack = repeated_layers(module)
    graph = stamped_trace(module, stack, max_tokens) if stack is not None else None
    if graph is not None:
        return graph, stack.count - TRACED
    return translate(export_lm(module, max_tokens)), 0


# -- which models: every layer past the first the same module with the same settings ------------
def repeated_layers(module: torch.nn.Module) -> LayerStack | None:
    config = getattr(module, "config", None)
    text = getattr(config, "text_config", config)
    count = getattr(text, "num_hidden_layers", None)
    if not isinstance(count, int) or count <= TRACED:
        return None
    stacks = [(name, m) for name, m in module.named_modules()
              if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if len(stacks) != 1 or not uniform_config(text, count):
        return None
    path, layers = stacks[0]
    if len({id(layer) for layer in layers}) != count or not same_layers(list(layers)[1:]):
        return None
    return LayerStack(path, layers)


def uniform_config(text, count: int) -> bool:
    """Every per-layer list of the config (layer_types, per-layer flags) and every layer's
    attention window holds one value for all layers."""
    lists = [v for v in text.to_dict().values() if isinstance(v, (list, tuple)) and len(v) == count]
    return all(len({setting_key(x) for x in v}) == 1 for v in [*lists, attention_windows(text)])


def same_layers(layers: list[torch.nn.Module]) -> bool:
    first = layer_signature(layers[0])
    return first is not None and all(layer_signature(layer) == first for layer in layers[1:])


def layer_signature(layer: torch.nn.Module) -> tuple | None:
    """What a layer computes besides its weights' values: its modules' classes and settings, its
    tensors' names, shapes and dtypes; None when hooks could change that."""
    modules = []
    for name, m in layer.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        settings = sorted((k, setting_key(v)) for k, v in vars(m).items()
                          if not k.startswith("_") and k not in INDEX_SETTINGS)
        modules.append((name, type(m), tuple(settings)))
    tensors = [(name, tuple(t.shape), t.dtype)
               for name, t in [*layer.named_parameters(), *layer.named_buffers()]]
    return tuple(modules), tuple(tensors)


def setting_key(value):
    """A value to compare settings by: plain data by value, anything else by identity (an
    object the layers share is the same; one each is a difference)."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(setting_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), setting_key(v)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        return "partial", setting_key(value.func), setting_key(value.args), setting_key(value.keywords)
    return "object", id(value)


# -- the three-layer export --------------------------------------------------------------------
def stamped_trace(module: torch.nn.Module, stack: LayerStack, max_tokens: int) -> Graph | None:
    with traced_layers(module, stack):
        try:
            ep = export_lm(module, max_tokens)
        except Exception:  # noqa: BLE001 - the model's code may need all its layers: export it whole
            return None
    path = re.compile(rf"model\.{re.escape(stack.path)}\.(\d+)")  # the wrapper calls the model `model`
    blocks = {n.name: block for n in ep.graph.nodes if (block := layer_block(n, path)) is not None}
    return stamp(translate(ep), blocks, stack, module)


@contextlib.contextmanager
def traced_layers(module: torch.nn.Module, stack: LayerStack):
    """The stack holds layers 0, 1 and N-1 alone (each keeps its own index) while the model is exported."""
    owner, _, attr = stack.path.rpartition(".")
    holder = module.get_submodule(owner)
    setattr(holder, attr, torch.nn.ModuleList([stack.layers[0], stack.layers[1], stack.layers[-1]]))
    try:
        yield
    finally:
        setattr(holder, attr, stack.layers)


def layer_block(node: torch.fx.Node, layer_path: re.Pattern) -> int | None:
    """Which traced layer (0, 1, 2) the export recorded `node` in; None outside the layers."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if (found := layer_path.fullmatch(path)) is not None:
            return int(found.group(1))
    return None


# -- copying layer 1 ----------------------------------------------------------------------------
@dataclass
class Traced:
    """The three-layer graph cut into its parts, in graph order."""
    prelude: list[Node]
    layers: list[list[Node]]       # traced layers 0, 1, 2 (the model's N-1)
    postlude: list[Node]
    carries: list[str]             # the one value each layer hands the next (or the postlude)


def stamp(graph: Graph, blocks: dict[str, int], stack: LayerStack, module: torch.nn.Module) -> Graph | None:
    """The whole model's graph from the three-layer one, or None when layer 1 and the last layer
    are not the same nodes over the same inputs, or a layer reads more of another than its output."""
    traced = split(graph, blocks)
    if traced is None or not same_layer(graph, traced, stack):
        return None
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    full = full_params(graph, stack, tensors)
    strides = name_strides(traced)
    if full is None or strides is None:
        return None
    return assemble(graph, traced, stack, full, strides)


def split(graph: Graph, blocks: dict[str, int]) -> Traced | None:
    """Prelude, layers 0..2 and postlude, each contiguous; layer 1, layer 2 and the postlude each
    read one value of the part before them and nothing of any other layer."""
    where, in_layers = [], False   # each node's part: 0 prelude, 1..3 layers 0..2, 4 postlude
    for n in graph.nodes:
        block = blocks.get(n.name)
        in_layers = in_layers or block is not None
        where.append(block + 1 if block is not None else TRACED + 1 if in_layers else 0)
    parts = [[n for n, w in zip(graph.nodes, where) if w == part] for part in range(TRACED + 2)]
    if where != sorted(where) or not all(parts[1:TRACED + 1]):
        return None
    region = {v.name: r for r, part in enumerate(parts) for n in part for v in n.outputs}
    carries = []
    for r in range(2, len(parts)):
        read = {i for n in parts[r] for i in n.inputs} | (set(graph.outputs) if r == len(parts) - 1 else set())
        from_layers = {i for i in read if region.get(i) in (1, 2, 3) and region[i] != r}
        if len(from_layers) != 1 or region[next(iter(from_layers))] != r - 1:
            return None
        carries.append(from_layers.pop())
    return Traced(parts[0], parts[1:1 + TRACED], parts[-1], carries)


def same_layer(graph: Graph, traced: Traced, stack: LayerStack) -> bool:
    """Layer 1 and layer 2 (the model's N-1): node for node the same op, attrs and types, over the
    same values, each reading its own layer's params and no other param."""
    one, last = traced.layers[1], traced.layers[2]
    if len(one) != len(last):
        return False
    local = {traced.carries[0]: traced.carries[1]}

    def counterpart(value: str) -> str | None:
        if value in local:
            return local[value]
        return own_param(value, stack, 1, 2) if value in graph.params else value

    for a, b in zip(one, last):
        if (a.op, a.attrs, [v.type for v in a.outputs]) != (b.op, b.attrs, [v.type for v in b.outputs]):
            return False
        if [counterpart(i) for i in a.inputs] != b.inputs:
            return False
        local.update((u.name, w.name) for u, w in zip(a.outputs, b.outputs))
    return True


def own_param(name: str, stack: LayerStack, index: int, to: int) -> str | None:
    """Param `name` of layer `index` under layer `to`'s name; None when it is not that layer's."""
    prefix = stack.prefix(index)
    return stack.prefix(to) + name.removeprefix(prefix) if name.startswith(prefix) else None


def layer_of(name: str, stack: LayerStack) -> int | None:
    found = re.match(rf"{re.escape(stack.path)}\.(\d+)\.", name)
    return None if found is None else int(found.group(1))


def full_params(graph: Graph, stack: LayerStack, tensors: dict[str, torch.Tensor]) -> Graph | None:
    """A graph holding the whole model's params in export order (each run of layer 1's repeated
    for layers 2..N-2 after it; layer 2's named N-1) with the model's tensors; None when one of
    those differs from its template in shape or dtype."""
    last = stack.count - 1
    order: list[tuple[str, str]] = []   # (name in the whole model, its template in the traced graph)
    run: list[str] = []
    for name in [*graph.params, None]:
        index = None if name is None else layer_of(name, stack)
        if index == 1:
            run.append(name)
            continue
        order += [(own_param(p, stack, 1, k), p) for k in range(1, last) for p in run]
        run = []
        if name is not None:
            order.append((own_param(name, stack, 2, last) if index == 2 else name, name))
    full = Graph(graph.name)
    for name, template in order:
        tensor = graph.weights[template] if name == template else tensors.get(name)
        if tensor is None or (tensor.shape, tensor.dtype) != (graph.weights[template].shape,
                                                             graph.weights[template].dtype):
            return None
        full.add_param(name, graph.params[template].type, tensor.detach())
    return full


FX_NAME = re.compile(r"(.*)_(\d+)")


def fx_parts(name: str) -> tuple[str, int]:
    """torch.fx names nodes `<base>`, `<base>_1`, `<base>_2`, ... in the order it makes them."""
    found = FX_NAME.fullmatch(name)
    return (found.group(1), int(found.group(2))) if found else (name, 0)


def fx_name(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def name_strides(traced: Traced) -> dict[str, int] | None:
    """How far each node-name counter moves per layer (layer 1 against the next traced layer)."""
    strides: dict[str, int] = {}
    for a, b in zip(traced.layers[1], traced.layers[2]):
        (base, i), (other, j) = fx_parts(a.name), fx_parts(b.name)
        if base != other or strides.setdefault(base, j - i) != j - i:
            return None
    return strides


def assemble(graph: Graph, traced: Traced, stack: LayerStack, full: Graph, strides: dict[str, int]) -> Graph | None:
    """`full` given the nodes: layer 1's copied for layers 2..N-2 between it and the last layer,
    and what follows renumbered as a whole-model export numbers it; None on a name clash."""
    copies = stack.count - TRACED

    def shifted(node: Node, layers: int) -> str:
        base, number = fx_parts(node.name)
        return fx_name(base, number + layers * strides.get(base, 0))

    nodes = traced.prelude + traced.layers[0] + traced.layers[1]
    carry = traced.carries[1]   # what the last layer made reads: layer 1's output, then each copy's
    for k in range(2, stack.count - 1):
        values = {traced.carries[0]: carry}
        nodes += [relabel(n, shifted(n, k - 1), values, lambda i, k=k: own_param(i, stack, 1, k))
                  for n in traced.layers[1]]
        carry = values[traced.carries[1]]
    values = {traced.carries[1]: carry}
    nodes += [relabel(n, shifted(n, copies), values, lambda i: own_param(i, stack, 2, stack.count - 1))
              for n in traced.layers[2] + traced.postlude]
    if len({n.name for n in nodes}) != len(nodes):
        return None
    full.inputs, full.meta, full.nodes = graph.inputs, graph.meta, nodes
    full.outputs = [values.get(o, o) for o in graph.outputs]
    return full


def relabel(node: Node, name: str, values: dict[str, str], param) -> Node:
    """A copy of `node` named `name` reading values[i], or param(i), or i itself, for each input i;
    `values` learns the copy's outputs."""
    inputs = [values.get(i) or param(i) or i for i in node.inputs]
    outputs = [Value(name if k == 0 else f"{name}.{k}", v.type) for k, v in enumerate(node.outputs)]
    values.update((old.name, new.name) for old, new in zip(node.outputs, outputs))
    return Node(name, node.op, inputs, outputs, copy_attrs(node.attrs))


def copy_attrs(value):
    """A copy of an aten node's JSON-like attrs (passes edit attrs in place)."""
    if isinstance(value, dict):
        return {k: copy_attrs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_attrs(v) for v in value]
    return value
