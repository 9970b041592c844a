"""One plan segment of the "ort" kernel family run as an ONNX Runtime session: built once at load
from the artifact's ONNX bytes with its weights supplied from the artifact's tensors (external
initializers, no copy), computing with the runtime's thread count; each call binds the input and
output tensors' memory to the session (IOBinding), so nothing is copied in or out."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from llmc.codegen.ort import nbits_rows, ort_int8  # through the module: tests fake signed_int8_exact
from llmc.codegen.ort.onnx_ops import EXTERNAL_LOCATION, SEGMENT_OPS
from llmc.codegen.ort.onnx_weights import initializer
from llmc.codegen.plan import RECOMPILE
from llmc.compiler.ir import TensorType, eval_dim
from llmc.errors import ArtifactError, RuntimeLlmcError
from llmc.runtime.host_memory import anonymous_rss
from llmc.runtime.threads import current_threads

NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32,
                torch.uint8: np.uint8, torch.int8: np.int8, torch.float16: np.float16}
NUMPY_TORCH = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}
TORCH_OF = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32}
ORT_FIX = ("install an onnxruntime with its contrib ops (pip install -U 'onnxruntime>=1.22') or recompile "
           "with --kernels cpu")


def cpu_kernel_ops() -> set[tuple[str, str]]:
    """(domain, op) of every kernel this onnxruntime build has for its CPU execution provider."""
    from onnxruntime.capi import _pybind_state  # onnxruntime: the engine and every compile import this module

    return {(k.domain, k.op_name) for k in _pybind_state.get_all_opkernel_def()
            if k.provider == "CPUExecutionProvider"}


def require_ops(ops: set[tuple[str, str]], where: str) -> None:
    """Raise naming the first of `ops` ((domain, op_type)) this onnxruntime cannot run on the CPU."""
    import onnxruntime  # onnxruntime: the engine and every compile import this module

    missing = sorted(ops - cpu_kernel_ops())
    if missing:
        domain, op = missing[0]
        raise RuntimeLlmcError(f"{where}: onnxruntime {onnxruntime.__version__} has no CPU kernel for "
                               f"{domain + '.' if domain else ''}{op}; {ORT_FIX}")


def check_segment_model(model: bytes, inputs: list[str], outputs: list[str], sources: dict,
                        where: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Refuse ONNX bytes that are not a segment as codegen/ort/ort_lowering.py makes them: other ops or
    domains, functions or subgraphs, other inputs or outputs, or external data other than the
    initializers the step supplies (ORT would read such data from a file the bytes name). Returns
    each supplied initializer's dims and dtype."""
    import onnx  # onnx: the engine and every compile import this module
    from onnx import helper  # onnx: as above

    try:
        proto = onnx.load_from_string(model)
    except Exception as e:  # noqa: BLE001 - any parse failure of untrusted bytes refuses them
        raise ArtifactError(f"{where}: the ONNX file does not parse ({type(e).__name__}); {RECOMPILE}") from None
    g = proto.graph
    odd = [f"{n.domain}.{n.op_type}".lstrip(".") for n in g.node
           if (n.domain if n.domain != "ai.onnx" else "", n.op_type) not in SEGMENT_OPS
           or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)]
    if odd or proto.functions:
        raise ArtifactError(f"{where}: the ONNX file runs {odd[0] if odd else 'model-local functions'}, which no "
                            f"segment of this llmc does; {RECOMPILE}")
    require_ops({(n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in g.node}, where)
    if [i.name for i in g.input] != inputs or [o.name for o in g.output] != outputs:
        raise ArtifactError(f"{where}: the ONNX graph's inputs/outputs differ from the step's; {RECOMPILE}")
    external = {t.name: t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    if set(external) != set(sources) or any(
            {e.key: e.value for e in t.external_data}.get("location") != EXTERNAL_LOCATION for t in external.values()):
        raise ArtifactError(f"{where}: the ONNX file's external initializers are not the ones the step supplies; "
                            f"{RECOMPILE}")
    signed = [n.name for n in g.node if n.op_type in ("MatMulInteger", "MatMulIntegerToFloat")
              and n.input[1] in external and external[n.input[1]].data_type == onnx.TensorProto.INT8]
    if signed and not ort_int8.signed_int8_exact():
        raise ArtifactError(f"{where}: node {signed[0]!r} multiplies uint8 x int8 codes, which ONNX Runtime on "
                            f"this CPU (no VNNI) sums in saturating int16; recompile the model on this machine "
                            f"(its w8a8 segments then carry uint8 weights), or with --kernels cpu")
    return {name: (tuple(t.dims), NUMPY_TORCH[helper.tensor_dtype_to_np_dtype(t.data_type)])
            for name, t in external.items()}


def session_options(threads: int, spin: bool = False):
    import onnxruntime  # onnxruntime: the engine and every compile import this module

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    # Plan segments' workers sleep between ops instead of spinning: a plan has a session per segment,
    # each with its own pool, and torch's attention runs between them. SmolLM2 fp32 decode, 2 threads
    # on a 2-core host under load 15: 0.19 tok/s spinning, 0.7 not (torch kernels: 0.64).
    # The decode graph (`spin`) is one run of ~1,800 small ops a step: its workers spin while it runs,
    # since waking one for each op cost more than the op (SmolLM2 int4, 121 MatMulNBits, batch-1
    # decode step 10.5 -> 7.4 ms, batch 64 180 -> 167 ms), and stop when the run returns: left
    # spinning, they took a core from torch's sampling between steps (sampling 0.7 -> 6.1 ms a step).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    # One arena for all of them: a session's own grows to its largest activations on the first run at
    # a new size and keeps them, 31 arenas for SmolLM2's segments; one shared arena grows once
    # (SmolLM2 w8a8 first 512-token prefill: 2.1 s -> 0.8 s; later ones as before)
    _share_cpu_arena()
    options.add_session_config_entry("session.use_env_allocators", "1")
    # ORT otherwise copies every external initializer into its own memory, once per session (the weights
    # a kernel prepacks are copied again): it reads the artifact's mapped weights and the transforms'
    # tensors, which the sessions share, in place (onnxruntime 1.32; SmolLM2's sessions 355 -> 173 MB)
    options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
    return options


@functools.lru_cache(maxsize=1)
def _share_cpu_arena() -> None:
    """Register one CPU arena allocator with ONNX Runtime's process-wide environment."""
    import onnxruntime  # onnxruntime: the engine and every compile import this module

    info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                     onnxruntime.OrtMemType.DEFAULT)
    onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, -1, -1, -1))


class OrtSegment:
    """Callable like a CPU kernel: the segment's input tensors in, its output tensors out. `inputs`
    and `outputs` name the ONNX graph's values with their plan types."""

    def __init__(self, model: bytes, initializers: dict[str, torch.Tensor], inputs: list[tuple[str, TensorType]],
                 outputs: list[tuple[str, TensorType]], threads: int, where: str, spin: bool = False):
        import onnxruntime  # onnxruntime: the engine and every compile import this module

        options = session_options(threads, spin)
        self.initializers = initializers   # ORT reads their memory for the session's lifetime
        names = sorted(initializers)
        options.add_external_initializers(names, [onnxruntime.OrtValue.ortvalue_from_numpy(initializers[n].numpy())
                                                  for n in names])
        before = anonymous_rss()
        try:
            self.session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - ORT raises its own types for any graph it refuses
            message = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise ArtifactError(f"{where}: onnxruntime refuses the segment ({message}); recompile the "
                                f"model with this llmc, or with --kernels cpu") from None
        # what the session holds of its own, measured since ORT does not say: the copies of the weights its
        # kernels prepack (MatMulNBits' codes), for the memory report
        self.packed_bytes = max(0, anonymous_rss() - before)
        self.binding = self.session.io_binding()
        # the C-level binding and run: the Python wrappers re-make the device and re-check capture
        # state on every call, which cost more than a decode step's small segments compute
        self._bind_input = self.binding._iobinding.bind_input
        self._bind_output = self.binding._iobinding.bind_output
        self._run = self.session._sess.run_with_iobinding
        self._device = onnxruntime.OrtDevice.make("cpu", 0)._get_c_device()
        self.inputs = [(name, t, NUMPY_DTYPES[TORCH_OF[t.dtype]]) for name, t in inputs]
        self.outputs = [(name, t, TORCH_OF[t.dtype]) for name, t in outputs]
        self._shapes: tuple = ()             # the last call's input shapes ...
        self._output_shapes: list = []       # ... and the output shapes they give
        self.where = where
        self.nbits_levels = nbits_rows.nbits_levels(model)
        # the symbolic dims that only ever lead a shape (tokens, rows): a one-row call may take a second
        self._row_dims = row_dims([t for _, t, _ in self.inputs + self.outputs])
        self.pad_single_rows = False   # set by batch_invariance.mark_launches

    def rounds_alone_apart(self) -> bool:
        """Whether one of this segment's MatMulNBits rounds a row called alone apart from the same row
        among others, on this machine (codegen/ort/nbits_rows.py), which a second row fixes."""
        return bool(self._row_dims) and any(nbits_rows.row_rounding(level) == nbits_rows.SINGLE
                                            for level in self.nbits_levels)

    def _sizes(self, values) -> dict[str, int]:
        """The sizes of the symbolic dims, read off the inputs' shapes."""
        sizes: dict[str, int] = {}
        for (name, t, _), value in zip(self.inputs, values):
            for dim, size in zip(t.shape, value.shape):
                if isinstance(dim, str) and dim.isidentifier():
                    sizes[dim] = size
        return sizes

    def _shapes_for(self, values) -> list[list[int]]:
        shapes = tuple(v.shape for v in values)
        if shapes != self._shapes:
            sizes = self._sizes(values)
            self._output_shapes = [[d if isinstance(d, int) else eval_dim(d, sizes) for d in t.shape]
                                   for _, t, _ in self.outputs]
            self._shapes = shapes
        return self._output_shapes

    def __call__(self, *values: torch.Tensor, **attrs) -> list[torch.Tensor]:
        if self.pad_single_rows:
            return self._padded(values)
        return self._call(values)

    def _padded(self, values) -> list[torch.Tensor]:
        """The call with each one-row dim given a copy of its row, and the copies' outputs dropped."""
        single = {d for d, size in self._sizes(values).items() if d in self._row_dims and size == 1}
        if not single:
            return self._call(values)
        leads = lambda t: t.shape and t.shape[0] in single
        results = self._call([torch.cat([v, v]) if leads(t) else v for (_, t, _), v in zip(self.inputs, values)])
        return [out[:1] if leads(t) else out for (_, t, _), out in zip(self.outputs, results)]

    def _call(self, values) -> list[torch.Tensor]:
        values = [v.contiguous() for v in values]   # kept alive until the run returns
        for (name, _, np_dtype), value in zip(self.inputs, values):
            self._bind_input(name, self._device, np_dtype, list(value.shape), value.data_ptr())
        results = []
        for (name, _, dtype), shape in zip(self.outputs, self._shapes_for(values)):
            out = torch.empty(shape, dtype=dtype)
            self._bind_output(name, self._device, NUMPY_DTYPES[dtype], shape, out.data_ptr())
            results.append(out)
        self._run(self.binding._iobinding, None)
        return results


def row_dims(types: list[TensorType]) -> frozenset[str]:
    """The symbolic dims of `types` found only as the leading dim."""
    symbolic = lambda d: isinstance(d, str) and d.isidentifier()
    leading = {t.shape[0] for t in types if t.shape and symbolic(t.shape[0])}
    inner = {d for t in types for d in t.shape[1:] if symbolic(d)}
    return frozenset(leading - inner)


def load_segment(step, data: dict[str, bytes], weights: dict[str, torch.Tensor], type_of, where: str,
                 made: dict | None = None) -> OrtSegment:
    """The session of an `ort.segment` plan step: its ONNX file from `data` (checked against the
    step's sha256 and by check_segment_model), its initializers made from `weights` (see load_session)."""
    io = lambda names: [(n, type_of(n)) for n in names]
    return load_session(step.attrs, io(step.inputs), io(step.outputs), data, weights, where, made=made)


def load_session(attrs: dict, inputs: list[tuple[str, TensorType]], outputs: list[tuple[str, TensorType]],
                 data: dict[str, bytes], weights: dict[str, torch.Tensor], where: str,
                 spin: bool = False, made: dict | None = None) -> OrtSegment:
    """An OrtSegment over the ONNX file `attrs` names ({file, sha256, initializers}),
    with those inputs and outputs (`spin`: see session_options). `made` holds the initializers made
    for other sessions by (param, transform, dims): each is made once however many sessions read it."""
    model = data.get(attrs["file"])
    if model is None:
        raise ArtifactError(f"{where}: its ONNX file {attrs['file']} was not given; load the artifact with "
                            f"llmc.load, which reads its data files")
    if hashlib.sha256(model).hexdigest() != attrs["sha256"]:
        raise ArtifactError(f"{where}: {attrs['file']} differs from the file the plan records (edited after "
                            f"compiling?); {RECOMPILE}")
    declared = check_segment_model(model, [n for n, _ in inputs], [n for n, _ in outputs], attrs["initializers"],
                                   where)
    initializers, made = {}, {} if made is None else made
    for name, (param, transform) in sorted(attrs["initializers"].items()):
        dims, dtype = declared[name]
        key = (param, transform, dims)
        try:
            value = made[key] if key in made else made.setdefault(key, initializer(weights[param], transform, dims))
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"{where}: initializer {name!r} from param {param!r}: {e}; {RECOMPILE}") from None
        if value.dtype != dtype:
            raise ArtifactError(f"{where}: initializer {name!r} is declared {dtype}, param {param!r} under "
                                f"{transform} gives {value.dtype}; {RECOMPILE}")
        initializers[name] = value
    return OrtSegment(model, initializers, inputs, outputs, current_threads(), where, spin)


__all__ = ["load_segment", "load_session", "OrtSegment", "row_dims", "check_segment_model", "require_ops",
           "cpu_kernel_ops", "session_options", "ORT_FIX"]
