"""Pass infrastructure: the `Pass` interface, the context a pipeline runs in, and the
`PassManager` that runs passes in order, verifying, timing and dumping the IR around each."""

from __future__ import annotations

import abc
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from tqdm import tqdm

from llmc.compiler.ir import Graph
from llmc.compiler.progress import bar
from llmc.errors import IRError, PassError
from llmc.passes.accuracy import AccuracyMeter, check_budget
from llmc.passes.options import PassOptions
from llmc.passes.registry import (
    NEEDS,
    PASSES,
    Stage,
    build_pipeline,
    get_pass,
    parse_pass_options,
    register_pass,
    valid_pass_names,
)


@dataclass
class PassResult:
    """What one pass did: how many patterns it rewrote, and what that bought or cost."""
    matches: int
    changed: bool
    details: dict = field(default_factory=dict)   # JSON-serialisable
    bytes_saved: int = 0
    accuracy: dict | None = None                  # lossy passes: measured cost on calibration text


class Pass(abc.ABC):
    """A graph transformation. Subclasses declare `name`, `description`, `stage` (and the
    other `stages` it may be placed in), `lossy`, `needs` (keys of NEEDS), `required` (lowering
    steps nobody may disable) and `Options`, a PassOptions dataclass; an instance's `options`
    is that class filled in with the values it runs with."""
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    stage: ClassVar[Stage] = Stage.FUSE
    stages: ClassVar[tuple[Stage, ...]] = ()
    lossy: ClassVar[bool] = False
    needs: ClassVar[tuple[str, ...]] = ()
    required: ClassVar[bool] = False
    Options: ClassVar[type[PassOptions]] = PassOptions

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "Options" not in cls.__dict__:  # a pass without options still gets its own (empty) class
            cls.Options = dataclasses.make_dataclass(f"{cls.__name__}Options", [], bases=(PassOptions,), frozen=True)
        cls.Options.pass_name = cls.name
        if cls.lossy and "calibration" not in cls.needs:  # its cost is measured on calibration text
            cls.needs = (*cls.needs, "calibration")

    def __init__(self, **options):
        self.options = type(self).Options.build(options)

    @classmethod
    def allowed_stages(cls) -> tuple[Stage, ...]:
        return cls.stages or (cls.stage,)

    @abc.abstractmethod
    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Rewrite `graph` in place and say what was done."""

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.to_dict().items())
        return f"{self.name}({opts})"


def calibration_size(calibration) -> str:
    """"8 x 128 tokens" (or "N sequences, T tokens" when their lengths differ)."""
    lengths = {len(s) for s in calibration or []}
    if len(lengths) == 1:
        return f"{len(calibration)} x {lengths.pop()} tokens"
    return f"{len(calibration or [])} sequences, {sum(len(s) for s in calibration or [])} tokens"


def echo_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class PassContext:
    """Everything a pipeline run shares: target, global options, calibration data, and the
    instruments (print IR after named passes, dump IR to a folder, disabled passes)."""
    target: Any = None                  # a compiler.targets.Target or its name
    options: dict = field(default_factory=dict)
    calibration: Any = None
    # the calibration's next-token logits before the first lossy pass (set by the run that measured
    # them): what the cpu target's kernel choice checks int8 activations against
    # (compiler/driver/tuning/ort_accuracy.py)
    reference_logits: Any = None
    source_weights: dict = field(default_factory=dict)       # param name -> its stored quantised form
    print_ir_after: set[str] = field(default_factory=set)   # pass names, or "all"
    dump_ir: str | Path | None = None
    disabled: set[str] = field(default_factory=set)
    verbose: bool = False
    quiet: bool = False
    echo: Callable[[str], None] = echo_stderr
    stages: Any = None                  # a compiler.progress.Stages announcing long passes, if any

    def bar(self, desc: str, total: int | None, unit: str = "node"):
        """A progress bar for long work inside a pass (a terminal only; none when quiet)."""
        return bar(total, desc, unit, quiet=self.quiet)

    def calibration_walk(self, desc: str, graph: Graph):
        """The bar of one walk of the calibration text through `graph`, node by node."""
        return self.bar(f"{desc} ({calibration_size(self.calibration)})", len(graph.nodes))

    @property
    def target_name(self) -> str | None:
        return self.target if self.target is None or isinstance(self.target, str) else self.target.name


@dataclass
class PassRecord:
    """One pass's entry in the compile report and the artifact manifest."""
    name: str
    stage: str
    options: dict
    seconds: float
    changed: bool
    matches: int
    details: dict
    bytes_saved: int
    accuracy: dict | None
    op_counts_before: dict[str, int]
    op_counts_after: dict[str, int]

    def to_dict(self, include_timing: bool = True) -> dict:
        """Plain JSON data; without timing it is identical for identical compiles."""
        d = {"name": self.name, "stage": self.stage, "options": self.options, "changed": self.changed,
             "matches": self.matches, "details": self.details, "bytes_saved": self.bytes_saved,
             "accuracy": self.accuracy, "op_counts_before": self.op_counts_before,
             "op_counts_after": self.op_counts_after}
        if include_timing:
            d["seconds"] = self.seconds
        return d


class PassManager:
    """Runs passes in order over one graph, verifying the IR after each."""

    def __init__(self, passes: list[Pass], ctx: PassContext | None = None, stages: list[Stage] | None = None):
        """`stages`, when given, says which stage each pass was scheduled in (a cleanup pass
        may run in more than one); otherwise each runs in its declared stage."""
        self.passes = list(passes)
        self.ctx = ctx or PassContext()
        self.stages = list(stages) if stages is not None else [p.stage for p in self.passes]

    def stage_of(self, p: Pass) -> Stage:
        return self.stages[next(i for i, q in enumerate(self.passes) if q is p)]

    def run(self, graph: Graph) -> list[PassRecord]:
        self._check_instrument_names()
        try:
            graph.verify()
        except IRError as e:
            raise IRError(f"graph {graph.name} is invalid before any pass ran: {e}") from e
        records = []
        # lossy passes are measured against the graph as it was before the first of them
        calibration = self.ctx.calibration
        self._meter = None if calibration is None else AccuracyMeter(calibration, self.ctx.calibration_walk)
        bar = tqdm(self.passes, desc="passes", unit="pass", leave=False, file=sys.stderr,
                   disable=self.ctx.quiet or not sys.stderr.isatty())
        for index, p in enumerate(bar, start=1):
            if p.name in self.ctx.disabled:
                continue
            bar.set_postfix_str(p.name)
            records.append(self._run_one(index, p, graph))
        if self._meter is not None and self._meter.ref_logits is not None:
            self.ctx.reference_logits = self._meter.ref_logits
        return records

    def _run_one(self, index: int, p: Pass, graph: Graph) -> PassRecord:
        before = graph.op_counts()
        meter = self._meter if p.lossy else None
        if "calibration" in p.needs and self.ctx.stages is not None:
            self.ctx.stages.start(f"{p.name}: calibrating on {calibration_size(self.ctx.calibration)}, node by node")
        if meter is not None:
            meter.capture_reference(graph)
        self._dump(index, p.name, "before", graph)
        start = time.perf_counter()
        result = p.run(graph, self.ctx)
        seconds = time.perf_counter() - start
        self._check_result(p, result)
        self._dump(index, p.name, "after", graph)
        if p.name in self.ctx.print_ir_after or "all" in self.ctx.print_ir_after:
            self.ctx.echo(f"// IR after {p.name}\n{graph}")
        self._verify(p, graph)
        accuracy = result.accuracy
        if meter is not None:
            accuracy = {**(accuracy or {}), **meter.measure(graph)}
            check_budget(p.name, accuracy, self.ctx.options.get("max_ppl_increase"))
        record = PassRecord(p.name, self.stage_of(p).label, p.options.to_dict(), seconds, result.changed,
                            result.matches, result.details, result.bytes_saved, accuracy,
                            before, graph.op_counts())
        if self.ctx.verbose:
            self.ctx.echo(summarize(record))
        return record

    def _verify(self, p: Pass, graph: Graph) -> None:
        try:
            graph.verify()
        except Exception as e:  # any verifier failure here is the pass's doing
            raise PassError(f"pass {p.name!r} left an invalid graph: {e}; "
                            f"rerun with --disable-pass {p.name} to compile without it") from e

    def _check_result(self, p: Pass, result: Any) -> None:
        if not isinstance(result, PassResult):
            raise TypeError(f"pass {p.name!r} returned {type(result).__name__}, not PassResult")
        json.dumps(result.details)  # the manifest stores details; fail here, not at write time

    def _dump(self, index: int, name: str, when: str, graph: Graph) -> None:
        if self.ctx.dump_ir is None:
            return
        folder = Path(self.ctx.dump_ir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index:02d}_{name}.{when}.txt").write_text(str(graph) + "\n")

    def _check_instrument_names(self) -> None:
        known = set(valid_pass_names()) | {p.name for p in self.passes}
        for what, names in (("--print-ir-after", self.ctx.print_ir_after - {"all"}),
                            ("--disable-pass", self.ctx.disabled)):
            for name in sorted(names):
                if name not in known:
                    raise PassError(f"{what} names unknown pass {name!r}; "
                                    f"valid passes: {', '.join(sorted(known))}")
        required = sorted(p.name for p in self.passes if p.required and p.name in self.ctx.disabled)
        if required:
            raise PassError(f"--disable-pass {required[0]}: it is a lowering step every compile needs; "
                            f"it cannot be disabled")


def summarize(record: PassRecord) -> str:
    """One line per pass for verbose output: matches, bytes saved, time."""
    saved = f", {format_bytes(record.bytes_saved)} saved" if record.bytes_saved else ""
    acc = record.accuracy or {}
    cost = (f", calibration ppl {acc['ppl_before']:.4g} -> {acc['ppl_after']:.4g}, KL {acc['kl']:.3g}"
            if "ppl_after" in acc else "")
    return f"{record.name}: {record.matches} matches{saved}{cost}, {record.seconds * 1e3:.1f} ms"


def format_bytes(n: int) -> str:
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"


__all__ = ["PassResult", "Pass", "Stage", "NEEDS", "PassOptions", "PassContext", "PassRecord", "PassManager",
           "PASSES", "register_pass", "get_pass", "build_pipeline", "parse_pass_options",
           "summarize", "format_bytes"]
