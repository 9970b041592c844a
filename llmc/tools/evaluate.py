"""`llmc eval`: an artifact's perplexity on a text by one fixed protocol, and, against a
reference artifact, the KL divergence and top-1 agreement of its next-token distributions.

Protocol: tokenise the text without special tokens and keep the first `max_tokens` tokens; slide
windows of CONTEXT tokens by STRIDE (positions restart at 0 in each window); the first window
scores all its tokens, each later window only its last STRIDE, so every token after the first is
scored exactly once and, past the first window, with at least CONTEXT - STRIDE tokens of context
(as in Hugging Face's "Perplexity of fixed-length models" guide). Perplexity = exp(mean NLL).

With a KV policy (`kv_policy`, runtime/kv_policy.py) the artifact is scored through the engine instead: each
window is one prompt, prefilled chunk by chunk with the policy's evictions at the positions a decode of it
token by token would make them, and the logits of every row read out (PolicyScorer); the reference, if any,
keeps the full cache."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.compiler.artifact import load_tokenizer, read_artifact
from llmc.compiler.bounded_input import read_input
from llmc.compiler.scoring import row_agreement, row_kl, token_nll
from llmc.errors import RuntimeLlmcError
from llmc.runtime.device import resolve_device
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.sequence import Sequence

CONTEXT = 512
STRIDE = 256
# From a source checkout; an installed llmc has no samples/ and needs --text.
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "samples" / "eval.txt"   # the source tree's samples/


@dataclass(frozen=True)
class Window:
    begin: int          # first token fed to the model
    end: int            # one past the last token fed
    first_target: int   # first token this window scores; it scores first_target..end-1

    def rows(self) -> torch.Tensor:
        """The logits rows (window-relative) that predict the scored tokens."""
        return torch.arange(self.first_target - 1 - self.begin, self.end - 1 - self.begin)


def eval_windows(num_tokens: int, context: int = CONTEXT, stride: int = STRIDE) -> list[Window]:
    """Windows covering tokens 1..num_tokens-1 once each: [0, context), then every `stride`."""
    windows, scored_to = [], 1  # token 0 has no prediction
    for begin in range(0, max(num_tokens - 1, 0), stride):
        end = min(begin + context, num_tokens)
        windows.append(Window(begin, end, scored_to))
        scored_to = end
        if end == num_tokens:
            break
    return windows


class ArtifactScorer:
    """An artifact's plan run on whole windows with no KV cache: logits of chosen rows. `device`
    as llmc.load's."""

    def __init__(self, path: str | Path, device: str | None = None):
        self.path = Path(path)
        art = read_artifact(self.path)
        device = resolve_device(art.manifest, device, self.path)
        self.model = art.manifest["model"]
        self.tokenizer = load_tokenizer(art)
        self.plan = verified_plan(art)
        self.executor = PlanExecutor(self.plan, art.weights, device, data=art.data)

    def check_context(self, context: int) -> None:
        max_positions = self.model.get("max_position_embeddings", context)
        if self.plan.max_tokens < context or max_positions < context:
            raise RuntimeLlmcError(
                f"artifact '{self.path}' cannot take the {context}-token evaluation windows: its plan "
                f"holds {self.plan.max_tokens} batched tokens and the model {max_positions} positions; "
                f"recompile with --max-num-batched-tokens {context} or more")

    def logits(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [t] at positions 0..t-1 -> float32 logits [len(rows), vocab] on the CPU."""
        positions = torch.arange(len(ids), dtype=torch.long)
        # no backend: the executor's one-shot attention for its kernel family
        if "logits_indices" not in self.plan.inputs:  # plans whose LM head could not be split
            return self.executor.run(ids, positions)[rows.to(self.executor.device)].float().cpu()
        inputs = {"input_ids": ids, "positions": positions, "logits_indices": rows}
        return self.executor.run_values(inputs)["logits"].float().cpu()


class PolicyScorer:
    """An artifact run by the engine with a KV policy (`policy`: the engine's kv_policy options): logits of
    chosen rows of a window fed as one prompt, each chunk ending where the policy must evict."""

    def __init__(self, path: str | Path, device: str | None, policy: dict, kv_memory: str = "512MiB"):
        self.path = Path(path)
        self.engine = Engine(self.path, EngineConfig(kv_memory=kv_memory, device=device, max_num_seqs=1, **policy))
        assert self.engine.kv_policy is not None, "scorer() makes a PolicyScorer only where a policy applies"
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer

    def check_context(self, context: int) -> None:
        if self.model.get("max_position_embeddings", context) < context:
            raise RuntimeLlmcError(f"artifact '{self.path}' holds {self.model['max_position_embeddings']} positions, "
                                   f"fewer than the {context}-token windows; give a smaller --context")

    def logits(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [t] at positions 0..t-1 -> float32 logits [len(rows), vocab] on the CPU."""
        engine = self.engine
        scheduler = engine.scheduler
        seq = Sequence(ids.tolist())
        seq.kv_cap, seq.uses_prefix_cache = engine.kv_policy.budget, False   # as Engine.add_request makes it
        scheduler.add(seq)
        parts = []
        while seq.num_computed_tokens < len(ids):
            out = scheduler.schedule()
            n = sum(count for s, count in out.scheduled if s is seq)
            parts.append(engine.runner.execute(out.scheduled, [], out.blocks_to_copy, prompt_rows={seq.seq_id: n},
                                               evictions=out.evictions).float().cpu())
            scheduler.update_computed(out.scheduled)
        scheduler.finish(seq, "stop")
        return torch.cat(parts)[rows]


@dataclass
class Totals:
    """Sums over scored tokens, float64."""
    tokens: int = 0
    nll: float = 0.0
    ref_nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0


def evaluate_text(path: str | Path, text: str, ref: str | Path | None = None, max_tokens: int = 4096,
                  progress: bool = False, device: str | None = None, context: int = CONTEXT,
                  stride: int = STRIDE, kv_policy: dict | None = None) -> dict:
    """{"perplexity", "tokens" (scored), "windows", "context", "stride"}; with `ref` also
    "ref_perplexity", "kl" (mean KL(ref || ours)) and "top1_agreement". `device` applies to both; `kv_policy`
    (the engine's kv_policy options) to the artifact only."""
    if not 1 <= stride < context:   # a later window's first scored token is predicted by the row before it
        raise RuntimeLlmcError(f"--stride {stride} must be at least 1 and below --context {context}")
    model = make_scorer(path, device, kv_policy)
    reference = ArtifactScorer(ref, device) if ref is not None else None
    ids = text_tokens(model.tokenizer, text, max_tokens)
    windows = eval_windows(len(ids), context, stride)
    longest = max(w.end - w.begin for w in windows)
    for one in (model, reference):
        if one is not None:
            one.check_context(longest)
    if reference is not None:
        check_same_vocab(model, reference)
    totals = Totals()
    bar = tqdm(windows, desc="eval", unit="window", leave=False, file=sys.stderr,
               disable=not progress or not sys.stderr.isatty())
    for window in bar:
        score_window(model, reference, ids, window, totals)
    result = summary(totals, len(windows), reference is not None)
    result.update(context=context, stride=stride)
    if isinstance(model, PolicyScorer):
        result["kv_policy"] = model.engine.kv_policy.as_meta()
    return result


def make_scorer(path: str | Path, device: str | None, kv_policy: dict | None) -> ArtifactScorer | PolicyScorer:
    """The artifact's scorer: through the engine where a KV policy applies (asked, or else the artifact's own,
    never ignored), else its plan on whole windows. kv_policy "none" asks for the full cache."""
    if kv_policy is not None and kv_policy.get("kv_policy") != "none":
        return PolicyScorer(path, device, kv_policy)
    plain = ArtifactScorer(path, device)
    if kv_policy is None and "kv_policy" in plain.plan.meta:
        return PolicyScorer(path, device, {})
    return plain


def text_tokens(tokenizer, text: str, max_tokens: int) -> torch.Tensor:
    if max_tokens < 2:
        raise RuntimeLlmcError(f"--max-tokens is {max_tokens}; perplexity needs at least 2 tokens")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise RuntimeLlmcError(f"the evaluation text has {len(ids)} token(s); give a text of at least 2")
    return torch.tensor(ids, dtype=torch.long)


def check_same_vocab(model: ArtifactScorer, reference: ArtifactScorer) -> None:
    ours, theirs = model.model.get("vocab_size"), reference.model.get("vocab_size")
    if ours != theirs:
        raise RuntimeLlmcError(f"reference '{reference.path}' has vocabulary size {theirs}, artifact "
                               f"'{model.path}' has {ours}; compare artifacts of the same model")


def score_window(model: ArtifactScorer, reference: ArtifactScorer | None, ids: torch.Tensor,
                 window: Window, totals: Totals) -> None:
    window_ids, rows = ids[window.begin:window.end], window.rows()
    targets = ids[window.first_target:window.end]
    logits = model.logits(window_ids, rows)
    totals.tokens += len(targets)
    totals.nll += token_nll(logits, targets).sum().item()
    if reference is not None:
        ref_logits = reference.logits(window_ids, rows)
        totals.ref_nll += token_nll(ref_logits, targets).sum().item()
        totals.kl += row_kl(ref_logits, logits).sum().item()
        totals.agree += row_agreement(ref_logits, logits).sum().item()


def summary(totals: Totals, num_windows: int, with_reference: bool) -> dict:
    n = totals.tokens
    out = {"perplexity": math.exp(totals.nll / n), "tokens": n, "windows": num_windows,
           "context": CONTEXT, "stride": STRIDE}
    if with_reference:
        out.update(ref_perplexity=math.exp(totals.ref_nll / n), kl=totals.kl / n,
                   top1_agreement=totals.agree / n)
    return out


def read_eval_text(path: str | Path | None) -> str:
    """The text at `path`, or the shipped samples/eval.txt when `path` is None."""
    file = Path(path) if path is not None else DEFAULT_TEXT
    try:
        text = read_input(file, f"evaluation text '{file}'", RuntimeLlmcError).decode("utf-8")
    except FileNotFoundError:
        hint = "" if path is not None else " (the default, shipped in a source checkout)"
        raise RuntimeLlmcError(f"evaluation text '{file}'{hint} not found; pass --text FILE") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RuntimeLlmcError(f"evaluation text '{file}' cannot be read as UTF-8 text ({e}); "
                               f"pass a plain text file to --text") from None
    if "\0" in text:
        raise RuntimeLlmcError(f"evaluation text '{file}' holds a NUL byte at character {text.index(chr(0))}: "
                               "it looks binary; pass a plain text file to --text")
    return text


def format_summary(result: dict, artifact: str, text_name: str, ref: str | None) -> str:
    lines = [f"{artifact}: perplexity {result['perplexity']:.4f} over {result['tokens']} tokens of "
             f"{text_name} ({result['windows']} windows of {result['context']}, stride {result['stride']})"]
    if result.get("kv_policy"):
        p = result["kv_policy"]
        lines.append(f"KV policy {p['kind']}: budget {p['budget']}, sinks {p['sinks']}, recent {p['recent']}")
    if ref is not None:
        lines.append(f"reference {ref}: perplexity {result['ref_perplexity']:.4f}; "
                     f"KL(ref || ours) {result['kl']:.5f}; top-1 agreement {result['top1_agreement']:.2%}")
    return "\n".join(lines)


__all__ = ["evaluate_text", "eval_windows", "Window", "ArtifactScorer", "read_eval_text",
           "format_summary", "CONTEXT", "STRIDE", "DEFAULT_TEXT"]
