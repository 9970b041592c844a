"""The Python API: `llmc.compile` an artifact, `llmc.load` it into an `LLM` whose
`generate`, `stream` and `chat` follow vLLM's offline API."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Iterator

from llmc.compiler.tokenizer_files import render_chat_template
from llmc.errors import RuntimeLlmcError


def compile(model: str, target: str = "cpu", output: str | Path | None = None, **options) -> Path:
    """Compile `model` (sample name, HF checkpoint dir, or .gguf file) for `target` into the
    artifact directory `output`. `options` are the compile options of `llmc compile`, by their
    Python names (compiler/options.py defines them once; `llmc compile --help` shows them all):
    e.g. quant="int4-awq", kv_cache="int8", prune="heads:0.25", passes="dce,fuse_qkv",
    pass_options={"quantize_int4": {"group_size": 64}}, force=True."""
    from llmc.compiler.options import CompileOptions  # torch (~1 s): llmc.api stays light
    from llmc.compiler.pipeline import compile_model  # the compile stack: ~3 s with transformers

    options.setdefault("quiet", True)
    output = output or f"{Path(str(model)).name.removesuffix('.gguf')}.llmc"
    return compile_model(model, target, output, CompileOptions.build(**options))


def distill(student: str | Path, teacher: str | Path, text: str | Path, output: str | Path | None = None,
            **options) -> Path:
    """Train the artifact `student` (float weights; pruned, GQA-converted or a draft) to match the
    artifact `teacher`'s next-token distribution on the text file `text`, with torch on the CPU, and
    write the result as the artifact `output` (as `llmc distill`; see compiler/driver/distill.py).
    `options` (compiler/driver/distill_options.py): steps, lr, seq_len, batch, temperature, seed,
    checkpoint, checkpoint_every, hidden_weight, hidden_loss (hidden-state matching), threads, force,
    quiet (default True)."""
    from llmc.compiler.driver.distill import distill_artifact  # the training stack: only distill
    from llmc.compiler.driver.distill_options import DistillOptions  # the same

    options.setdefault("quiet", True)
    output = output or f"{Path(str(student)).name.removesuffix('.llmc')}-distilled.llmc"
    return distill_artifact(student, teacher, text, output, DistillOptions.build(**options))


def evaluate(path: str | Path, text: str, ref: str | Path | None = None, max_tokens: int = 4096,
             progress: bool = False, device: str | None = None) -> dict:
    """Perplexity of the artifact at `path` on `text` (context 512, stride 256, first
    `max_tokens` tokens); with `ref`, also KL(ref || ours) and top-1 agreement against it."""
    from llmc.tools.evaluate import evaluate_text  # torch and the executor: only evaluate

    return evaluate_text(path, text, ref=ref, max_tokens=max_tokens, progress=progress, device=device)


def export(path: str | Path, format: str = "onnx", output: str | Path | None = None, force: bool = False,
           quiet: bool = True) -> Path:
    """Export the artifact at `path` as a standalone model in `format` ("onnx": DIR/model.onnx that
    plain onnxruntime runs, with DIR/tokenizer/ and DIR/llmc_onnx.json) into the directory `output`;
    quiet=False prints a line on stderr for each stage that runs longer than a moment."""
    from llmc.codegen.ort.onnx_export import ExportError, export_onnx  # torch and codegen: only export

    if format != "onnx":
        raise ExportError(f"export format {format!r} is not supported; use format='onnx'")
    output = output or f"{Path(str(path)).name.removesuffix('.llmc')}.onnx"
    return export_onnx(path, output, force=force, quiet=quiet)


def load(path: str | Path, device: str | None = None, **engine_options) -> "LLM":
    """Load an artifact (every file's hash is checked) into an LLM ready to generate. `device`:
    None runs it where its target does (a GPU target on CUDA); "cpu" runs a GPU artifact's Triton
    kernels through Triton's interpreter (slow: for tests and debugging)."""
    return LLM(path, device=device, **engine_options)


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Serve the artifact at `path` over an OpenAI-compatible HTTP API until SIGTERM (as `llmc serve`).
    `options`: api_key, max_queue, ttft_slo_ms, served_model_name, shutdown_timeout, max_request_bytes
    (default 8 MiB), max_n (default 16), metrics_need_key, result_cache (bytes, e.g. "256MiB"; off by
    default), result_cache_ttl (seconds), and `load`'s engine options.
    To mount the app yourself: `llmc.runtime.server.build_app(llmc.load(path))`."""
    # fastapi, uvicorn: llmc.load imports none (tests/server/test_admission.py)
    from llmc.runtime.server.launch import serve as serve_artifact

    serve_artifact(path, host, port, **options)


def run_site_plan(art, plan, threads: int, asked: bool | None, invariant: bool):
    """Engine's choose_plan: (plan, data files) with the artifact's kernel choices re-checked on this
    machine where they were made on another (or asked: recheck_kernels=True, $LLMC_RECHECK_KERNELS=1); a
    line on stderr when so."""
    from llmc.compiler.driver.tuning.run_site import recheck  # the compile driver: only rechecked kernel choices
    from llmc.compiler.progress import echo_stderr  # tqdm: the same

    return recheck(art, plan, threads, asked, invariant, echo=echo_stderr)


class LLM:
    """An artifact on the llmc engine, safe to call from several threads at once: their requests join one
    batch (whichever call holds the engine steps it for all), and each call gets its own outputs, as
    it would alone (greedy and seeded sampling are batch-invariant). `engine_options` are
    EngineConfig fields (kv_memory, block_size, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, device, threads: CPU threads, default $LLMC_NUM_THREADS or the physical
    cores; speculative: {"method": "ngram", "num_speculative_tokens": 5} or {"method": "draft",
    "model": DRAFT_ARTIFACT}, see runtime/speculative_config.py; ring_attention_threshold: a --tp
    artifact's prefills of this many tokens or more run ring attention, 0 never, default
    $LLMC_RING_ATTENTION_THRESHOLD or 4096)."""

    def __init__(self, path: str | Path, **engine_options):
        from llmc.runtime.engine import Engine, EngineConfig  # torch (~1 s): llmc.api stays light

        unknown = sorted(set(engine_options) - {f.name for f in fields(EngineConfig)})
        if unknown:
            raise RuntimeLlmcError(f"unknown engine option(s) {', '.join(unknown)}; valid: "
                                   f"{', '.join(f.name for f in fields(EngineConfig))}")
        self.path = Path(path)
        self.engine = Engine(self.path, EngineConfig(**engine_options), choose_plan=run_site_plan)
        self.tokenizer = self.engine.tokenizer
        # The engine and its tokenizer (a Rust tokenizer used from two threads can fail "Already
        # borrowed") are touched only under this lock.
        self._lock = threading.Lock()
        self._holder: int | None = None             # the thread holding _lock
        self._outputs: dict[str, object] = {}       # latest RequestOutput of each request a call waits on
        self._abandoned: list[str] = []             # streams closed while their thread held _lock

    @contextmanager
    def _held(self):
        """The engine, for this thread alone; requests of streams closed meanwhile are aborted first."""
        with self._lock:
            self._holder = threading.get_ident()
            try:
                abandoned, self._abandoned = self._abandoned, []
                self._drop(abandoned)
                yield self.engine
            finally:
                self._holder = None

    def _add(self, requests: list[dict]) -> list[str]:
        """Add every request or none (held)."""
        ids: list[str] = []
        try:
            for r in requests:
                ids.append(self.engine.add_request(**r))
                self._outputs[ids[-1]] = None
        except BaseException:
            self._drop(ids)
            raise
        return ids

    def _step(self) -> None:
        """One engine step for every thread's requests (held); each output is kept for its caller."""
        for out in self.engine.step():
            if out.request_id in self._outputs:
                self._outputs[out.request_id] = out

    def _drop(self, ids) -> None:
        for i in ids:
            self.engine.abort(i)
            self._outputs.pop(i, None)

    def _forget(self, ids: list[str]) -> None:
        """Abort `ids` and drop their outputs; deferred when this thread holds the engine (a stream
        collected in the middle of a step), since the step is not to be changed under it."""
        if self._holder == threading.get_ident():
            self._abandoned.extend(ids)
            return
        with self._held():
            self._drop(ids)

    def generate(self, prompts=None, sampling_params=None, *, messages=None, tools=None, priority=None,
                 use_tqdm=False):
        """One prompt or a list: strings or {"prompt_token_ids": [...]}. `sampling_params` is one
        SamplingParams or a list (one per prompt). Returns RequestOutputs in prompt order. Every
        value is checked before any request is added; a call that fails leaves the engine as it
        found it. `messages` (with the `tools` the chat template offers the model) instead of prompts:
        see chat()."""
        label = "prompts"
        if tools is not None and messages is None:
            raise RuntimeLlmcError("generate(): tools are offered through the chat template; pass messages")
        if messages is not None:
            prompts, label = [self.apply_chat_template(m, tools) for m in _as_conversations(messages)], "messages"
        if prompts is None:
            raise RuntimeLlmcError("generate() needs prompts or messages")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else _as_list(prompts, "prompts")
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        prio = _per_prompt(priority, len(prompts), "priority")
        with self._held():
            requests = [self._checked(p, sp, pr, f"{label}[{i}]")
                        for i, (p, sp, pr) in enumerate(zip(prompts, params, prio))]
            ids = self._add(requests)
        try:
            bar, waiting = _progress(len(ids), use_tqdm), set(ids)
            while waiting:
                with self._held() as engine:
                    if any(i in engine.requests for i in waiting):
                        self._step()
                    done = {i for i in waiting if i not in engine.requests}
                waiting -= done
                bar.update(len(done))
            bar.close()
            return [self._outputs[i] for i in ids]
        finally:
            self._forget(ids)

    def close(self) -> None:
        """Stop what the engine runs outside this process now (a tensor-parallel artifact's other
        ranks) rather than when the LLM is collected or the process exits."""
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            close()

    def chat(self, messages, sampling_params=None, tools=None, **kw):
        """One conversation (list of {"role", "content"}) or a list of them. `tools` (OpenAI's
        [{"type": "function", "function": {"name", "description", "parameters"}}]) are rendered by the
        chat template, as vLLM's LLM.chat does; llmc.parse_tool_calls(text) reads the calls back."""
        return self.generate(messages=messages, sampling_params=sampling_params, tools=tools, **kw)

    def stream(self, prompt, sampling_params=None) -> Iterator[str]:
        """Yield the text of one prompt's first sample as it is generated."""
        with self._held() as engine:
            [request_id] = self._add([self._checked(prompt, sampling_params, None, "prompt")])
            sample = engine.requests[request_id].samples[0]
        try:
            running = True
            while running:
                with self._held() as engine:
                    if request_id in engine.requests:
                        self._step()
                    running = request_id in engine.requests
                    piece, out = sample.stop.new_text(), self._outputs[request_id]
                if piece:   # yielded without the engine: the consumer may take its time
                    yield piece
                if out is not None and out.outputs[0].finish_reason == "abort" and out.outputs[0].stop_reason:
                    raise RuntimeLlmcError(str(out.outputs[0].stop_reason))
        finally:
            self._forget([request_id])

    def apply_chat_template(self, messages, tools=None) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise RuntimeLlmcError(f"the model in {self.path} has no chat template; pass plain prompts")
        # pydantic's protocol: only chats with tools
        from llmc.runtime.server.tools import checked_tools, template_message
        if tools is not None:
            tools = checked_tools(tools, template, f"the model in {self.path}")
        with self._held():
            return render_chat_template(self.tokenizer, [template_message(m) for m in messages],
                                        f"the model in {self.path}", tools)

    def _checked(self, prompt, params, priority, where: str) -> dict:
        """add_request's arguments for one prompt, every value checked (nothing is added yet)."""
        from llmc.runtime import request_values  # torch: llmc.api stays light
        from llmc.runtime.sampling_params import SamplingParams  # torch: llmc.api stays light

        text, token_ids = prompt, None
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RuntimeLlmcError(f"{where}: a dict prompt needs the key 'prompt_token_ids'")
            text, token_ids = None, prompt["prompt_token_ids"]
        return {"prompt": text, "prompt_token_ids": self.engine.prompt_ids(text, token_ids, where),
                "params": request_values.sampling_params(params or SamplingParams(), where),
                "priority": request_values.priority(priority or 0, where)}


def _as_list(values, name: str) -> list:
    from llmc.runtime.request_values import shown  # torch: llmc.api stays light

    if isinstance(values, (bytes, int, float)) or not hasattr(values, "__iter__"):
        raise RuntimeLlmcError(f"{name} is {shown(values)}; pass a str, a "
                               "{'prompt_token_ids': [...]} dict, or a list of them")
    return list(values)


def _per_prompt(value, count: int, name: str) -> list:
    """One value for every prompt, or a list of exactly one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise RuntimeLlmcError(f"generate() got {count} prompts but {len(value)} {name}; give one "
                               f"{name} or a list of one per prompt")
    return value


def _as_conversations(messages) -> list[list[dict]]:
    """One conversation or a list of them, each checked to be a non-empty list of
    {"role": str, "content": str} dicts."""
    from llmc.runtime.request_values import shown  # torch: llmc.api stays light
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RuntimeLlmcError(f"messages is {shown(messages)}; pass a list of "
                               "{'role': str, 'content': str} dicts, or a list of such lists")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        where = "messages" if conversations[0] is messages else f"messages[{i}]"
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise RuntimeLlmcError(f"{where} is {shown(conversation)}; a conversation is a non-empty list "
                                   "of {'role': str, 'content': str} dicts")
        for j, message in enumerate(conversation):
            calls = isinstance(message, dict) and isinstance(message.get("tool_calls"), list)
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and (isinstance(message.get("content"), str) or calls and message.get("content") is None)):
                raise RuntimeLlmcError(f"{where}[{j}] is {shown(message)}; each message is a "
                                       "{'role': str, 'content': str} dict (content None with 'tool_calls')")
    return conversations


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm  # tqdm: llmc.api stays light
    return tqdm(total=total, desc="requests", unit="req")
