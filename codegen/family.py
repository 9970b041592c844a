"""Kernel families behind one interface, and the registry that holds them. A family is one folder of
kernels (codegen/torch_cpu/, codegen/native/, codegen/ort/, codegen/triton/) that says which targets it
serves (or, as a refusal string, why not), what it offers a compile as candidates, how a plan step's
kernel name becomes a launch at run time, and the attention backend its plans run with. The executor
finds a step's family by the prefix of its kernel name (`cpu.rms_norm`, `triton.qlinear`,
`ort.segment`). Choosing among candidates by measurement is the driver's job
(compiler/driver/tuning/), never a family's.

The Triton family's kernels are imported when a plan names them: importing triton must wait until the
device has been chosen (ONNX itself is imported by the ORT modules only where they build a graph)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llmc.codegen.native import cpu_native
from llmc.codegen.ort.ort_lowering import find_segments, kept_in_torch
from llmc.codegen.torch_cpu.cpu_kernels import resolve_kernel as resolve_torch
from llmc.compiler.targets import TARGETS
from llmc.errors import ArtifactError

Kernel = Callable[..., list]
RECOMPILE = "recompile the model with this llmc"


@dataclass(frozen=True)
class KernelFamily:
    name: str       # the prefix of its plan steps' kernel names ("cpu" for `cpu.rms_norm`)
    folder: str     # where its kernels live: codegen/<folder>/
    # target name -> None where the family serves it, else a line saying why not
    refusal: Callable[[str], str | None]
    # compile time: (graph, plan, target) -> what the family offers the driver for that plan (the plan's
    # steps themselves, or the segments a step run could become); None: it offers no plan steps
    candidates: Callable | None = None
    # run time: kernel name -> the function a launch calls; None: it has no step functions (its steps,
    # if any, are sessions the runtime builds from the artifact's data: `sessions`)
    resolve: Callable[[str], Kernel] | None = None
    sessions: bool = False   # its steps are sessions over stored data (runtime/ort_segment.py loads them)
    # the attention backend its plans run with: "cpu" (runtime/paged_attention.py, reading the paged
    # KV cache in torch and native C) or "triton" (runtime/triton_attention_backend.py)
    attention: str | None = None

    @property
    def runs_steps(self) -> bool:
        """Whether plan steps may name this family's kernels."""
        return self.resolve is not None or self.sessions

    def supports(self, target: str) -> bool:
        return self.refusal(target) is None


FAMILIES: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    """Add `family` to the registry; a name registered twice is a bug."""
    if family.name in FAMILIES:
        raise ValueError(f"kernel family {family.name!r} is registered twice")
    FAMILIES[family.name] = family
    return family


def family_of(kernel: str) -> KernelFamily | None:
    """The family whose kernel `kernel` ("<family>.<op>") is; None if no family runs such steps."""
    return _stepping(kernel.partition(".")[0])


def _stepping(name: str) -> KernelFamily | None:
    family = FAMILIES.get(name)
    return family if family is not None and family.runs_steps else None


def resolve_kernel(kernel: str) -> Kernel:
    """The function a plan step's kernel name stands for. A name no family resolves goes to the torch
    family, whose error names the kernels this llmc has."""
    family = family_of(kernel)
    resolve = family.resolve if family is not None and family.resolve is not None else FAMILIES["cpu"].resolve
    return resolve(kernel)


def attention_backend(kernels, target: str) -> str:
    """The attention backend of a plan whose steps name `kernels`: its families must share one (a plan
    names one family, or ONNX Runtime segments beside torch kernels); "cpu" for a plan of no steps."""
    names = {k.partition(".")[0] for k in kernels}
    families = [_stepping(n) for n in names]
    backends = {f.attention for f in families if f is not None}
    if None in families or len(backends) > 1:
        raise ArtifactError(f"plan for {target} names kernels of families {sorted(names)}; this llmc runs plans "
                            f"whose families share one attention backend ({mixes()}); {RECOMPILE}")
    return backends.pop() if backends else "cpu"


def mixes() -> str:
    """The families that may share a plan, by attention backend: `cpu + ort; triton`."""
    by_backend: dict[str, list[str]] = {}
    for f in FAMILIES.values():
        if f.runs_steps:
            by_backend.setdefault(f.attention, []).append(f.name)
    return "; ".join(" + ".join(sorted(names)) for names in by_backend.values())


def families_for(target: str) -> dict[str, str | None]:
    """Every family by name -> None where it serves `target`, else why not (llmc inspect, tests)."""
    return {name: f.refusal(target) for name, f in FAMILIES.items()}


# --- the families that exist -------------------------------------------------------------------------

def _device_refusal(device: str, what: str) -> Callable[[str], str | None]:
    def refusal(target: str) -> str | None:
        t = TARGETS.get(target)
        if t is None:
            return f"no target {target!r}; targets are {sorted(TARGETS)}"
        return None if t.device == device else f"the {what} family serves {device} targets; {target} is {t.device}"
    return refusal


def _plan_steps(graph, plan, target):
    """The torch and Triton families' candidates: the plan build_plan laid out, one step per node."""
    return plan.steps


def _triton_resolve(kernel: str) -> Kernel:
    # jinja2 (its renderers): the engine imports this module
    from llmc.codegen.triton.triton_kernels import resolve_kernel as resolve_triton
    return resolve_triton(kernel)


def _native_refusal(target: str) -> str | None:
    cpu = _device_refusal("cpu", "native C")(target)
    if cpu is not None:
        return cpu
    return None if cpu_native.available() else cpu_native.status()   # builds the library on first use


def _ort_refusal(target: str) -> str | None:
    return _device_refusal("cpu", "ONNX Runtime")(target)


def _ort_segments(graph, plan, target):
    """The runs of the cpu plan's steps ONNX Runtime can run (codegen/ort/ort_lowering.py); which become
    `ort.segment` steps is the driver's choice (compiler/driver/tuning/kernel_choice.py)."""
    return find_segments(graph, kept_in_torch(graph), plan.outputs)


TORCH_CPU = register(KernelFamily("cpu", "torch_cpu", _device_refusal("cpu", "torch CPU"),
                                  candidates=_plan_steps, resolve=resolve_torch, attention="cpu"))
# called by the torch kernels and the runtime's native decode program, not named by plan steps
NATIVE = register(KernelFamily("native", "native", _native_refusal))
ORT = register(KernelFamily("ort", "ort", _ort_refusal, candidates=_ort_segments, sessions=True, attention="cpu"))
TRITON = register(KernelFamily("triton", "triton", _device_refusal("cuda", "Triton"), candidates=_plan_steps,
                               resolve=_triton_resolve, attention="triton"))

__all__ = ["KernelFamily", "FAMILIES", "register", "family_of", "resolve_kernel", "attention_backend",
           "families_for", "TORCH_CPU", "NATIVE", "ORT", "TRITON"]
