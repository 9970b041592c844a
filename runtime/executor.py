"""Runs a static plan: a walk over precomputed launches of its kernel families (codegen/family.py: torch
"cpu" kernels with ONNX Runtime segments, or "triton" kernels on a GPU or Triton's interpreter), with
activations held in the memory plan's slots and dropped as soon as their value dies."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from llmc.codegen.family import attention_backend
from llmc.codegen.family import resolve_kernel as resolve_family_kernel
from llmc.codegen.native import cpu_native
from llmc.codegen.plan import ORT_SEGMENT, RECOMPILE, Plan
from llmc.codegen.torch_cpu import cpu_kernels
from llmc.codegen.torch_cpu.cpu_kernels import RopeCache
from llmc.codegen.triton.triton_configs import AttentionConfig, TileConfig, attention_config, tile_config
from llmc.compiler.ops import DTYPE_NAMES, FLOAT_DTYPES, TORCH_DTYPES
from llmc.compiler.progress import Stages, bar, echo_stderr
from llmc.errors import ArtifactError, RuntimeLlmcError
from llmc.runtime import batch_invariance, native_decode
from llmc.runtime.attention import AttentionBackend
from llmc.runtime.attention_backends import attention_kind
from llmc.runtime.host_memory import cpu_tensors, file_mappings, release_file_pages
from llmc.runtime.kv_quant import is_quantized_kv, load_kv_scales
from llmc.runtime.ort_decode import load_decode_graph
from llmc.runtime.ort_segment import load_segment
from llmc.runtime.paged_attention import PagedKVCache
from llmc.runtime.plan_check import check_plan

SERVING_INPUTS = ("input_ids", "positions", "logits_indices")


class Launch(NamedTuple):
    fn: Any
    args: tuple[int, ...]   # register indices of the inputs
    outs: tuple[int, ...]   # register indices the outputs go to
    attrs: dict[str, Any]
    context: tuple[str, ...]
    frees: tuple[int, ...]  # registers whose value dies at this step
    recorded: frozenset[str]  # sha256 of the Triton kernels the step records it launches
    where: str


class PlanExecutor:
    """Registers are params, then graph inputs, then one per memory-plan slot. `check_kernels`
    (a debug check, for tests) fails a step that launches a Triton kernel it does not record."""

    def __init__(self, plan: Plan, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 check_kernels: bool = False, data: dict[str, bytes] | None = None, batch_invariant: bool = False,
                 q4_activations: str | None = None):
        self.plan = plan
        # every row's results the same bits whatever else is in the step (runtime/batch_invariance.py)
        self.family = kernel_family(plan)
        self.attention = attention_kind(self.family, plan.target)   # runtime/attention_backends.py
        self.batch_invariant = batch_invariant and self.device_is_cpu(device) and self.attention.batch_invariant
        # how the native 4-bit GEMVs round activations: the load's choice, else the artifact's
        self.q4_activations = q4_activations or cpu_kernels.q4_activations(plan.meta)
        self._data = data or {}   # the artifact's data files by path (ONNX segments)
        self.device = torch.device(device)
        # Triton kernels on the CPU run through the interpreter: progress is shown (_walk_shown)
        self._interpreted, self._announced = self.attention.triton and self.device.type == "cpu", False
        self.check_kernels = check_kernels
        missing = [p for p in plan.params if p not in weights]
        if missing:
            raise ArtifactError(f"plan for {plan.target} reads weights that were not given: "
                                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; load the "
                                f"artifact's weights file in full")
        check_plan(plan, weights)  # a plan is untrusted data: nothing of it runs before this passes
        self._kv_scales = self._plan_kv_scales(weights) if self.attention.triton else None
        # the configs the plan's Triton kernels were rendered with; kernels launch with exactly these
        self.launch_configs = plan_launch_configs(plan) if self.attention.triton else {}
        self._registers = {p: i for i, p in enumerate(plan.params)}
        self._ort_initializers: dict = {}   # shared by the ORT sessions (ort_segment.load_session)
        self._params = [_held(weights[p], self.device) for p in plan.params]
        if self.device.type != "cpu":   # copied to the device: the host's mapped pages are not read again
            release_file_pages([weights[p] for p in plan.params])
        base = len(self._registers)
        self._registers.update({name: base + i for i, name in enumerate(plan.inputs)})
        base += len(plan.inputs)
        self._registers.update({v: base + s for v, s in plan.memory.slot_of.items()})
        self._num_registers = base + len(plan.memory.slot_bytes)
        self._file_maps = file_mappings() if self.device.type == "cpu" else []   # where the mapped weights lie
        self._weights_cached = cpu_native.weights_fit_cache(sum(p.numel() * p.element_size() for p in self._params
                                                                if isinstance(p, torch.Tensor)))
        self._program = [self._launch(i, step) for i, step in enumerate(plan.steps)]
        self._mark_norms_feeding_qlinears()
        if self.batch_invariant:
            self._program = batch_invariance.mark_launches(self._program)
        self._outputs = [self._register(o, "graph output") for o in plan.outputs]
        self._check_registers()
        # ONNX Runtime's decode graph rounds by the row count (MLAS picks kernels by M): not when invariant
        self.decode_graph = None if self.batch_invariant else self._load_decode_graph()
        # decode steps of a few rows run their covered layers as one native call (None: walk them)
        self.native_decode = native_decode.build(self)
        self._release_read(self.plan.params)

    @staticmethod
    def device_is_cpu(device) -> bool:
        return torch.device(device).type == "cpu"

    def invariance(self) -> str:
        """'on', 'on, except ...' (what in this plan still rounds by the row count) or 'off'."""
        return batch_invariance.describe(self) if self.batch_invariant else "off"

    def weight(self, name: str) -> torch.Tensor:
        """The plan parameter `name` as the executor holds it (on its device)."""
        if name not in self.plan.params:
            raise RuntimeLlmcError(f"the plan has no parameter {name!r}; its parameters are "
                                   f"{self.plan.params[:5]}{' ...' if len(self.plan.params) > 5 else ''}")
        return self._params[self._registers[name]]

    def held(self) -> list:
        """What the launches keep from load on beside the params: each launch's prepared attrs and each
        ONNX Runtime session's initializers (the memory report finds the tensors in them)."""
        return [launch.attrs for launch in self._program] + [s.initializers for s in self._ort_sessions()]

    def ort_packed_bytes(self) -> int:
        """What the ONNX Runtime sessions hold of their own (OrtSegment.packed_bytes)."""
        return sum(s.packed_bytes for s in self._ort_sessions())

    def _ort_sessions(self) -> list:
        sessions = [launch.fn for launch in self._program] + [getattr(self.decode_graph, "session", None)]
        return [s for s in sessions if hasattr(s, "packed_bytes")]

    def _register(self, name: str, where: str) -> int:
        try:
            return self._registers[name]
        except KeyError:
            raise ArtifactError(f"{where}: {name!r} is no param, input or planned value; "
                                f"{RECOMPILE}") from None

    def _check_registers(self) -> None:
        """Walk the program as run_values will: each launch must find in its registers the very
        values its step names (none freed or overwritten before), and the outputs must survive."""
        fixed = len(self._params) + len(self.plan.inputs)
        held: list[str | None] = [None] * self._num_registers
        for name, r in self._registers.items():
            if r >= self._num_registers:
                raise ArtifactError(f"plan.json memory: {name!r} has slot {r - fixed}, beyond the "
                                    f"{self._num_registers - fixed} slots it plans; {RECOMPILE}")
            if r < fixed:
                held[r] = name
        for launch, step in zip(self._program, self.plan.steps):
            for name, r in zip(step.inputs, launch.args):
                if held[r] != name:
                    raise ArtifactError(f"{launch.where}: reads {name!r}, but the memory plan has put "
                                        f"{held[r]!r} in its slot by then; {RECOMPILE}")
            for name, r in zip(step.outputs, launch.outs):
                held[r] = name
            for r in launch.frees:
                held[r] = None
        for name, r in zip(self.plan.outputs, self._outputs):
            if held[r] != name:
                raise ArtifactError(f"plan.json output {name!r} is freed or overwritten before the plan "
                                    f"ends (its slot holds {held[r]!r}); {RECOMPILE}")

    def _plan_kv_scales(self, weights: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """The static int8/fp8 KV scales a quantised KV cache of this plan uses, per layer (for the
        one-shot backend, which quantises its temporary cache as serving does)."""
        kv = self.plan.meta.get("kv_cache") or {}
        if not is_quantized_kv(TORCH_DTYPES.get(kv.get("dtype"))):
            return None
        layout = self.plan.kv_layout()
        return [s.to(self.device) for s in load_kv_scales(weights, kv, layout["num_layers"], layout["num_kv_heads"])]

    def kv_dtype(self) -> torch.dtype | None:
        """The dtype the plan's KV cache stores (None: the plan does not say)."""
        kv = self.plan.meta.get("kv_cache") or {}
        return TORCH_DTYPES.get(kv.get("dtype") or self.plan.meta.get("kv_dtype"))

    def no_cache_backend(self) -> AttentionBackend:
        """Attention for one sequence whose every token is in the forward, for this kernel family."""
        return self.attention.no_cache(self)

    def paged_backend(self, cache: PagedKVCache) -> AttentionBackend:
        """Attention over a paged KV cache (metadata set per step), for this kernel family."""
        self._check_serving(cache)
        return self.attention.paged(self, cache)

    def _check_serving(self, cache: PagedKVCache) -> None:
        """Serving feeds input_ids, positions (and logits_indices) and reads logits, with a KV cache
        sized from the manifest: refuse a plan whose interface or attention layers do not fit them."""
        types = {name: self.plan.type_of(name) for name in self.plan.inputs + self.plan.outputs}
        inputs = {name: types[name] for name in self.plan.inputs}
        if (not {"input_ids", "positions"} <= set(inputs) <= set(SERVING_INPUTS)
                or any(t.dtype not in ("int64", "int32") or t.rank != 1 for t in inputs.values())):
            raise ArtifactError(f"plan.json inputs {self.plan.inputs} are not the serving inputs "
                                f"{', '.join(SERVING_INPUTS)} (int64 vectors); {RECOMPILE}")
        logits = types.get("logits", types[self.plan.outputs[0]] if self.plan.outputs else None)
        if logits is None or logits.rank != 2 or logits.dtype not in FLOAT_DTYPES:
            raise ArtifactError(f"plan.json outputs {self.plan.outputs} hold no float logits [rows, vocab]; "
                                f"{RECOMPILE}")
        # (the heads' shape, not the stored rows': an int4 cache packs each head into bytes)
        layout, shape = self.plan.kv_layout(), (cache.num_kv_heads, cache.head_dim) if cache.k_cache else ()
        have = {"num_layers": len(cache.k_cache), "num_kv_heads": shape[0] if shape else 0,
                "head_dim": shape[1] if shape else 0}
        if layout["num_layers"] and have != layout:
            raise ArtifactError(f"the KV cache the manifest sizes ({have}) does not fit the plan's attention "
                                f"layers ({layout}); {RECOMPILE}")
        k_types = {self.plan.type_of(s.inputs[1]).dtype for s in self.plan.attention_steps()}
        if self.attention.stores_as_computed and not cache.quantized and k_types - {DTYPE_NAMES[cache.dtype]}:
            raise ArtifactError(f"the manifest's {DTYPE_NAMES[cache.dtype]} KV cache cannot hold the plan's "
                                f"{sorted(k_types)} keys and values; {RECOMPILE}")

    def _launch(self, index: int, step) -> Launch:
        where = step.where(index)
        if step.kernel == ORT_SEGMENT:
            return self._segment_launch(index, step, where)
        try:
            fn = resolve_kernel(step.kernel)
        except ArtifactError as e:
            raise ArtifactError(f"{where}: {e}") from None
        args = tuple(self._register(i, where) for i in step.inputs)
        attrs = {k: v for k, v in step.attrs.items() if k != "kernels"}
        recorded = frozenset(k["sha256"] for k in step.attrs.get("kernels", ()))
        launch = Launch(fn, args, tuple(self._register(o, where) for o in step.outputs),
                        self._prepared_attrs(fn, args, attrs),
                        getattr(fn, "context", ()), self._dying(index, step), recorded, where)
        self._release_read(step.inputs, kept=launch.attrs)
        return launch

    def _release_read(self, names, kept=()) -> None:
        """Unmap the pages of the params among `names`, read by a launch's preparation just now
        (host_memory.release_file_pages): stored weights repacked at load leave the RSS, and the load's
        peak holds one launch's of them rather than all; a kernel reading them as stored faults them back.
        Params the prepared attrs `kept` use in place (the native 4-bit GEMV's) keep their pages."""
        if self._file_maps:
            # (strided ones: oneDNN's blocked copies are opaque, and never views of the file)
            in_place = {t.data_ptr() for t in cpu_tensors(_read_in_place(kept)) if t.layout is torch.strided}
            registers = (self._registers.get(n) for n in names)
            release_file_pages([self._params[r] for r in registers if r is not None and r < len(self._params)
                                and self._params[r].data_ptr() not in in_place], self._file_maps)

    def _mark_norms_feeding_qlinears(self) -> None:
        """Tell each torch norm whose result only quantised GEMMs read that it may round as the native
        kernel does (cpu_kernels.add_rms_norm); the rest stay bitwise F.rms_norm's."""
        readers: dict[str, set[str]] = {}
        for step in self.plan.steps:
            for name in step.inputs:
                readers.setdefault(name, set()).add(step.kernel)
        for i, step in enumerate(self.plan.steps):
            if (step.kernel in ("cpu.rms_norm", "cpu.add_rms_norm") and step.outputs[0] not in self.plan.outputs
                    and readers.get(step.outputs[0]) == {"cpu.qlinear"}):
                launch = self._program[i]
                self._program[i] = launch._replace(attrs={**launch.attrs, "feeds_qlinear": True})

    def _load_decode_graph(self):
        """The plan's decode graph (runtime/ort_decode.py), its weights the executor's params."""
        if "decode_graph" not in self.plan.meta:
            return None
        if self.device.type != "cpu":
            raise ArtifactError(f"plan.json meta.decode_graph: ONNX Runtime runs on the CPU, not {self.device}; "
                                f"load the artifact on the CPU or compile it for this device's target")
        weights = {name: self._params[self._registers[name]] for name in self.plan.params}
        return load_decode_graph(self.plan, self._data, weights, self._ort_initializers)

    def _dying(self, index: int, step) -> tuple[int, ...]:
        """Registers whose value is last used at step `index`."""
        lifetimes, outputs = self.plan.memory.lifetimes, set(self.plan.outputs)
        dying = [v for v in step.outputs + step.inputs
                 if v in lifetimes and lifetimes[v][1] == index and v not in outputs]
        return tuple(sorted({self._registers[v] for v in dying}))

    def _segment_launch(self, index: int, step, where: str) -> Launch:
        """An ONNX Runtime session over the step's ONNX file, its weights taken from the params."""
        if self.device.type != "cpu":
            raise ArtifactError(f"{where}: ONNX Runtime segments run on the CPU, not {self.device}; load the "
                                f"artifact on the CPU or compile it for this device's target")
        weights = {name: self._params[self._registers[name]] for name in self.plan.params}
        segment = load_segment(step, self._data, weights, self.plan.type_of, where, self._ort_initializers)
        self._release_read(param for param, _ in step.attrs["initializers"].values())
        return Launch(segment, tuple(self._register(i, where) for i in step.inputs),
                      tuple(self._register(o, where) for o in step.outputs), {}, (), self._dying(index, step),
                      frozenset(), where)

    @torch.inference_mode()
    def _prepared_attrs(self, fn, args: tuple[int, ...], attrs: dict) -> dict:
        """A kernel's `prepare` sees its param inputs and the plan's meta once, here (packing
        quantised weights, choosing their kernel by the row counts meta records); what it
        returns is passed on every launch alongside the step's attrs."""
        prepare = getattr(fn, "prepare", None)
        if prepare is None:
            return attrs
        params = [self._params[r] if r < len(self._params) else None for r in args]
        # the mode this load runs, over the one the plan records (the compile's default)
        meta = {**self.plan.meta, batch_invariance.META_KEY: self.batch_invariant,
                cpu_kernels.Q4_ACTIVATIONS: self.q4_activations, cpu_kernels.WEIGHTS_CACHED: self._weights_cached}
        return {**attrs, **prepare(params, attrs, meta)}

    @torch.inference_mode()
    def block_linear_weights(self) -> int:
        """Give every fp32 CPU `linear` a oneDNN-blocked copy of its weight, so steps of a few rows
        (speculative verification, small batches) cost little more than one row
        (cpu_kernels.blocked_linear_weight). Returns the bytes of the weights that have one."""
        held = 0
        if self.batch_invariant:   # the fp32 linears run the native GEMV at every row count
            return held
        for i, launch in enumerate(self._program):
            if launch.fn is not cpu_kernels.linear:
                continue
            weight = self._params[launch.args[1]] if launch.args[1] < len(self._params) else None
            if "blocked" not in launch.attrs:
                blocked = cpu_kernels.blocked_linear_weight(weight)
                if blocked is None:
                    continue
                self._program[i] = launch._replace(attrs={**launch.attrs, "blocked": blocked})
            held += weight.nbytes
        return held

    @torch.inference_mode()
    def run_values(self, inputs: dict[str, torch.Tensor], backend: AttentionBackend | None = None,
                   borrow: bool = False) -> dict[str, torch.Tensor]:
        """Run the plan on its graph inputs; returns every plan output by name. With `borrow`, an output may
        be a view of a buffer the next run overwrites (the native decode program's arena): for a plan whose
        launches hold nothing past the run (no pipeline send) and a caller done with its outputs by then,
        as the engine's step is with its logits; else each is the caller's own."""
        regs: list[Any] = self._params + [None] * (self._num_registers - len(self._params))
        for name in self.plan.inputs:
            regs[self._registers[name]] = self._check_input(name, inputs)
        context = {"backend": backend or self.no_cache_backend(), "rope_cache": RopeCache(),
                   "target": self.plan.target, "launch_configs": self.launch_configs}
        if self.check_kernels:
            for launch in self._program:
                self._store(regs, launch, self._run_checked(launch, regs, context))
            return {name: regs[i] for name, i in zip(self.plan.outputs, self._outputs)}
        if self._interpreted:
            self._walk_shown(regs, context)
            return {name: regs[i] for name, i in zip(self.plan.outputs, self._outputs)}
        native = self.native_decode
        if native is not None and backend is not None:
            self._walk(self._program[:native.start], regs, context)
            rest = native.end if native.run(regs, backend, context["rope_cache"], borrow) else native.start
            self._walk(self._program[rest:], regs, context)
        else:
            self._walk(self._program, regs, context)
        return {name: regs[i] for name, i in zip(self.plan.outputs, self._outputs)}

    def _walk_shown(self, regs: list, context: dict) -> None:
        """The walk of a plan whose Triton kernels run through the interpreter (minutes a step on a long
        prompt): a bar over its kernels on a terminal, and a line the first time a step runs long."""
        with Stages(echo_stderr, quiet=self._announced) as stages, \
                bar(len(self._program), "Triton interpreter", unit="kernel") as shown:
            stages.start(f"running each step's {len(self._program)} launches through Triton's interpreter "
                         f"(slow: a long prompt's first step can take minutes; a GPU runs them at once)")
            self._announced = True
            for launch in self._program:
                self._walk([launch], regs, context)
                shown.update()

    @staticmethod
    def _walk(launches: list[Launch], regs: list, context: dict) -> None:
        by_context: dict[tuple, dict] = {}   # each launch's context keyword args, built once a walk
        for fn, args, outs, attrs, ctx, frees, _, _ in launches:
            if ctx:
                kwargs = by_context.get(ctx)
                if kwargs is None:
                    kwargs = by_context[ctx] = {c: context[c] for c in ctx}
                results = fn(*[regs[i] for i in args], **attrs, **kwargs)
            else:
                results = fn(*[regs[i] for i in args], **attrs)
            for i, t in zip(outs, results):
                regs[i] = t
            for i in frees:
                regs[i] = None

    @staticmethod
    def _store(regs: list, launch: Launch, results) -> None:
        for i, t in zip(launch.outs, results):
            regs[i] = t
        for i in launch.frees:
            regs[i] = None

    def _run_checked(self, launch: Launch, regs: list, context: dict) -> list:
        """Run one launch, failing if it launched a Triton kernel its step does not record."""
        from llmc.codegen.triton.triton_render import record_loads  # jinja2: only Triton plans

        with record_loads() as launched:
            results = launch.fn(*[regs[i] for i in launch.args], **launch.attrs,
                                **{c: context[c] for c in launch.context})
        stray = [k for k in launched if k.sha256 not in launch.recorded]
        if stray:
            k = stray[0]
            raise AssertionError(f"{launch.where} launched kernel {k.name} ({k.template}, sha256 "
                                 f"{k.sha256[:12]}, constants {dict(k.constants)}), which the step does not "
                                 f"record; it records {sorted(h[:12] for h in launch.recorded)}")
        return results

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            backend: AttentionBackend | None = None) -> torch.Tensor:
        """logits [tokens, vocab] for one batch of tokens."""
        values = self.run_values({"input_ids": input_ids, "positions": positions}, backend)
        return values["logits"] if "logits" in values else values[self.plan.outputs[0]]

    @torch.inference_mode()
    def final_hidden_state(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden state the LM head reads at the last of `input_ids` (positions from 0, no KV cache):
        [hidden], from a prefill pass of its own. Plans whose LM head runs inside an ONNX Runtime segment
        keep it out of reach."""
        head = next(s for s in self.plan.steps if self.plan.outputs[0] in s.outputs)
        if head.kernel == ORT_SEGMENT or head.inputs[0] not in self._registers:
            raise RuntimeLlmcError("the plan's LM head runs inside an ONNX Runtime segment, so its input hidden "
                                   "states cannot be read")
        kept = self._registers[head.inputs[0]]
        inputs = {"input_ids": input_ids, "positions": torch.arange(len(input_ids))}
        if "logits_indices" in self.plan.inputs:
            inputs["logits_indices"] = torch.tensor([len(input_ids) - 1])
        regs: list[Any] = self._params + [None] * (self._num_registers - len(self._params))
        for name in self.plan.inputs:
            regs[self._registers[name]] = self._check_input(name, inputs)
        context = {"backend": self.no_cache_backend(), "rope_cache": RopeCache(), "target": self.plan.target,
                   "launch_configs": self.launch_configs}
        self._walk([launch._replace(frees=tuple(f for f in launch.frees if f != kept)) for launch in self._program],
                   regs, context)
        return regs[kept][-1]

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


WEIGHT_ALIGN = 64


def _held(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A param as the executor holds it: on the CPU the loaded tensor itself (a view of the artifact's
    weights file mapping, its pages shared with the page cache), copied only where its bytes sit off
    a 64-byte boundary, which torch's kernels assume (its int8 GEMM crashes on an int8 weight 4
    bytes off: the weights file aligns its data, see compiler/weights_file.py); on another device,
    a copy there."""
    if device.type == "cpu" and weight.device.type == "cpu" and weight.data_ptr() % WEIGHT_ALIGN == 0:
        return weight
    return torch.empty_like(weight, device=device).copy_(weight)


def kernel_family(plan: Plan) -> str:
    """The attention backend of the plan's kernel families ("cpu" or "triton", codegen/family.py): a plan
    names one family, or ONNX Runtime segments beside cpu kernels."""
    return attention_backend((s.kernel for s in plan.steps), plan.target)


def plan_launch_configs(plan: Plan) -> dict:
    """The launch configs a Triton plan's GEMM and attention kernels were rendered with, by family
    ("gemm": TileConfig, "attention": AttentionConfig): those plan.meta["autotune"] records
    (codegen/autotune.py), the target's defaults where it records none."""
    autotune = plan.meta.get("autotune") or {}
    recorded = (autotune.get("configs") or {}) if isinstance(autotune, dict) else None
    if not isinstance(recorded, dict):
        raise ArtifactError(f"plan.json meta.autotune is {autotune!r:.60}, not an object of configs; {RECOMPILE}")
    configs = {"gemm": tile_config(plan.target), "attention": attention_config(plan.target)}
    for family, cls in (("gemm", TileConfig), ("attention", AttentionConfig)):
        if family in recorded:
            configs[family] = _recorded_config(cls, recorded[family], family)
    return configs


def _recorded_config(cls, recorded, family: str):
    """A launch config from its JSON record: small positive ints (and strings where the config has
    them), validated by the config itself; these constants go into kernel source."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    ok = isinstance(recorded, dict) and set(recorded) <= set(fields) and all(
        (type(v) is int and 1 <= v <= 1 << 16) if fields[k] in ("int", int) else isinstance(v, str)
        for k, v in recorded.items())
    try:
        if ok:
            return cls(**recorded)
        problem = "fields must be positive ints up to 65536 (or the config's strings)"
    except (TypeError, AssertionError) as e:
        problem = str(e)
    raise ArtifactError(f"plan.json meta.autotune.configs.{family} {recorded!r:.120} is no valid {cls.__name__} "
                        f"({problem}); {RECOMPILE}")


def resolve_kernel(name: str):
    """The function a plan step's kernel name stands for, from its family (codegen/family.py); Triton
    kernels are imported only when a plan names them (importing triton must wait until the device has
    been chosen)."""
    return resolve_family_kernel(name)


def _read_in_place(value):
    """`value` (a launch's prepared attrs) with each 4-bit GEMV's weights as the tensors its kernels read
    (cpu_native.kernel_tensors): weights repacked into AMX tiles leave their stored pages to be released."""
    if type(value) is cpu_native.Q4Weights:
        return cpu_native.kernel_tensors(value)
    if isinstance(value, dict):
        return {k: _read_in_place(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return [_read_in_place(v) for v in value]
    return value


__all__ = ["PlanExecutor", "Launch", "kernel_family", "plan_launch_configs", "resolve_kernel"]

