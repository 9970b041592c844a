"""The engine loop (as vLLM's LLMEngine): requests go in with `add_request`, each `step`
schedules a batch, runs the model, samples, checks stops, and returns the outputs that
moved; `abort` frees a request's KV blocks at once."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from llmc.codegen.native.cpu_native import Q4_ACTIVATIONS
from llmc.compiler.artifact import load_tokenizer, read_artifact
from llmc.compiler.ops import TORCH_DTYPES
from llmc.errors import RuntimeLlmcError
from llmc.runtime import request_values
from llmc.runtime.batch_invariance import batch_invariant_of
from llmc.runtime.block_manager import BlockManager, droppable_window, num_blocks_for_budget, parse_bytes
from llmc.runtime.device import resolve_device
from llmc.runtime.draft_tree import DraftTree
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.host_memory import keep_freed_memory
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.kv_policy import KVPolicy, kv_policy
from llmc.runtime.kv_quant import is_quantized_kv, kv_group_of, load_kv_scales
from llmc.runtime.metrics import EngineMetrics
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmc.runtime.paged_attention import PagedKVCache
from llmc.runtime.parallel.launch import start_ranks
from llmc.runtime.prompt_logprobs import prompt_rows, record
from llmc.runtime.sampler import Sampler, SamplingState, bad_words_token_ids
from llmc.runtime.sampling_params import MAX_SEED, SamplingParams
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.sequence import Sequence, SequenceStatus
from llmc.runtime.speculative import Speculator
from llmc.runtime.speculative_config import SpeculativeConfig, speculative_config
from llmc.runtime.stop import StopChecker
from llmc.runtime.structured_output import GrammarCompiler, consume, grammar_drafts, mask_draft_rows
from llmc.runtime.threads import apply_threads, resolve_threads

if TYPE_CHECKING:
    from llmc.runtime.kv_transfer import Handoff

# Forked samples get ids far from Sequence's own counter.
_fork_ids = itertools.count(1 << 40)


@dataclass
class EngineConfig:
    kv_memory: str | int = "1GiB"           # KV cache budget
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None   # None: what the plan was sized for
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int | None = None                 # for requests without their own seed
    device: str | None = None               # "cpu" | "cuda"; None: the artifact target's device
    check_kernels: bool = False             # debug: fail a step that launches a kernel it does not record
    threads: int | None = None              # CPU threads; None: LLMC_NUM_THREADS, else the physical cores
    # speculative decoding: {"method": "ngram" | "draft", "num_speculative_tokens": k, "model": PATH, ...}
    speculative: SpeculativeConfig | dict | str | None = None
    # a --tp artifact's prefills of this many tokens or more run ring attention (0: never);
    # None: $LLMC_RING_ATTENTION_THRESHOLD, else 4096
    ring_attention_threshold: int | None = None
    # a sequence's logits the same bits whatever else is in the step (runtime/batch_invariance.py);
    # None: as the artifact was compiled (--batch-invariant, default on); False allows the faster kernels
    batch_invariant: bool | None = None
    # how the native 4-bit GEMVs round activations (cpu_native.Q4_ACTIVATIONS: "int8" per block of 32, llama.cpp's
    # Q8 rounding, or "int16" per 64); None: as the artifact was compiled (--q4-activations)
    q4_activations: str | None = None
    # re-check the artifact's kernel choices on this machine at load (the driver's run_site.py, given as
    # Engine(choose_plan=...)): True always, False never; None: $LLMC_RECHECK_KERNELS, else where this is
    # not the machine (CPU, threads) that chose them or its timings were taken busy
    recheck_kernels: bool | None = None
    # a KV policy holding each sequence to kv_budget cached tokens (runtime/kv_policy.py): "h2o" | "streaming" |
    # a KVPolicy; "none": the full cache; None: as the artifact was compiled (--kv-policy)
    kv_policy: KVPolicy | dict | str | None = None
    kv_budget: int | None = None
    kv_recent: int | None = None
    kv_sinks: int | None = None

    def __post_init__(self):
        for name, rule in (("block_size", "an integer >= 1"), ("max_num_seqs", "an integer >= 1"),
                           ("max_num_batched_tokens", "an integer >= 1 or None"),
                           ("seed", "an integer in [0, 2**64 - 1] or None"),
                           ("ring_attention_threshold", "an integer >= 0 or None")):
            value = getattr(self, name)
            low = 0 if name in ("seed", "ring_attention_threshold") else 1
            ok_int = isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_SEED
            if not ok_int and not (value is None and rule.endswith("None")):
                raise RuntimeLlmcError(f"engine option {name}={value!r} must be {rule}")
        for name in ("batch_invariant", "recheck_kernels"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise RuntimeLlmcError(f"engine option {name}={getattr(self, name)!r} must be True, False or None")
        if self.q4_activations not in (None, *Q4_ACTIVATIONS):
            raise RuntimeLlmcError(f"engine option q4_activations={self.q4_activations!r} must be one of "
                                   f"{', '.join(Q4_ACTIVATIONS)} or None")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "check_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise RuntimeLlmcError(f"engine option {name}={getattr(self, name)!r} must be True or False")
        self.threads = resolve_threads(self.threads)
        self.speculative = speculative_config(self.speculative)
        if self.kv_policy is None or self.kv_policy == "none":
            kv_policy(None, self.kv_budget, self.kv_recent, self.kv_sinks)   # refuses a budget without a policy
        else:
            self.kv_policy = kv_policy(self.kv_policy, self.kv_budget, self.kv_recent, self.kv_sinks)


def _check_kv_fits(cache_bytes: int, device: torch.device, asked) -> None:
    """Refuse a KV cache the device cannot hold before allocating it: torch would fail with a
    bare RuntimeError, or the OS would kill the process part way through zero-filling it."""
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"{device} has"
    else:
        free, where = psutil.virtual_memory().available, "the machine has"
    if cache_bytes > free:
        raise RuntimeLlmcError(f"--kv-memory {asked}: the KV cache needs {cache_bytes / 2**30:.2f} GiB "
                               f"({cache_bytes} bytes) but {where} {free / 2**30:.2f} GiB ({free} bytes) "
                               "available; give a smaller --kv-memory")


def paged_kv_cache(model: dict, weights: dict[str, torch.Tensor], num_blocks: int, block_size: int,
                   device: torch.device) -> PagedKVCache:
    """The paged cache in the artifact's KV dtype (`model`: its manifest's model section); an
    int8/fp8 one with its static scales, an int4 one with its group size."""
    kv_cache = model.get("kv_cache") or {"dtype": model["kv_dtype"]}
    dtype = TORCH_DTYPES[kv_cache["dtype"]]
    scales = (load_kv_scales(weights, kv_cache, model["num_layers"], model["num_kv_heads"])
              if is_quantized_kv(dtype) else None)
    return PagedKVCache(model["num_layers"], num_blocks, block_size, model["num_kv_heads"],
                        model["head_dim"], dtype, device=device, kv_scales=scales,
                        kv_group=kv_group_of(kv_cache, model["head_dim"]))


@dataclass
class _Sample:
    """One of a request's n samples: its sequence, sampler state and stop checker."""
    seq: Sequence
    state: SamplingState
    stop: StopChecker
    index: int
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # sample 0's, when asked


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[_Sample] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.stop.finished for s in self.samples)


class Engine:
    def __init__(self, artifact: str | Path, config: EngineConfig | None = None, choose_plan=None):
        """`choose_plan(art, plan, threads, asked, invariant)`: (plan, data files) to run on this machine
        (the driver's run_site.recheck: the kernel choices re-checked here); None runs the artifact's."""
        self.config = config = config or EngineConfig()
        apply_threads(config.threads)
        art = read_artifact(artifact)
        # first: running a GPU artifact on the CPU must choose Triton's interpreter before triton loads
        self.device = resolve_device(art.manifest, config.device, artifact)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.manifest = art.manifest
        self.model = art.manifest["model"]
        self.tokenizer = load_tokenizer(art)
        plan = verified_plan(art)
        invariant = batch_invariant_of(plan, config.batch_invariant)
        data = art.data
        if choose_plan is not None and self.device.type == "cpu":
            plan, data = choose_plan(art, plan, config.threads, config.recheck_kernels, invariant)
        self.executor = PlanExecutor(plan, art.weights, self.device, check_kernels=config.check_kernels,
                                     data=data, batch_invariant=invariant, q4_activations=config.q4_activations)
        self.max_model_len = self.model["max_position_embeddings"]
        num_blocks = num_blocks_for_budget(parse_bytes(config.kv_memory), self.model["kv_bytes_per_token"],
                                           config.block_size)
        _check_kv_fits(num_blocks * config.block_size * self.model["kv_bytes_per_token"], self.device,
                       config.kv_memory)
        self.cache = self._make_cache(art.weights, num_blocks)
        window = droppable_window([s.attrs.get("window") for s in plan.attention_steps()],
                                  pipelined=(self.manifest.get("parallel") or {}).get("pp", 1) > 1)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, window)
        max_tokens = min(config.max_num_batched_tokens or plan.max_tokens, plan.max_tokens)
        self.scheduler = Scheduler(SchedulerConfig(max_tokens, config.max_num_seqs, config.block_size,
                                                   config.enable_chunked_prefill), self.block_manager)
        self.kv_policy = self._kv_policy(plan)
        self.runner = ModelRunner(self.executor, self.cache)
        if "parallel" in self.manifest:  # tensor parallel: this process is rank 0, the others follow its steps
            self.runner = start_ranks(artifact, self.manifest, self.executor, self.cache, config.threads,
                                      config.ring_attention_threshold)
        self.runner.kv_policy = self.kv_policy
        self.eos_token_ids = self.model["eos_token_ids"] or [self.tokenizer.eos_token_id]
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.grammars = GrammarCompiler(self.tokenizer, self.model["vocab_size"], self.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._token_texts: dict[int, str] = {}
        self.metrics = EngineMetrics()
        self._next_id = 0
        self.speculator = None
        if config.speculative is not None:
            self.speculator = Speculator(config.speculative, self)
            self.metrics.speculative = self.speculator.metrics

    def _kv_policy(self, plan) -> KVPolicy | None:
        """The load's KV policy, else the artifact's; refused in one line where its scores or its compaction
        would not be kept (never ignored)."""
        asked = self.config.kv_policy
        policy = None if asked == "none" else asked or kv_policy(plan.meta.get("kv_policy"))
        if policy is None:
            return None
        steps = plan.attention_steps()
        refusal = ("the Triton attention kernels of GPU targets keep no attention scores; use a cpu-target "
                   "artifact on the CPU" if self.executor.attention.triton or self.device.type != "cpu" else
                   "speculative decoding would roll back evicted entries" if self.config.speculative else
                   "tensor- and pipeline-parallel ranks keep their own caches" if "parallel" in self.manifest else
                   "a sliding-window layer masks by position" if any(s.attrs.get("window") for s in steps) else
                   "soft-capped attention" if any(s.attrs.get("softcap") is not None for s in steps) else None)
        if refusal is not None:
            raise RuntimeLlmcError(f"--kv-policy {policy.kind}: not served here ({refusal}); "
                                   "load with kv_policy='none' (--kv-policy none) for the full cache")
        policy.check_block_size(self.config.block_size)
        return policy

    def _make_cache(self, weights: dict[str, torch.Tensor], num_blocks: int) -> PagedKVCache:
        return paged_kv_cache(self.model, weights, num_blocks, self.config.block_size, self.device)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        if request_id in self.requests:
            raise RuntimeLlmcError(f"request id {request_id!r} is already in use; pick another")
        where = f"request {request_id}"
        params = request_values.sampling_params(params or SamplingParams(), where)
        priority = request_values.priority(priority, where)
        ids = self.prompt_ids(prompt, prompt_token_ids, where)
        now = time.monotonic() if arrival_time is None else arrival_time
        req = _Request(request_id, prompt, ids, params, RequestMetrics(arrival_time=now, num_prompt_tokens=len(ids)))
        seq = Sequence(ids, request_id=request_id, params=params, priority=priority, arrival_time=now)
        if self.kv_policy is not None:   # runtime/kv_policy.py: why a policy sequence skips the prefix cache
            seq.kv_cap, seq.uses_prefix_cache = self.kv_policy.budget, False
        req.samples.append(self._sample(seq, req, 0))
        if params.prompt_logprobs is not None:
            req.samples[0].prompt_logprobs = [None]
            seq.uses_prefix_cache = False   # a cached block has no logits
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def add_prefilled(self, handoff: Handoff, kv: torch.Tensor, skipped: int = 0) -> bool:
        """Disaggregated decode: take in a request another engine prefilled (runtime/kv_transfer.py's
        `handoff`: its prompt, the first token sampled there with its logprobs and generator state) with
        its prompt's KV blocks `kv` (PagedKVCache.export_blocks' bytes) but the first `skipped`, which
        this cache holds (BlockManager.hold_cached_prefix); False while the batch or the cache has no
        room for it (Scheduler.admit_prefilled), a RuntimeLlmcError if it can never fit."""
        h, where, now = handoff, f"request {handoff.request_id}", time.monotonic()
        if self.kv_policy is not None:
            raise RuntimeLlmcError(f"{where}: a prefilled handoff cannot enter an engine with --kv-policy "
                                   f"{self.kv_policy.kind} (its prompt's attention scores were not kept)")
        if h.request_id in self.requests:
            raise RuntimeLlmcError(f"request id {h.request_id!r} is already in use; pick another")
        params = request_values.sampling_params(h.params, where)
        ids = self.prompt_ids(h.prompt, h.prompt_token_ids, where)
        seq = Sequence(ids, request_id=h.request_id, params=params, priority=h.priority, arrival_time=now)
        req = _Request(h.request_id, h.prompt, ids, params,
                       RequestMetrics(arrival_time=now, first_token_time=now, num_prompt_tokens=len(ids)))
        s = self._sample(seq, req, 0)   # before the first token is appended: its stop checker reads it below
        seq.append_token(h.first_token)
        if not self.scheduler.admit_prefilled(seq):
            return False
        first = seq.num_cached_tokens // self.config.block_size   # blocks before it: this cache's prefix hits
        if first < skipped:   # held by hold_cached_prefix, so prefix hits when taken in: else a bug, said
            raise RuntimeLlmcError(f"{where}: {skipped} KV blocks were held for its handoff but only {first} "
                                   f"are prefix hits now; the request cannot be taken in")
        self.cache.import_blocks(seq.block_table[first:skipped + kv.shape[2]], kv[:, :, first - skipped:])
        self.block_manager.mark_full_blocks(seq)
        seq.num_cached_tokens = h.num_cached_tokens
        req.samples.append(s)
        s.logprobs, s.cumulative_logprob = h.logprobs, h.cumulative_logprob
        if h.generator_state is not None:
            s.state.generator.set_state(h.generator_state)
        if s.state.grammar is not None:
            consume(s.state.grammar, h.first_token)
        finished = s.stop.check_new_token()   # the text and the stop strings as the prefill engine saw them
        assert not finished, "a request is handed over only when its first token did not finish it"
        s.stop.new_text()   # streamed by the prefill engine
        self.requests[h.request_id] = req
        return True

    def prompt_ids(self, prompt: str | None, prompt_token_ids, where: str) -> list[int]:
        """The checked token ids of a prompt given as text or as ids (ids win when both are);
        `where` names the request in the errors."""
        if prompt_token_ids is None:
            if prompt is None:
                raise RuntimeLlmcError(f"{where} needs a prompt string or prompt_token_ids")
            prompt_token_ids = self.tokenizer(request_values.prompt_text(prompt, where))["input_ids"]
        ids = request_values.token_ids(prompt_token_ids, self.model["vocab_size"], where)
        if not ids:
            raise RuntimeLlmcError(f"{where}: the prompt has no tokens; give at least one")
        if len(ids) > self.max_model_len:
            raise RuntimeLlmcError(f"{where}: prompt of {len(ids)} tokens is longer than the "
                                   f"model's context of {self.max_model_len} tokens; shorten the prompt")
        return ids

    def _sample(self, seq: Sequence, req: _Request, index: int) -> _Sample:
        params = req.params
        grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        bad = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else None
        state = SamplingState(params, seq, sample_index=index, device=self.device, grammar=grammar,
                              bad_words_ids=bad)
        stop = StopChecker(self.tokenizer, req.params, seq, self.eos_token_ids,
                           max_model_len=self.max_model_len)
        return _Sample(seq, state, stop, index)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.abort(request_id)
        for s in req.samples:
            s.stop.abort()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that moved or finished."""
        out = self.scheduler.schedule(self._propose() if self.speculator else None)
        touched: dict[str, _Request] = {}
        for seq in out.rejected:
            req = self.requests.get(seq.request_id)
            if req is not None:
                req.error = seq.error
                touched[req.request_id] = req
        if not out.is_empty:
            t0 = time.perf_counter()
            asked = prompt_rows(out.scheduled, lambda seq: self._find(seq).prompt_logprobs)
            logits = self.runner.execute(out.scheduled, out.sampled, out.blocks_to_copy, drafts=out.drafts,
                                         **({"evictions": out.evictions} if out.evictions else {}),
                                         borrow=True,   # sampled and verified before the next step
                                         **({"prompt_rows": asked} if asked else {}))
            end = len(logits) - sum(asked.values())
            if asked:
                self._record_prompt_logprobs(out, asked, logits[end:])
            self._sample_and_stop(out, logits[:len(out.sampled)], touched)
            if out.drafts:
                self._accept_verified(out, logits[len(out.sampled):end], touched)
            self.metrics.on_step(out, time.perf_counter() - t0, self.scheduler, self.block_manager)
        if self.speculator:
            self.speculator.forget_finished()
        results = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                self._retire(req)
        return results

    def _record_prompt_logprobs(self, out, asked: dict[int, int], logits: torch.Tensor) -> None:
        row = 0
        for seq, _ in out.scheduled:
            count = asked.get(seq.seq_id, 0)
            if count:
                s = self._find(seq)
                record(seq, s.prompt_logprobs, logits[row:row + count], s.state.params.prompt_logprobs,
                       self.token_text)
                row += count

    def token_text(self, token_id: int) -> str:
        """One token's text, as Logprob.decoded_token gives it (cached: logprobs ask for the same ones)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _sample_and_stop(self, out, logits: torch.Tensor, touched: dict) -> None:
        samples = [self._find(seq) for seq in out.sampled]
        result = self.sampler.sample(logits, [s.state for s in samples])
        self.scheduler.postprocess(out, result.token_ids)
        now = time.monotonic()
        for i, s in enumerate(samples):
            req = self.requests[s.seq.request_id]
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if s.seq.num_output_tokens == 1 and s.index == 0 and req.params.n > 1:
                # fork before the parent's stop check, which may finish it and free its blocks
                self._fork(req, s, logits[i])
            self._accept(s, result, i)

    def _accept(self, s: _Sample, result, i: int) -> None:
        token = result.token_ids[i]
        assert s.seq.last_token == token, "a sampled token is appended to its sequence before it is accepted"
        if s.state.params.logprobs is not None:
            entry = {token: Logprob(result.logprobs[i], result.ranks[i] if result.ranks else None,
                                    self.token_text(token))}
            for rank, (tok, lp) in enumerate(result.top_logprobs[i] if result.top_logprobs else [], 1):
                entry.setdefault(tok, Logprob(lp, rank, self.token_text(tok)))
            s.logprobs = (s.logprobs or []) + [entry]
            s.cumulative_logprob = (s.cumulative_logprob or 0.0) + result.logprobs[i]
        if s.stop.check_new_token():
            self.scheduler.finish(s.seq, s.stop.finish_reason)

    def _propose(self) -> dict[int, list[int]]:
        """Speculative decoding: drafts for the running sequences that decode one token next. A request
        whose logits are reshaped (bias, bad words, processors) gets none: verification would not apply
        them, so it decodes one token a step. A constrained one keeps the leading drafts of a chain that its
        grammar accepts (a tree's branches are not checked against the grammar yet: it gets none)."""
        seqs = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1 and not s.params.reshapes_logits]
        states = [self._find(s).state for s in seqs]
        drafts = self.speculator.propose(seqs, states)
        for seq, state in zip(seqs, states):
            chain = drafts.get(seq.seq_id)
            if chain is None or state.grammar is None:
                continue
            usable = [] if isinstance(chain, DraftTree) else grammar_drafts(state.grammar, chain)
            if usable:
                drafts[seq.seq_id] = usable
            else:
                drafts.pop(seq.seq_id)
        return drafts

    def _mask_verified_rows(self, out, logits: torch.Tensor, samples: list[_Sample]) -> None:
        """Each constrained sequence's 1 + k verification rows under its grammar, in place."""
        start = 0
        for seq, s in zip(out.speculated, samples):
            rows = len(out.drafts[seq.seq_id]) + 1
            if s.state.grammar is not None:
                mask_draft_rows(logits[start:start + rows], s.state.grammar, out.drafts[seq.seq_id])
            start += rows

    def _accept_verified(self, out, logits: torch.Tensor, touched: dict) -> None:
        """Append the tokens each speculating sequence kept, checking stops after each one as
        plain decoding would, then roll its KV back to them."""
        samples = [self._find(seq) for seq in out.speculated]
        self._mask_verified_rows(out, logits, samples)
        kept = self.speculator.verify(out.speculated, logits, [s.state for s in samples], out.drafts)
        for s, tokens in zip(samples, kept):
            req = self.requests[s.seq.request_id]
            touched[req.request_id] = req
            finished = False
            for token in tokens:
                s.seq.append_token(token)
                if s.state.grammar is not None:
                    consume(s.state.grammar, token)
                self.metrics.generation_tokens += 1
                if s.stop.check_new_token():
                    finished = True
                    break
            self.scheduler.settle_verified(s.seq)
            if finished:
                self.scheduler.finish(s.seq, s.stop.finish_reason)

    def _fork(self, req: _Request, parent: _Sample, logits: torch.Tensor) -> None:
        """n > 1: the other samples share the prompt's KV blocks (copy-on-write) and draw
        their own first token from the same logits."""
        for index in range(1, req.params.n):
            # the prompt only: this sample draws its own first token
            seq = self.scheduler.fork(parent.seq, seq_id=next(_fork_ids), num_tokens=parent.seq.num_prompt_tokens)
            sample = self._sample(seq, req, index)
            req.samples.append(sample)
            result = self.sampler.sample(logits[None], [sample.state])
            seq.append_token(result.token_ids[0])
            self.metrics.generation_tokens += 1
            self._accept(sample, result, 0)

    def _find(self, seq: Sequence) -> _Sample:
        return next(s for s in self.requests[seq.request_id].samples if s.seq is seq)

    def _output(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=s.stop.output_text, token_ids=s.seq.output_token_ids,
                                 cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                 finish_reason="abort" if req.error else s.stop.finish_reason,
                                 stop_reason=req.error or s.stop.stop_reason)
                for s in sorted(req.samples, key=lambda s: s.index)]
        m = req.metrics
        m.num_generated_tokens = sum(len(o.token_ids) for o in outs)
        m.num_cached_tokens = req.samples[0].seq.num_cached_tokens
        if req.finished and m.finished_time is None:
            m.finished_time = time.monotonic()
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=req.finished, metrics=m,
                             prompt_logprobs=req.samples[0].prompt_logprobs)

    def _retire(self, req: _Request) -> None:
        for s in req.samples:
            if s.seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(s.seq, s.stop.finish_reason or "abort")
        self.metrics.on_finish(req.metrics)
        self.requests.pop(req.request_id, None)
