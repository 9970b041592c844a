"""Knowledge distillation (`llmc distill STUDENT --teacher TEACHER --text FILE -o OUT`): train a
student artifact's weights, on the CPU with torch, so that its next-token distribution matches a
teacher artifact's (KL(teacher || student) on the logits, temperature-scaled as Hinton et al. 2015;
with --hidden-weight, also the hidden states of mapped layers, distill_hidden.py) over the user's
text, and write the result as a normal artifact.

How the student is trained. Its own graph runs through each op's reference semantics
(distill_student.py), with the float weights as leaf tensors: what is trained is what the artifact
serves, in the shapes only the artifact has (fused QKV, pruned heads and channels, the KV heads of a
GQA conversion, a draft's kept layers), under the names its graph and plan read. So the trained
weights drop back into the student's graph and plan unchanged (a plan depends on shapes, not
values; ONNX segments take their weights from the weights file), and the artifact is written by the
compile's writer (staged, hashed, byte-deterministic), read back with every hash checked, and its
held-out KL measured through its own kernels. Rebuilding the Hugging Face module from the recorded
config instead would train a model of another shape than the artifact's, and fit none that pruning
changed. The teacher runs its plan (its fastest kernels) without gradients.

All parameters, not low-rank adapters. Full-parameter AdamW on a 135M-parameter student in fp32
holds about 2 GB (weights, gradients, two moments), which a CPU has; adapters would save the
moments but not the compute (the backward pass still runs through every frozen weight), and the
damage a GQA conversion or pruning does is spread over every layer's projections and norms, which a
rank-r update of a few matrices reaches only in part, while a 30-minute budget wants every step to
count. Adapters would also be merged before writing, so the artifact is the same either way.

Quantised students are refused (distill_student.refuse_untrainable): integer codes take no gradient,
and re-quantising a trained float copy would need the recipe's float source and calibration
(GPTQ, AWQ) or a GGUF's block format again; compile the student with --quant none, distil it.

Resuming: a checkpoint (distill_checkpoint.py, default OUTPUT.ckpt) is written every
--checkpoint-every steps and when the run is interrupted (Ctrl-C, SIGTERM) between steps; the same
command resumes from it and, since the batches and learning rate are functions of the step alone,
reaches the weights an uninterrupted run reaches. It is removed once the artifact is written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import llmc
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import (
    KERNEL_INDEX,
    MANIFEST,
    Artifact,
    RankFiles,
    check_output,
    load_tokenizer,
    read_artifact,
    sha256_file,
    staged_output,
    write_contents,
)
from llmc.compiler.bounded_input import read_input
from llmc.compiler.driver.distill_checkpoint import (
    default_checkpoint,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from llmc.compiler.driver.distill_hidden import HiddenMatch, hidden_match
from llmc.compiler.driver.distill_options import DistillError, DistillOptions
from llmc.compiler.driver.distill_student import StudentGraph
from llmc.compiler.ir import Graph
from llmc.compiler.progress import Stages, bar, echo_stderr, on_terminal
from llmc.compiler.scoring import row_kl
from llmc.compiler.tokenizer_files import vocab_difference
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.threads import apply_threads, resolve_threads

HELD_OUT_WINDOWS = 8          # at most; the last windows of the text, never trained on
GRAD_CLIP = 1.0


class PlanLogits:
    """An artifact's plan run without gradients on whole windows (no KV cache): float32 logits of
    every position, on the CPU."""

    def __init__(self, art: Artifact, weights: dict[str, torch.Tensor] | None = None):
        self.plan = verified_plan(art)
        self.executor = PlanExecutor(self.plan, art.weights if weights is None else weights, "cpu", data=art.data)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(ids), dtype=torch.long)
        if "logits_indices" not in self.plan.inputs:
            return self.executor.run(ids, rows).float()
        return self.executor.run_values({"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"].float()


@dataclasses.dataclass
class Windows:
    """The text cut into consecutive windows of seq_len tokens: the last few held out (never
    trained on) to measure KL before and after, the rest drawn from in training."""
    train: list[torch.Tensor]
    held_out: list[torch.Tensor]
    tokens: int

    def batch(self, step: int, size: int, seed: int) -> list[torch.Tensor]:
        """Step `step`'s windows: a fresh permutation of the training windows per epoch, so the
        batches are a function of the step (a resumed run draws what the uninterrupted one draws)."""
        picks = []
        for i in range(step * size, (step + 1) * size):
            epoch, k = divmod(i, len(self.train))
            order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            picks.append(self.train[int(order[k])])
        return picks


def text_windows(tokenizer, data: bytes, where: str, seq_len: int) -> Windows:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DistillError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}); "
                           f"pass a plain text file") from None
    if "\0" in text:
        raise DistillError(f"{where} holds a NUL byte: it looks binary; pass a plain text file")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    count = len(ids) // seq_len
    if count < 2:
        raise DistillError(f"{where} has {len(ids)} tokens, fewer than two windows of --seq-len {seq_len} (one "
                           f"to train on, one held out to measure); give a longer text or a smaller --seq-len")
    windows = [torch.tensor(ids[i * seq_len:(i + 1) * seq_len], dtype=torch.long) for i in range(count)]
    held = min(HELD_OUT_WINDOWS, max(1, count // 10))
    return Windows(windows[:-held], windows[-held:], len(ids))


def read_text(path: str | Path) -> bytes:
    try:
        return read_input(Path(path), f"text '{path}'", DistillError)
    except FileNotFoundError:
        raise DistillError(f"text '{path}' not found; pass a text file to --text") from None
    except IsADirectoryError:
        raise DistillError(f"text '{path}' is a directory; pass a text file to --text") from None
    except OSError as e:
        raise DistillError(f"text '{path}' cannot be read ({e.strerror}); pass a readable text file") from None


def read_checked(path: str | Path, role: str) -> Artifact:
    """The artifact at `path`, every hash checked; a missing path is named with its role."""
    if not Path(path).is_dir():
        raise DistillError(f"{role} '{path}' is not an artifact directory; compile one with `llmc compile`")
    return read_artifact(path)


def check_same_tokenizer(student: Artifact, teacher: Artifact, student_tok, teacher_tok) -> None:
    """Refuse a student whose vocabulary differs from the teacher's: the loss compares the two
    distributions token id by token id."""
    ours, theirs = student_tok.get_vocab(), teacher_tok.get_vocab()
    rows = (student.manifest["model"]["vocab_size"], teacher.manifest["model"]["vocab_size"])
    if ours != theirs or rows[0] != rows[1]:
        why = vocab_difference(ours, theirs, "student", "teacher") if ours != theirs \
            else f"{rows[0]} logits against {rows[1]}"
        raise DistillError(f"student '{student.path}' and teacher '{teacher.path}' have different tokenizers "
                           f"({why}); a student must share its teacher's tokenizer and vocabulary")


def check_seq_len(art: Artifact, plan: Plan, seq_len: int, role: str) -> None:
    positions = art.manifest["model"]["max_position_embeddings"]
    if seq_len > min(positions, plan.max_tokens):
        raise DistillError(f"--seq-len {seq_len} exceeds what {role} '{art.path}' takes ({positions} positions, "
                           f"{plan.max_tokens} tokens a step); give --seq-len {min(positions, plan.max_tokens)} "
                           f"or less")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) at `temperature`, times T^2 (so the gradient's
    scale does not shrink with T)."""
    t = temperature
    teacher_logp = F.log_softmax(teacher_logits / t, dim=-1)
    student_logp = F.log_softmax(student_logits / t, dim=-1)
    kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="none").sum(-1)
    return kl.mean() * t * t


def learning_rate(step: int, options: DistillOptions) -> float:
    """Linear warm-up over the first tenth (at most 20 steps), then cosine decay to a tenth of --lr."""
    warmup = min(20, max(1, options.steps // 10))
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_kl(logits_of: Callable[[torch.Tensor], torch.Tensor], teacher_of: Callable[[torch.Tensor], torch.Tensor],
                windows: list[torch.Tensor]) -> float:
    """Mean KL(teacher || model) at temperature 1 over every held-out position, float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            total += row_kl(teacher_of(ids), logits_of(ids)).sum().item()
            count += len(ids)
    return total / count


@dataclasses.dataclass
class Run:
    """One distillation's inputs, read and checked before any training."""
    student: Artifact
    teacher: Artifact
    graph: StudentGraph
    teacher_logits: PlanLogits
    windows: Windows
    text_sha256: str
    key: dict
    hidden: HiddenMatch | None = None      # with --hidden-weight


def prepare(student_path, teacher_path, text_path, options: DistillOptions) -> Run:
    data = read_text(text_path)
    student, teacher = read_checked(student_path, "student"), read_checked(teacher_path, "teacher")
    graph = StudentGraph(student)
    student_tok = load_tokenizer(student)
    check_same_tokenizer(student, teacher, student_tok, load_tokenizer(teacher))
    teacher_logits = PlanLogits(teacher)
    check_seq_len(teacher, teacher_logits.plan, options.seq_len, "teacher")
    check_seq_len(student, verified_plan(student), options.seq_len, "student")
    windows = text_windows(student_tok, data, f"text '{text_path}'", options.seq_len)
    text_sha = hashlib.sha256(data).hexdigest()
    key = {"student": sha256_file(student.path / MANIFEST), "teacher": sha256_file(teacher.path / MANIFEST),
           "text_sha256": text_sha, **options.run_key()}
    hidden = hidden_match(student, graph, teacher, options.hidden_loss, options.hidden_weight) \
        if options.hidden_weight > 0 else None
    return Run(student, teacher, graph, teacher_logits, windows, text_sha, key, hidden)


def train(run: Run, options: DistillOptions, checkpoint: Path, say: Callable[[str], None]) -> tuple[int, list[float]]:
    """Train the student's masters up to options.steps steps, from the checkpoint's step (or 0);
    returns (the step it started from, the mean loss of every step)."""
    graph = run.graph
    optimizer = torch.optim.AdamW(graph.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, history = load_checkpoint(checkpoint, run.key, graph.masters, optimizer) or (0, [])
    if start:
        say(f"llmc: resuming at step {start} of {options.steps} from checkpoint '{checkpoint}'")
    progress = bar(options.steps, "distill", unit="step", quiet=options.quiet, initial=start)
    updating = False   # an interrupt inside optimizer.step() leaves the masters half-updated: not saved
    saved = start
    try:
        for step in range(start, options.steps):
            loss = accumulate_gradients(run, step, options)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, options)
            updating = True
            optimizer.step()
            history.append(loss)
            updating = False
            progress.update(1)
            progress.set_postfix(kl=f"{loss:.4f}")
            if (step + 1) % options.checkpoint_every == 0 and step + 1 < options.steps:
                save_checkpoint(checkpoint, run.key, step + 1, graph.masters, optimizer, history)
                saved = step + 1
                if not options.quiet and not on_terminal():
                    say(f"llmc: step {step + 1}/{options.steps}: loss {recent(history):.4f}; "
                        f"checkpoint '{checkpoint}'")
    except (KeyboardInterrupt, SystemExit):
        if not updating and len(history) > saved:
            save_checkpoint(checkpoint, run.key, len(history), graph.masters, optimizer, history)
            say(f"llmc: interrupted after step {len(history)} of {options.steps}; the same command resumes "
                f"from checkpoint '{checkpoint}'")
        raise
    finally:
        progress.close()
    return start, history


def accumulate_gradients(run: Run, step: int, options: DistillOptions) -> float:
    """Gradients of step `step`'s batch (the mean of its windows' losses) on the masters, clipped;
    returns the batch's mean loss."""
    params = run.graph.parameters()
    for p in params:
        p.grad = None
    total = 0.0
    for ids in run.windows.batch(step, options.batch, options.seed):
        loss = window_loss(run, ids, options) / options.batch
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
    return total


def window_loss(run: Run, ids: torch.Tensor, options: DistillOptions) -> torch.Tensor:
    """One window's loss: the KL on the logits, plus --hidden-weight times the hidden-state loss."""
    if run.hidden is None:
        with torch.no_grad():
            target = run.teacher_logits(ids)
        return distill_loss(run.graph.logits(ids), target, options.temperature)
    target, target_hidden = run.hidden.teacher(ids)
    logits, hidden = run.graph.forward(ids, run.hidden.student_values)
    matched = run.hidden.loss(hidden, target_hidden)
    return distill_loss(logits, target, options.temperature) + run.hidden.weight * matched


def recent(history: list[float], n: int = 10) -> float:
    tail = history[-n:]
    return sum(tail) / len(tail)


def write_distilled(run: Run, output: Path, options: DistillOptions, history: list[float], kl_before: float,
                    hidden_before: float | None) -> float:
    """Measure the trained weights' held-out KL through the student's own plan, write them through the
    compile's writer (staged, hashed), and read the result back with every hash checked and its graph
    verified before it is moved into place; returns the KL."""
    student = run.student
    weights = run.graph.trained_weights()
    kl_after = held_out_kl(PlanLogits(student, weights), run.teacher_logits, run.windows.held_out)
    manifest = {k: v for k, v in student.manifest.items() if k not in ("files", "format_version", "weight_aliases")}
    manifest.update(llmc_version=llmc.__version__, torch_version=torch.__version__.split("+")[0],
                    distilled=distilled_record(run, options, history, kl_before, kl_after, hidden_before))
    index = student.path / KERNEL_INDEX
    with staged_output(output, options.force) as staging:
        write_contents(staging, [RankFiles(student.graph_json, student.plan_json, weights)], load_tokenizer(student),
                       manifest, student.kernels, json.loads(index.read_text()) if index.is_file() else None,
                       student.data)
        Graph.from_json(read_artifact(staging).graph_json).verify(for_runtime=True)
    return kl_after


def distilled_record(run: Run, options: DistillOptions, history: list[float], kl_before: float,
                     kl_after: float | None, hidden_before: float | None = None) -> dict:
    """The manifest's `distilled` section: from which teacher, on which text, how, and the held-out
    KL(teacher || student) before and after (None until measured on the written artifact); with
    --hidden-weight, the layer map and the held-out hidden-state loss before and after."""
    teacher = run.teacher.manifest["model"]
    hidden = None if run.hidden is None else \
        {**run.hidden.record(), "before": hidden_before, "after": run.hidden.held_out(run.graph, run.windows.held_out)}
    return {"teacher": {"model": teacher["name"], "manifest_sha256": run.key["teacher"],
                        "num_layers": teacher["num_layers"], "num_kv_heads": teacher["num_kv_heads"]},
            "student_manifest_sha256": run.key["student"], "text_sha256": run.text_sha256,
            "text_tokens": run.windows.tokens, "held_out_tokens": sum(len(w) for w in run.windows.held_out),
            **options.run_key(), "trained": "all float weights", "parameters": run.graph.parameter_count(),
            "final_loss": round(recent(history), 6) if history else None,
            "kl_before": kl_before, "kl_after": kl_after, "hidden": hidden}


def distill_artifact(student: str | Path, teacher: str | Path, text: str | Path, output: str | Path,
                     options: DistillOptions | None = None, echo: Callable[[str], None] | None = None) -> Path:
    """Distil `teacher` into `student` on the text file `text` and write the artifact `output`
    (see the module's docstring). Everything is checked before training; the output appears only
    once written and verified."""
    options = options or DistillOptions()
    echo = echo or echo_stderr
    output = Path(output)
    check_output(output, options.force)
    checkpoint = Path(options.checkpoint) if options.checkpoint is not None else default_checkpoint(output)
    apply_threads(resolve_threads(options.threads))
    say = (lambda _: None) if options.quiet else echo
    began = time.perf_counter()
    with Stages(echo, options.quiet) as stages:
        stages.start(f"reading student '{student}', teacher '{teacher}' and text '{text}'")
        run = prepare(student, teacher, text, options)
        stages.start(f"measuring KL on {len(run.windows.held_out)} held-out windows")
        kl_before = held_out_kl(PlanLogits(run.student), run.teacher_logits, run.windows.held_out)
        hidden_before = None if run.hidden is None else run.hidden.held_out(run.graph, run.windows.held_out)
        stages.start(f"training {run.graph.parameter_count():,} weights for {options.steps} steps of "
                     f"{options.batch} x {options.seq_len} tokens")
        trained = time.perf_counter()
        start, history = train(run, options, checkpoint, say)
        trained = time.perf_counter() - trained
        stages.start(f"writing the artifact '{output}'")
        kl_after = write_distilled(run, output, options, history, kl_before, hidden_before)
    remove_checkpoint(checkpoint)
    resumed = f", resumed at step {start}" if start else ""
    say(f"llmc: distilled '{student}' from '{teacher}' into '{output}' in {time.perf_counter() - began:.1f} s "
        f"({options.steps - start} steps in {trained:.1f} s{resumed}): held-out KL(teacher || student) "
        f"{kl_before:.4f} -> {kl_after:.4f}{hidden_change(output)}")
    return output


def hidden_change(output: Path) -> str:
    hidden = json.loads((output / MANIFEST).read_text())["distilled"]["hidden"]
    if hidden is None:
        return ""
    return f", hidden-state loss ({hidden['loss']}) {hidden['before']:.4f} -> {hidden['after']:.4f}"


__all__ = ["DistillOptions", "DistillError", "distill_artifact", "distill_loss", "learning_rate", "Windows"]
