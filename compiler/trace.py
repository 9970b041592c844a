"""Tracing: torch.export of a causal LM's forward (no KV cache, a dynamic token dim)
into an aten graph, then a one-to-one translation of that graph into the llmc IR."""

from __future__ import annotations

import contextlib
import operator

import sympy
import torch
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind

from llmc.compiler.frontends.config_check import attention_windows
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.lower_moe import moe_blocks_as_ops
from llmc.compiler.ops import DTYPE_NAMES
from llmc.errors import IRError

TOKENS = "tokens"
ATTENTION_WINDOWS = "attention_windows"  # graph meta: each layer's sliding window per the model config


class TokenMajorLM(torch.nn.Module):
    """Wraps an HF causal LM as `(input_ids[T], positions[T]) -> logits[T, vocab]`:
    one sequence, explicit positions (the runtime supplies them), no KV cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.logits[0]


def export_lm(model: torch.nn.Module, max_tokens: int = 4096, example_tokens: int = 8) -> ExportedProgram:
    """Export without decompositions so SDPA stays whole for the attention matcher."""
    wrapper = TokenMajorLM(model).eval()
    tokens = Dim(TOKENS, min=2, max=max_tokens)
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", 2)
    ids = torch.randint(0, vocab, (example_tokens,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(example_tokens)
    with torch.no_grad(), no_stack_traces(), moe_blocks_as_ops(model):
        ep = torch.export.export(wrapper, (ids, pos), dynamic_shapes=({0: tokens}, {0: tokens}), strict=False)
    if config is not None:  # lowering checks the traced masks against the config's windows
        ep.graph_module.meta[ATTENTION_WINDOWS] = attention_windows(config)
    return ep


@contextlib.contextmanager
def no_stack_traces():
    """torch.fx stops recording each node's Python stack trace, which the IR never reads: formatting
    ~2k of them is a sixth of an export's time."""
    config = torch.fx.config
    was = getattr(config, "do_not_emit_stack_traces", None)
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        if was is None:
            del config.do_not_emit_stack_traces
        else:
            config.do_not_emit_stack_traces = was


_PY_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
                 operator.floordiv: "floordiv", operator.neg: "neg"}


class _Translator:
    """Turns each FX node into one IR node: aten ops become `aten` fallback nodes whose
    args are JSON, with {"$in": k} standing for the node's k-th input value."""

    def __init__(self, ep: ExportedProgram):
        self.ep = ep
        self.g = Graph("model")
        self.values: dict[str, object] = {}   # fx node name -> IR value name(s)
        self.symbols: dict[sympy.Symbol, str] = {}

    def run(self) -> Graph:
        if ATTENTION_WINDOWS in self.ep.graph_module.meta:
            self.g.meta[ATTENTION_WINDOWS] = self.ep.graph_module.meta[ATTENTION_WINDOWS]
        self._placeholders()
        for node in self.ep.graph.nodes:
            if node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                outs = node.args[0]
                self.g.outputs = [self.values[o.name] for o in outs]
        return self.g

    def _placeholders(self):
        sig = self.ep.graph_signature
        state = dict(self.ep.state_dict) | dict(self.ep.constants)
        user = iter(["input_ids", "positions"])
        for spec, node in zip(sig.input_specs, [n for n in self.ep.graph.nodes if n.op == "placeholder"]):
            val = node.meta["val"]
            if spec.kind == InputKind.USER_INPUT:
                name = next(user)
                sym = val.shape[0].node.expr if isinstance(val.shape[0], torch.SymInt) else None
                if sym is not None:
                    self.symbols[sym] = TOKENS
                self.g.add_input(name, self._type(val))
            else:
                name = spec.target.removeprefix("model.")
                tensor = state[spec.target].detach()
                self.g.add_param(name, self._type(val), tensor)
            self.values[node.name] = name

    def _dim(self, d) -> int | str:
        if isinstance(d, int):
            return d
        expr = d.node.expr
        if expr.is_Integer:
            return int(expr)
        return str(expr.subs({s: sympy.Symbol(n) for s, n in self.symbols.items()}))

    def _type(self, val) -> TensorType:
        if isinstance(val, torch.Tensor):
            return TensorType(tuple(self._dim(d) for d in val.shape), DTYPE_NAMES[val.dtype])
        if isinstance(val, (torch.SymInt, int)):
            return TensorType((), "symint")
        raise IRError(f"cannot type value {val!r}")

    def _call(self, node):
        if node.target is operator.getitem:
            self.values[node.name] = self.values[node.args[0].name][node.args[1]]
            return
        inputs: list[str] = []
        args = self._encode(node.args, inputs)
        kwargs = {k: self._encode(v, inputs) for k, v in node.kwargs.items()}
        target = _target_name(node.target)
        val = node.meta.get("val")
        vals = [] if val is None else list(val) if isinstance(val, (tuple, list)) else [val]
        types = [self._type(v) for v in vals if v is not None]
        ir_node = self.g.make_node("aten", inputs, types, {"target": target, "args": args, "kwargs": kwargs},
                                   name=node.name)
        self.g.nodes.append(ir_node)
        outs = [v.name for v in ir_node.outputs]
        self.values[node.name] = outs if isinstance(val, (tuple, list)) else (outs[0] if outs else None)

    def _encode(self, a, inputs: list[str]):
        if isinstance(a, torch.fx.Node):
            name = self.values[a.name]
            if name not in inputs:
                inputs.append(name)
            return {"$in": inputs.index(name)}
        if isinstance(a, (list, tuple)):
            return [self._encode(x, inputs) for x in a]
        if isinstance(a, torch.dtype):
            return {"$dtype": DTYPE_NAMES[a]}
        if isinstance(a, torch.device):
            return {"$device": a.type}
        if isinstance(a, torch.layout):
            return {"$layout": str(a).removeprefix("torch.")}
        if isinstance(a, torch.memory_format):
            return {"$memory_format": str(a).removeprefix("torch.")}
        if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
            return {"$float": str(a)}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise IRError(f"node {self.g.name}: cannot encode argument {a!r} of type {type(a).__name__}")


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name, overload = target.namespace, target._opname, target._overloadname
        return f"{ns}.{name}.{overload}"
    if target in _PY_OPERATORS:
        return f"operator.{_PY_OPERATORS[target]}"
    raise IRError(f"traced graph calls {target!r}, which llmc cannot represent; "
                  "export the model without custom ops")


def translate(ep: ExportedProgram) -> Graph:
    return _Translator(ep).run()
