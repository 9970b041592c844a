"""The options of a distillation, defined once: `llmc distill`'s flags are made from these fields
(llmc/cli_distill.py) and `llmc.distill(**options)` takes them by name. Each is checked when the
options are made, and a bad one is refused in one line naming its flag."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from llmc.errors import LlmcError

HIDDEN_LOSSES = ("cosine", "mse")


class DistillError(LlmcError):
    """A distillation that cannot run as asked (its artifacts, text or options)."""


def option(default: Any, help: str, kind: type | None = None, is_flag: bool = False) -> Any:
    """A distill option; `kind`: the type its flag parses (None: text)."""
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind, "is_flag": is_flag})


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    steps: int = option(200, "Optimiser steps to train.", int)
    lr: float = option(1e-4, "Peak learning rate (AdamW; linear warm-up over a tenth of the steps, at most "
                             "20, then cosine decay to a tenth).", float)
    seq_len: int = option(256, "Tokens per training window.", int)
    batch: int = option(4, "Windows per step.", int)
    temperature: float = option(1.0, "Temperature of both distributions in the KL loss (scaled by T^2).", float)
    seed: int = option(0, "Seed of the order the training windows are drawn in.", int)
    hidden_weight: float = option(0.0, "Weight of a loss on the hidden states of mapped layers, added to the KL "
                                       "(0: logits only). Each student layer's output is matched to a teacher "
                                       "layer's: the one a draft or layer pruning kept next, else evenly spaced.",
                                  float)
    hidden_loss: str = option("cosine", "Hidden-state loss: cosine (1 - cosine similarity, as DistilBERT) or mse "
                                        "(of the RMS-normalised states, as TinyBERT).")
    checkpoint: str | Path | None = option(None, "Checkpoint directory (default: OUTPUT.ckpt beside the output); "
                                                 "an interrupted run resumes from it, a finished one removes it.")
    checkpoint_every: int = option(25, "Steps between checkpoints (an interrupt also saves one).", int)
    threads: int | str | None = option(None, "CPU threads (default: $LLMC_NUM_THREADS, else the physical cores).")
    force: bool = option(False, "Replace a previous artifact at the output.", is_flag=True)
    quiet: bool = option(False, "No progress: print only errors.", is_flag=True)

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch", "checkpoint_every"):
            least = 2 if name == "seq_len" else 1
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise DistillError(f"{flag_name(name)} is {value!r}; give a whole number of at least {least}")
        if isinstance(self.hidden_weight, bool) or not isinstance(self.hidden_weight, (int, float)) \
                or not 0 <= self.hidden_weight < math.inf:
            raise DistillError(f"--hidden-weight is {self.hidden_weight!r}; give a finite number of at least 0 "
                               f"(0: match the logits only)")
        if self.hidden_loss not in HIDDEN_LOSSES:
            raise DistillError(f"--hidden-loss is {self.hidden_loss!r}; give one of {', '.join(HIDDEN_LOSSES)}")
        for name in ("lr", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise DistillError(f"{flag_name(name)} is {value!r}; give a positive finite number")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise DistillError(f"--seed is {self.seed!r}; give a whole number from 0 to {2**32 - 1}")

    @classmethod
    def build(cls, **options) -> DistillOptions:
        """From keyword options, an unknown name refused in one line."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise DistillError(f"unknown distill option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return cls(**options)

    def run_key(self) -> dict:
        """What makes two runs the same run (a checkpoint resumes only its own)."""
        return {"steps": self.steps, "lr": self.lr, "seq_len": self.seq_len, "batch": self.batch,
                "temperature": self.temperature, "seed": self.seed, "hidden_weight": self.hidden_weight,
                "hidden_loss": self.hidden_loss}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def option_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(DistillOptions))


__all__ = ["DistillOptions", "DistillError", "option_fields", "flag_name"]
