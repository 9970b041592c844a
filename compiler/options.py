"""The compile options, defined once: `llmc compile`'s flags are generated from these fields
(llmc/cli.py), `llmc.compile(**options)` takes them by name, and the pipeline reads them.
Adding an option means adding one field here (and using it where it acts)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.codegen.native.cpu_native import Q4_ACTIVATIONS
from llmc.codegen.ort.ort_lowering import KERNEL_MODES
from llmc.compiler.bounded_input import file_kind
from llmc.compiler.recipes import KV_CACHE_CHOICES, KV_GROUPING_CHOICES, QUANT_CHOICES, SPARSITY_METHODS
from llmc.errors import PassError
from llmc.runtime.kv_policy import kv_policy


def flag(default: Any, help: str, *, cli: str | None = None, short: str | None = None,
         choices: tuple | None = None, kind: type | None = None, multiple: bool = False,
         is_flag: bool = False, path: str | None = None) -> Any:
    """A compile option. `cli`: its flag (default --name-with-dashes); `kind`: the CLI value type;
    `path`: "file" or "dir" for path-valued flags; `multiple`: repeatable."""
    meta = {"help": help, "cli": cli, "short": short, "choices": choices, "kind": kind,
            "multiple": multiple, "is_flag": is_flag, "path": path}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class CompileOptions:
    force: bool = flag(False, "Replace an existing llmc artifact at the output path.", is_flag=True)
    passes: str | None = flag(None, "Comma list of passes replacing the target's pipeline (name:key=val), "
                                    "run in the order given.")
    disable: list[str] = flag([], "Drop a pass from the pipeline (repeatable).", cli="--disable-pass",
                              multiple=True)
    add: list[str] = flag([], "Add a registered pass (name:key=val) to the pipeline, placed by its stage "
                              "(repeatable; see `llmc passes`).", cli="--add-pass", multiple=True)
    pass_options: dict[str, dict] = flag({}, "pass.key=value (repeatable).", cli="--pass-option", multiple=True)
    print_ir_after: set[str] = flag(set(), "Print the IR after this pass ('all' for every pass).", multiple=True)
    dump_ir: str | None = flag(None, "Write the IR before/after each pass here.", path="dir")
    report: str | None = flag(None, "Write the compile report (stage and pass timings) to this JSON file; "
                                    "the artifact itself holds no timings.", path="file")
    max_num_batched_tokens: int = flag(2048, "Largest token batch the plan is sized for.", kind=int)
    quant: str | None = flag(None, "Quantise the linears' weights (default: the target's recipe, whatever the "
                                   "source; the cpu targets keep a GGUF file's own blocks; gguf: keep them on "
                                   "any target; none: float weights).",
                             choices=QUANT_CHOICES)
    group_size: int | None = flag(None, "int4 group size along K (default 128).", kind=int)
    kv_cache: str | None = flag(None, "Quantise the KV cache (int8, fp8: a calibrated scale per KV head; "
                                      "int4: a scale per token and 32 channels, CPU targets; none: keep it "
                                      "unquantised where the target would quantise it).",
                                choices=KV_CACHE_CHOICES + ("none",))
    kv_heads: int | None = flag(None, "Mean-pool the KV heads down to N (dividing the model's KV heads; "
                                      "1 = MQA).", kind=int)
    kv_grouping: str | None = flag(None, "Which KV heads --kv-heads pools: by index, by similarity on "
                                         "calibration text, or auto (both scored, the better kept; default).",
                                   choices=KV_GROUPING_CHOICES)
    kv_policy: str | None = flag(None, "Hold each sequence's KV cache to --kv-budget tokens per KV head (cpu targets): "
                                       "h2o keeps the sinks, the recent tokens and those with the most accumulated "
                                       "attention; streaming keeps the sinks and the newest; none: the full cache. "
                                       "Recorded in the plan; `llmc.load(..., kv_policy=...)` overrides it.",
                                 choices=("h2o", "streaming", "none"))
    kv_budget: int | None = flag(None, "KV entries a sequence keeps per layer and KV head under --kv-policy.", kind=int)
    kv_recent: int | None = flag(None, "h2o: the newest tokens never evicted (default: half of what the sinks "
                                       "leave of the budget).", kind=int)
    kv_sinks: int | None = flag(None, "--kv-policy: the first tokens never evicted (default 4).", kind=int)
    draft_of: str | None = flag(None, "Make a speculative-decoding draft of this target artifact (same "
                                      "tokenizer): layers pruned, int4 weights.", path="any")
    draft_layers: int | None = flag(None, "Layers the draft keeps (default: half).", kind=int)
    prune: str | None = flag(None, "Structured pruning, e.g. heads:0.25,ffn:0.3,layers:4 (fractions of heads "
                                   "and MLP channels per layer, a number of layers); runs first.")
    sparsity: str | float | None = flag(None, "Zero weights of the linears: a fraction (0.5) or 2:4; "
                                              "stored densely.", kind=str)
    sparsity_method: str | None = flag(None, "How --sparsity scores weights (default wanda: |W|·‖X‖ on "
                                             "calibration text).", choices=SPARSITY_METHODS)
    calib: str | None = flag(None, "Calibration text for lossy passes (default: text the model generates "
                                   "itself).", path="file")
    calib_samples: int = flag(8, "Calibration sequences.", kind=int)
    calib_seq_len: int = flag(128, "Tokens per calibration sequence.", kind=int)
    calib_seed: int = flag(0, "Seed of the self-generated calibration text.", kind=int)
    max_ppl_increase: float | None = flag(None, "Accuracy budget: fail if a lossy pass raises calibration "
                                                "perplexity by more than PCT%.", kind=float)
    tp: int = flag(1, "Tensor-parallel ranks: split attention heads, MLP channels and the LM head's vocabulary "
                      "over N ranks, one plan and weights file each (llmc run starts them).", kind=int)
    pp: int = flag(1, "Pipeline-parallel stages: split the decoder layers over N ranks (balanced by estimated "
                      "cost), hidden states sent stage to stage, one plan and weights file each.", kind=int)
    pp_split: str | None = flag(None, "Layers per pipeline stage, e.g. 15,15 (overrides the balanced split).",
                                kind=str)
    autotune: bool = flag(False, "GPU targets: time each Triton kernel family's candidate configs (needs a "
                                 "CUDA GPU).", is_flag=True)
    kernels: str | None = flag(None, "cpu target's kernel family: cpu (torch), ort (ONNX Runtime sessions over the "
                                     "plan's runs of non-attention ops), auto (time both here at the plan's shapes, "
                                     "keep the faster per segment, and the decode graph where it wins; recorded in "
                                     "the plan). Default: auto.",
                               choices=KERNEL_MODES)
    batch_invariant: str = flag("on", "cpu target: on (the default) runs every kernel so that a sequence's logits "
                                      "are the same bits whatever else is batched with it and however many rows it "
                                      "brings (speculative verification, prefill chunks); off allows the faster "
                                      "kernels whose rounding depends on the row count. `llmc.load(..., "
                                      "batch_invariant=False)` chooses at load.", choices=("on", "off"))
    q4_activations: str = flag("int8", "cpu target: how the native 4-bit GEMVs round their activations: int8 (the "
                                       "default) codes per block of 32, llama.cpp's Q8 rounding (2^-8 of a block's "
                                       "largest value), ~1.3x the decode rate over weights in DRAM and ~1.6x the "
                                       "prefill; int16 codes per block of 64 (2^-16). `llmc.load(..., "
                                       "q4_activations=...)` chooses at load.", choices=Q4_ACTIVATIONS)
    quiet: bool = flag(False, "No progress or notes on stderr.", short="-q", is_flag=True)

    def __post_init__(self):
        if isinstance(self.batch_invariant, bool):   # llmc.compile(batch_invariant=False)
            self.batch_invariant = "on" if self.batch_invariant else "off"
        if self.batch_invariant not in ("on", "off"):
            raise PassError(f"--batch-invariant {self.batch_invariant!r} must be on or off")
        if self.q4_activations not in Q4_ACTIVATIONS:
            raise PassError(f"--q4-activations {self.q4_activations!r} must be one of {', '.join(Q4_ACTIVATIONS)}")
        self.disable, self.add = list(self.disable), list(self.add)
        self.print_ir_after = set(self.print_ir_after)
        self.pass_options = dict(self.pass_options)
        for name in ("max_num_batched_tokens", "calib_samples", "calib_seq_len", "tp", "pp"):
            check_positive_int(name, getattr(self, name))
        for name in ("group_size", "kv_heads", "draft_layers", "calib_seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise PassError(f"{cli_name(name)} {value!r} is not a whole number")
        if self.calib is not None:
            check_calib_path(self.calib)
        kv_policy(self.kv_policy, self.kv_budget, self.kv_recent, self.kv_sinks)   # refuses bad values by flag
        if self.max_ppl_increase is not None and not (isinstance(self.max_ppl_increase, (int, float))
                                                      and math.isfinite(self.max_ppl_increase)
                                                      and self.max_ppl_increase >= 0):
            raise PassError(f"--max-ppl-increase {self.max_ppl_increase!r} must be a percentage >= 0")

    @classmethod
    def build(cls, **options) -> CompileOptions:
        """From keyword arguments, refusing unknown ones by name."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise PassError(f"unknown compile option {unknown[0]!r}; valid options: {', '.join(names)}")
        return cls(**options)


def check_calib_path(path) -> None:
    """Refuse a --calib that is a device before any model loads (/dev/zero would be read to the input
    cap only after loading and tracing); a FIFO is text to come, read later within the cap."""
    kind = file_kind(Path(path))
    if kind in ("a device", "a directory", "a socket"):
        raise PassError(f"calibration file '{path}' is {kind}, not a text file; pass a plain text file to --calib")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PassError(f"{cli_name(name)} {value!r} must be a whole number >= 1")


def cli_name(name: str) -> str:
    """The flag of option `name`."""
    f = {f.name: f for f in dataclasses.fields(CompileOptions)}[name]
    return f.metadata.get("cli") or "--" + name.replace("_", "-")


def option_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(CompileOptions))


__all__ = ["CompileOptions", "option_fields", "cli_name"]
