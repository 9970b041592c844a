"""The Python API: `llmc.compile` an artifact, `llmc.load` it into an `LLM` whose
`generate`, `stream` and `chat` follow vLLM's offline API."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from llmc.errors import RuntimeLlmcError


def compile(model: str, target: str = "cpu", output: str | Path | None = None, *, force: bool = False,
            passes: str | None = None, disable: list[str] | None = None,
            pass_options: dict[str, dict] | None = None, print_ir_after: set[str] | None = None,
            dump_ir: str | None = None, max_num_batched_tokens: int = 2048, quiet: bool = True,
            quant: str | None = None, group_size: int | None = None, kv_cache: str | None = None,
            calib: str | Path | None = None, calib_samples: int = 8, calib_seq_len: int = 128,
            calib_seed: int = 0, max_ppl_increase: float | None = None,
            kv_heads: int | None = None, kv_grouping: str | None = None,
            draft_of: str | Path | None = None, draft_layers: int | None = None,
            prune: str | None = None, sparsity: str | float | None = None,
            sparsity_method: str | None = None, autotune: bool = False) -> Path:
    """Compile `model` (sample name, HF checkpoint dir, or .gguf file) for `target`; `quant` is
    a --quant recipe ("int8", "int4-rtn", "int4-gptq", "int4-awq", "fp8", "w8a8"). Lossy passes
    are measured on `calib` text (default: text the model generates itself, seeded by
    `calib_seed`); `max_ppl_increase` (percent) fails the compile if one costs more.
    `kv_heads` mean-pools the KV heads down to that many (`kv_grouping` "auto", "index" or
    "similarity"). `draft_of` (a target artifact) makes a speculative-decoding draft of it
    from `model`: `draft_layers` layers kept (default half), int4 weights unless `quant` says.
    `prune` ("heads:0.25,ffn:0.3,layers:4") removes attention heads, MLP channels and whole
    layers; `sparsity` (0.5, or "2:4") zeroes weights by `sparsity_method` ("wanda" or
    "magnitude"); both run first in the pipeline. `autotune` times a GPU target's Triton launch
    configs on a CUDA GPU (without one the plan records the defaults)."""
    from llmc.compiler.pipeline import CompileOptions, compile_model

    output = output or f"{Path(str(model)).name.removesuffix('.gguf')}.llmc"
    opts = CompileOptions(passes=passes, disable=list(disable or []), pass_options=dict(pass_options or {}),
                          print_ir_after=set(print_ir_after or ()), dump_ir=dump_ir,
                          max_num_batched_tokens=max_num_batched_tokens, force=force, quiet=quiet,
                          quant=quant, group_size=group_size, kv_cache=kv_cache,
                          calib=None if calib is None else str(calib), calib_samples=calib_samples,
                          calib_seq_len=calib_seq_len, calib_seed=calib_seed,
                          max_ppl_increase=max_ppl_increase, kv_heads=kv_heads, kv_grouping=kv_grouping,
                          draft_of=None if draft_of is None else str(draft_of), draft_layers=draft_layers,
                          prune=prune, sparsity=sparsity, sparsity_method=sparsity_method, autotune=autotune)
    return compile_model(model, target, output, opts)


def evaluate(path: str | Path, text: str, ref: str | Path | None = None, max_tokens: int = 4096,
             progress: bool = False, device: str | None = None) -> dict:
    """Perplexity of the artifact at `path` on `text` (context 512, stride 256, first
    `max_tokens` tokens); with `ref`, also KL(ref || ours) and top-1 agreement against it."""
    from llmc.runtime.evaluate import evaluate_text

    return evaluate_text(path, text, ref=ref, max_tokens=max_tokens, progress=progress, device=device)


def load(path: str | Path, device: str | None = None, **engine_options) -> "LLM":
    """Load an artifact (every file's hash is checked) into an LLM ready to generate. `device`:
    None runs it where its target does (a GPU target on CUDA); "cpu" runs a GPU artifact's Triton
    kernels through Triton's interpreter (slow: for tests and debugging)."""
    return LLM(path, device=device, **engine_options)


class LLM:
    """An artifact on the llmc engine. `engine_options` are EngineConfig fields (kv_memory,
    block_size, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, device)."""

    def __init__(self, path: str | Path, **engine_options):
        from llmc.runtime.engine import Engine, EngineConfig

        self.path = Path(path)
        self.engine = Engine(self.path, EngineConfig(**engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts=None, sampling_params=None, *, messages=None, priority=None, use_tqdm=False):
        """One prompt or a list: strings or {"prompt_token_ids": [...]}. `sampling_params` is one
        SamplingParams or a list (one per prompt). Returns RequestOutputs in prompt order."""
        from llmc.runtime.sampling_params import SamplingParams

        if messages is not None:
            prompts = [self.apply_chat_template(m) for m in _as_conversations(messages)]
        if prompts is None:
            raise RuntimeLlmcError("generate() needs prompts or messages")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RuntimeLlmcError(f"generate() got {len(prompts)} prompts but {len(params)} SamplingParams")
        prio = priority if isinstance(priority, list) else [priority or 0] * len(prompts)
        ids = [self._add(p, sp, pr) for p, sp, pr in zip(prompts, params, prio)]
        done = {}
        bar = _progress(len(ids), use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def chat(self, messages, sampling_params=None, **kw):
        """One conversation (list of {"role", "content"}) or a list of them."""
        return self.generate(messages=messages, sampling_params=sampling_params, **kw)

    def stream(self, prompt, sampling_params=None) -> Iterator[str]:
        """Yield the text of one prompt's first sample as it is generated."""
        from llmc.runtime.sampling_params import SamplingParams

        request_id = self._add(prompt, sampling_params or SamplingParams(), 0)
        sample = self.engine.requests[request_id].samples[0]
        try:
            while request_id in self.engine.requests:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        piece = sample.stop.new_text()
                        if piece:
                            yield piece
                        if out.outputs[0].finish_reason == "abort" and out.outputs[0].stop_reason:
                            raise RuntimeLlmcError(str(out.outputs[0].stop_reason))
            rest = sample.stop.new_text()
            if rest:
                yield rest
        finally:
            self.engine.abort(request_id)

    def apply_chat_template(self, messages) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RuntimeLlmcError(f"the model in {self.path} has no chat template; pass plain prompts")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _add(self, prompt, params, priority) -> str:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RuntimeLlmcError("a dict prompt needs the key 'prompt_token_ids'")
            return self.engine.add_request(prompt_token_ids=prompt["prompt_token_ids"], params=params,
                                           priority=priority)
        return self.engine.add_request(prompt=prompt, params=params, priority=priority)


def _as_conversations(messages):
    if messages and isinstance(messages[0], dict):
        return [messages]
    return list(messages)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req")
