"""Runs a static plan on CPU kernels: a walk over precomputed launches, with activations
held in the memory plan's slots and dropped as soon as their value dies."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from llmc.codegen.cpu_kernels import RopeCache, resolve_kernel
from llmc.codegen.plan import Plan
from llmc.compiler.ops import TORCH_DTYPES
from llmc.errors import ArtifactError, RuntimeLlmcError
from llmc.runtime.attention import AttentionBackend, NoCacheAttention


class Launch(NamedTuple):
    fn: Any
    args: list[int]         # register indices of the inputs
    outs: list[int]         # register indices the outputs go to
    attrs: dict[str, Any]
    context: tuple[str, ...]
    frees: list[int]        # registers whose value dies at this step


class PlanExecutor:
    """Registers are params, then graph inputs, then one per memory-plan slot."""

    def __init__(self, plan: Plan, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu"):
        self.plan = plan
        self.device = torch.device(device)
        missing = [p for p in plan.params if p not in weights]
        if missing:
            raise ArtifactError(f"plan for {plan.target} reads weights that were not given: "
                                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; load the "
                                f"artifact's weights file in full")
        self._registers = {p: i for i, p in enumerate(plan.params)}
        # safetensors hands out tensors at arbitrary byte offsets; copy into fresh (aligned) memory
        self._params = [torch.empty_like(weights[p], device=self.device).copy_(weights[p]) for p in plan.params]
        base = len(self._registers)
        self._registers.update({name: base + i for i, name in enumerate(plan.inputs)})
        base += len(plan.inputs)
        self._registers.update({v: base + s for v, s in plan.memory.slot_of.items()})
        self._num_registers = base + len(plan.memory.slot_bytes)
        self._program = [self._launch(i, step) for i, step in enumerate(plan.steps)]
        self._outputs = [self._register(o, "graph output") for o in plan.outputs]

    def weight(self, name: str) -> torch.Tensor:
        """The plan parameter `name` as the executor holds it (on its device)."""
        if name not in self.plan.params:
            raise RuntimeLlmcError(f"the plan has no parameter {name!r}; its parameters are "
                                   f"{self.plan.params[:5]}{' ...' if len(self.plan.params) > 5 else ''}")
        return self._params[self._registers[name]]

    def _register(self, name: str, where: str) -> int:
        try:
            return self._registers[name]
        except KeyError:
            raise ArtifactError(f"plan {where} reads {name!r}, which is no param, input or "
                                f"planned value; the plan is corrupt, recompile it") from None

    def _launch(self, index: int, step) -> Launch:
        where = f"step {index} ({step.node}, {step.kernel})"
        fn = resolve_kernel(step.kernel)
        outputs = set(self.plan.outputs)
        dying = [v for v in step.outputs + step.inputs
                 if v in self.plan.memory.lifetimes and self.plan.memory.lifetimes[v][1] == index
                 and v not in outputs]
        args = [self._register(i, where) for i in step.inputs]
        return Launch(fn, args, [self._register(o, where) for o in step.outputs],
                      self._prepared_attrs(fn, args, step.attrs),
                      getattr(fn, "context", ()), sorted({self._registers[v] for v in dying}))

    @torch.inference_mode()
    def _prepared_attrs(self, fn, args: list[int], attrs: dict) -> dict:
        """A kernel's `prepare` sees its param inputs once, here (packing quantised weights);
        what it returns is passed on every launch alongside the step's attrs."""
        prepare = getattr(fn, "prepare", None)
        if prepare is None:
            return attrs
        params = [self._params[r] if r < len(self._params) else None for r in args]
        return {**attrs, **prepare(params, attrs)}

    @torch.inference_mode()
    def run_values(self, inputs: dict[str, torch.Tensor],
                   backend: AttentionBackend | None = None) -> dict[str, torch.Tensor]:
        """Run the plan on its graph inputs; returns every plan output by name."""
        regs: list[Any] = self._params + [None] * (self._num_registers - len(self._params))
        for name in self.plan.inputs:
            regs[self._registers[name]] = self._check_input(name, inputs)
        context = {"backend": backend or NoCacheAttention(), "rope_cache": RopeCache()}
        for fn, args, outs, attrs, ctx, frees in self._program:
            if ctx:
                results = fn(*[regs[i] for i in args], **attrs, **{c: context[c] for c in ctx})
            else:
                results = fn(*[regs[i] for i in args], **attrs)
            for i, t in zip(outs, results):
                regs[i] = t
            for i in frees:
                regs[i] = None
        return {name: regs[i] for name, i in zip(self.plan.outputs, self._outputs)}

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            backend: AttentionBackend | None = None) -> torch.Tensor:
        """logits [tokens, vocab] for one batch of tokens."""
        values = self.run_values({"input_ids": input_ids, "positions": positions}, backend)
        return values["logits"] if "logits" in values else values[self.plan.outputs[0]]

    def _check_input(self, name: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if name not in inputs:
            raise RuntimeLlmcError(f"plan input {name!r} was not given; the plan takes {self.plan.inputs}")
        t = inputs[name]
        want = self.plan.type_of(name) if name in self.plan.types else None
        if want is None:
            return t.to(self.device)
        if t.dim() != want.rank or t.dtype != TORCH_DTYPES.get(want.dtype, t.dtype):
            raise RuntimeLlmcError(f"plan input {name!r}: expected {want}, got {t.dtype} "
                                   f"{list(t.shape)}")
        for dim, size in zip(want.shape, t.shape):
            # every symbolic dim counts tokens or a subset of them (see plan_memory)
            if isinstance(dim, str) and size > self.plan.max_tokens:
                raise RuntimeLlmcError(f"plan input {name!r} has {size} along {dim!r}, over the "
                                       f"{self.plan.max_tokens} batched tokens the plan was built "
                                       f"for; split the batch or recompile with a larger max_tokens")
        return t.to(self.device)


__all__ = ["PlanExecutor", "Launch"]
