"""The `llmc` command line: compile, inspect, targets, passes, run, chat, bench, serve, eval, export.
User errors print one line and exit 2; bugs keep their traceback and exit 1."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from contextlib import contextmanager

import click

import llmc
from llmc.api import compile as compile_api
from llmc.api import export as export_api
from llmc.api import run_site_plan
from llmc.cache import ENTRIES, REMEASURE_ENV, cache_info, cache_root, clear_cache
from llmc.cli_values import (
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    FiniteFloat,
    chat_line,
    checked_text,
    prompt_lines,
    read_prompts,
    stdin_prompts,
)
from llmc.compiler.options import option_fields
from llmc.compiler.targets import TARGETS
from llmc.errors import LlmcError
from llmc.passes.registry import describe_passes, parse_pass_options
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative_config import speculative_config
from llmc.runtime.structured_output import StructuredOutputError, StructuredOutputsParams
from llmc.runtime.threads import apply_threads, resolve_threads
from llmc.tools.hf_baseline import baseline_name


def _fail(message: str) -> None:
    click.echo(f"llmc: error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llmc-compiler", prog_name="llmc")
def cli():
    """llmc: compile LLMs into artifacts and run them."""


def compile_flags(f):
    """The compile options of compiler/options.py (their one definition) as click options."""
    for field in reversed(option_fields()):
        m = field.metadata
        decls = [m["cli"] or "--" + field.name.replace("_", "-")] + ([m["short"]] if m["short"] else [])
        kwargs = {"help": m["help"]}
        if m["is_flag"]:
            kwargs["is_flag"] = True
        elif m["multiple"]:
            kwargs["multiple"] = True
        else:
            kwargs["default"] = field.default
            kwargs["show_default"] = field.default is not None
            kwargs["type"] = (click.Choice(m["choices"]) if m["choices"] else
                              click.Path(dir_okay=m["path"] != "file", file_okay=m["path"] != "dir")
                              if m["path"] else m["kind"])
        f = click.option(*decls, field.name, **kwargs)(f)
    return f


def target_help() -> str:
    return (f"Target: {', '.join(TARGETS)}. Each applies its own weight recipe (the cpu targets keep a "
            f"GGUF's blocks); `llmc targets` lists their hardware and recipes.")


@cli.command()
@click.argument("model")
@click.option("--target", "-t", default="cpu", show_default=True, help=target_help())
@click.option("--output", "-o", required=True, help="Artifact directory to write.")
@compile_flags
def compile(model, target, output, **options):
    """Compile MODEL into an artifact: an HF checkpoint dir, a .gguf or .onnx file, or a sample:
    smollm2-135m (SmolLM2-135M-Instruct, a Q4_1 GGUF fetched once) or tiny-llama (random weights,
    built in-process for tests: it prints gibberish)."""
    options["pass_options"] = parse_pass_options(options["pass_options"])
    with _sigterm_exits():
        path = compile_api(model, target=target, output=output, **options)
    if not options["quiet"]:
        from llmc.compiler.inspect import summarize  # compiler.inspect: ~0.1 s; not for `llmc --help`
        click.echo(summarize(path, brief=True))


@contextmanager
def _sigterm_exits():
    """While a compile runs, SIGTERM exits (status 143) through the same cleanup as Ctrl-C, which
    removes the staging directory; a second SIGTERM during that cleanup is ignored. A signal that
    lands inside a finalizer (`__del__`, where Python prints and drops any exception, so the compile
    would go on and exit 0) is taken again 10 ms later, from SIGALRM, until it lands elsewhere."""
    alarm: list = []   # SIGALRM's handler and the real-time timer before a retry was armed

    def terminate(signum, frame):
        if _in_finalizer(frame):
            if not alarm:
                alarm.extend([signal.signal(signal.SIGALRM, lambda _, f: terminate(signal.SIGTERM, f)),
                              signal.getitimer(signal.ITIMER_REAL)])
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread, where Python cannot take signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if alarm:   # SIGALRM and the real-time timer as they were (a test runner's timeout uses both)
            signal.setitimer(signal.ITIMER_REAL, *alarm[1])
            signal.signal(signal.SIGALRM, signal.SIG_DFL if alarm[0] is None else alarm[0])


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@cli.command("passes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable list.")
def passes_command(as_json):
    """List every registered pass: stage, options, whether it is lossy, what it needs."""
    passes = describe_passes()
    if as_json:
        click.echo(json.dumps(passes, indent=2, default=list))
        return
    for p in passes:
        flags = ", ".join(["lossy"] * p["lossy"] + [f"needs {n}" for n in p["needs"]] + ["required"] * p["required"])
        click.echo(f"{p['name']}  [{p['stage']}]{'  ' + flags if flags else ''}")
        click.echo(f"    {p['description']}")
        for o in p["options"]:
            allowed = f"; one of {', '.join(map(str, o['choices']))}" if "choices" in o else ""
            click.echo(f"    --pass-option {p['name']}.{o['name']}={o['default']!r} ({o['type']}{allowed}): "
                       f"{o['description']}")


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
@click.option("--ir", is_flag=True, help="Also print the graph IR.")
@click.option("--kernels", is_flag=True, help="List the Triton kernels of a GPU-target artifact.")
@click.option("--source", metavar="NAME", help="With --kernels: print this kernel's source (file or kernel name).")
@click.option("--memory", is_flag=True, help="Load the artifact and show what its load holds: the RSS split into "
              "weights (mapped, repacked), KV cache, activations and the rest.")
@click.option("--kv-memory", default="1GiB", show_default=True,
              help="The KV cache budget the memory figures assume (and --memory loads).")
def inspect(artifact, as_json, ir, kernels, source, memory, kv_memory):
    """Show an artifact's graph summary, pass log, and memory figures."""
    # ~0.1 s; not for `llmc --help`
    from llmc.compiler.inspect import kernel_source, kernels_summary, measured_memory, report, summarize

    if source is not None and not kernels:
        raise LlmcError("--source NAME prints a kernel's source and goes with --kernels; "
                        "run `llmc inspect ART --kernels --source NAME`")
    if kernels:
        click.echo(kernel_source(artifact, source) if source is not None else kernels_summary(artifact, as_json),
                   nl=source is None)
        return
    measured = measured_memory(artifact, kv_memory) if memory else None
    if as_json:
        click.echo(json.dumps({**report(artifact, kv_memory), **({"memory_measured": measured} if memory else {})},
                              indent=2, sort_keys=True))
    else:
        click.echo(summarize(artifact, show_ir=ir, memory=measured, kv_memory=kv_memory))


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def targets(as_json):
    """List every target with its hardware facts and default pipeline."""
    from llmc.compiler.pipeline import describe_target, full_pipeline  # the compile stack: ~3 s (transformers)

    if as_json:
        click.echo(json.dumps({n: t.to_dict() for n, t in TARGETS.items()}, indent=2, sort_keys=True))
        return
    for t in TARGETS.values():
        click.echo(describe_target(t))
        click.echo(f"    pipeline: {', '.join(full_pipeline(t))}")


def sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", type=POSITIVE, default=64, show_default=True),
        click.option("--temperature", type=FiniteFloat(min=0.0), default=0.0, show_default=True,
                     help="0 = greedy."),
        click.option("--top-p", type=FiniteFloat(0.0, 1.0, min_open=True), default=1.0, show_default=True),
        click.option("--top-k", type=click.IntRange(min=-1), default=-1, show_default=True,
                     help="-1 or 0 = disabled."),
        click.option("--seed", type=SEED, default=None),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--kv-memory", default="1GiB", show_default=True, help="KV cache budget."),
    ]):
        f = opt(f)
    return f


def structured_options(f):
    for opt in reversed([
        click.option("--json-schema", "json_schema", type=click.File("rb"), default=None, metavar="FILE",
                     help="Constrain the output to JSON valid under the JSON schema in FILE."),
        click.option("--regex", default=None, help="Constrain the output to match this regular expression."),
        click.option("--grammar", type=click.File("rb"), default=None, metavar="FILE",
                     help="Constrain the output to the EBNF/GBNF (llama.cpp) or Lark grammar in FILE."),
    ]):
        f = opt(f)
    return f


def _structured_outputs(json_schema, regex, grammar):
    """The run's StructuredOutputsParams (None without a constraint); a file that is not what its
    option needs is the user's error, named before the model loads."""
    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise LlmcError(f"{' and '.join(given)} both constrain the output; give one of them")
    try:
        if json_schema:
            text = _file_text(json_schema, "--json-schema")
            try:
                return StructuredOutputsParams(json=json.loads(text))
            except json.JSONDecodeError as e:
                raise LlmcError(f"--json-schema '{json_schema.name}' is not JSON: {e}") from None
        if grammar:
            return StructuredOutputsParams(grammar=_file_text(grammar, "--grammar"))
        return StructuredOutputsParams(regex=regex) if regex else None
    except StructuredOutputError as e:
        raise LlmcError(f"{given[0]}: {e}") from None


def _compiled(model, structured):
    """`structured` once its grammar compiles for the model's tokenizer (before any output is printed)."""
    if structured is not None:
        option = {"json": "--json-schema", "regex": "--regex", "grammar": "--grammar"}[structured.kind]
        try:
            model.engine.grammars.compile(structured)
        except StructuredOutputError as e:
            raise LlmcError(f"{option}: {e}") from None
    return structured


def _file_text(file, option: str) -> str:
    try:
        return file.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise LlmcError(f"{option} '{file.name}' is not UTF-8 text ({e.reason} at byte {e.start})") from None


def device_option(f):
    return click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
                        help="Where to run (default: where the artifact's target runs); cpu runs a GPU "
                             "artifact's Triton kernels through Triton's interpreter (slow).")(f)


def threads_option(f):
    return click.option("--threads", metavar="N", default=None,
                        help="CPU threads to compute with (default: $LLMC_NUM_THREADS, else the "
                             "machine's physical cores).")(f)


def ring_attention_option(f):
    return click.option("--ring-attention-threshold", type=NON_NEGATIVE, default=None, metavar="TOKENS",
                        help="On a --tp artifact, prefills of this many tokens or more run ring attention across "
                             "the ranks (0: never; default $LLMC_RING_ATTENTION_THRESHOLD, else 4096).")(f)


def batch_invariant_option(f):
    return click.option("--batch-invariant", type=click.Choice(["on", "off"]), default=None,
                        help="on: a sequence's logits are the same bits whatever else is batched with it and however "
                             "many rows it brings a step; off: the faster kernels whose rounding depends on the row "
                             "count. Default: as the artifact was compiled (on unless --batch-invariant off).")(f)


def q4_activations_option(f):
    return click.option("--q4-activations", type=click.Choice(["int8", "int16"]), default=None,
                        help="How the native 4-bit GEMVs round activations: int8 codes per block of 32 (llama.cpp's "
                             "Q8 rounding, the faster) or int16 per 64. Default: as the artifact was compiled "
                             "(int8 unless --q4-activations int16).")(f)


def kv_policy_options(f):
    """--kv-policy and its budget, as the compile flags of the same names (runtime/kv_policy.py)."""
    for flag, kwargs in reversed((
            ("--kv-policy", dict(type=click.Choice(["h2o", "streaming", "none"]), default=None,
                                 help="Hold each sequence's KV cache to --kv-budget tokens per KV head: h2o keeps "
                                      "the sinks, the recent tokens and the most attended ones, streaming the sinks "
                                      "and the newest; none: the full cache. Default: as the artifact was compiled.")),
            ("--kv-budget", dict(type=POSITIVE, default=None, metavar="TOKENS",
                                 help="KV entries a sequence keeps per layer and KV head under --kv-policy.")),
            ("--kv-recent", dict(type=NON_NEGATIVE, default=None, metavar="TOKENS",
                                 help="h2o: the newest tokens never evicted (default: half the budget less sinks).")),
            ("--kv-sinks", dict(type=NON_NEGATIVE, default=None, metavar="TOKENS",
                                help="The first tokens never evicted (default 4).")))):
        f = click.option(flag, **kwargs)(f)
    return f


def _kv_policy(kv_policy, kv_budget, kv_recent, kv_sinks) -> dict:
    """The engine options of the --kv-policy flags (none given: the artifact's policy)."""
    return {"kv_policy": kv_policy, "kv_budget": kv_budget, "kv_recent": kv_recent, "kv_sinks": kv_sinks}


def _invariant(value) -> bool | None:
    return None if value is None else value == "on"


@contextmanager
def _remeasuring(on: bool):
    """$LLMC_REMEASURE=1 inside (cached timings are measured again and replaced) where `on`."""
    before = os.environ.get(REMEASURE_ENV)
    if on:
        os.environ[REMEASURE_ENV] = "1"
    try:
        yield
    finally:
        if on and before is None:
            os.environ.pop(REMEASURE_ENV, None)
        elif on:
            os.environ[REMEASURE_ENV] = before


def speculative_options(f):
    f = click.option("--num-speculative-tokens", type=POSITIVE, default=None, metavar="K",
                     help="With --speculative: the most drafts verified per step (default 4).")(f)
    return click.option("--speculative", metavar="METHOD", default=None,
                        help="Speculative decoding: ngram (prompt lookup), ngram:tree=N (N prompt-lookup "
                             "candidates verified as one token tree; greedy requests) or draft:PATH (a draft "
                             "artifact, see `llmc compile --draft-of`).")(f)


def _whole_file_prompt(file) -> str:
    source = f"--prompt-file '{file.name}'"
    data = read_prompts(file, source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LlmcError(f"{source} is not UTF-8 text ({e.reason} at byte {e.start}); pass a text file") from None
    if "\0" in text or not text.strip():
        raise LlmcError(f"{source} {'holds a NUL byte' if text.strip() else 'is empty'}; pass a text file "
                        "holding the prompt")
    return text


def _speculative(method, num_tokens) -> dict | None:
    """EngineConfig.speculative from --speculative and --num-speculative-tokens."""
    if method is None:
        if num_tokens is not None:
            raise LlmcError("--num-speculative-tokens needs --speculative ngram or --speculative draft:PATH")
        return None
    config = speculative_config(method)
    if num_tokens is not None:
        config.num_speculative_tokens = num_tokens
    return vars(config)


def _threads(value) -> int:
    """The checked thread count, before anything loads."""
    return resolve_threads(value)


def _params(max_tokens, temperature, top_p, top_k, seed, stop):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed, stop=list(stop))


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", "-p", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompts-file", type=click.File("rb"), help="One prompt per line ('-' for stdin).")
@click.option("--prompt-file", type=click.File("rb"), multiple=True,
              help="A file whose whole text is one prompt, e.g. an article and a question (repeatable).")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the model's chat template.")
@click.option("--no-stream", is_flag=True, help="Print whole outputs at the end.")
@sampling_options
@structured_options
@device_option
@threads_option
@speculative_options
@ring_attention_option
@batch_invariant_option
@q4_activations_option
@kv_policy_options
def run(artifact, prompt, prompts_file, prompt_file, chat, no_stream, max_tokens, temperature, top_p, top_k, seed, stop,
        kv_memory, json_schema, regex, grammar, device, threads, speculative, num_speculative_tokens,
        ring_attention_threshold, batch_invariant, q4_activations, kv_policy, kv_budget, kv_recent, kv_sinks):
    """Generate from one prompt (streamed) or many (batched together). With --json-schema, --regex or
    --grammar the output is constrained to it."""
    threads = _threads(threads)
    structured = _structured_outputs(json_schema, regex, grammar)
    speculative = _speculative(speculative, num_speculative_tokens)
    prompts = [checked_text(p, f"--prompt {i}") for i, p in enumerate(prompt, 1)]
    if prompts_file:
        source = f"--prompts-file '{prompts_file.name}'"
        prompts += prompt_lines(read_prompts(prompts_file, source), source)
    prompts += [_whole_file_prompt(f) for f in prompt_file]
    if not prompts and not sys.stdin.isatty():
        prompts = stdin_prompts()
    if not prompts:
        raise LlmcError("no prompt given; pass --prompt TEXT, --prompts-file FILE, or pipe prompts on stdin")
    model = llmc.load(artifact, kv_memory=kv_memory, device=device, threads=threads, speculative=speculative,
                      ring_attention_threshold=ring_attention_threshold, batch_invariant=_invariant(batch_invariant),
                      q4_activations=q4_activations, **_kv_policy(kv_policy, kv_budget, kv_recent, kv_sinks))
    params = _params(max_tokens, temperature, top_p, top_k, seed, stop)
    params.structured_outputs = _compiled(model, structured)
    if chat:
        prompts = [model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    if len(prompts) == 1 and not no_stream:
        _echo_stream(model.stream(prompts[0], params))
        return
    for out in model.generate(prompts, params):
        click.echo(f"--- {out.prompt!r}\n{out.outputs[0].text}")


def _echo_stream(pieces) -> None:
    """Print text as it comes; the output ends with a newline however the stream ends (finished,
    refused midway, Ctrl-C), so the shell prompt or the error line starts on a line of its own."""
    try:
        for piece in pieces:
            click.echo(piece, nl=False)
    finally:
        click.echo()


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--system", default=None, help="System prompt.")
@sampling_options
@device_option
@threads_option
def chat(artifact, system, max_tokens, temperature, top_p, top_k, seed, stop, kv_memory, device, threads):
    """Interactive chat with the model's chat template, streaming replies. Ctrl-D ends."""
    model = llmc.load(artifact, kv_memory=kv_memory, device=device, threads=_threads(threads))
    params = _params(max_tokens, temperature, top_p, top_k, seed, stop)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            user = checked_text(chat_line(">>>"), "the line read from stdin")
        except (EOFError, click.Abort):
            click.echo()
            return
        except UnicodeDecodeError as e:
            raise LlmcError(f"the line read from stdin is not valid UTF-8 text ({e.reason} at byte "
                            f"{e.start}); type UTF-8 text") from None
        messages.append({"role": "user", "content": user})
        reply = ""
        for piece in model.stream(model.apply_chat_template(messages), params):
            reply += piece
            click.echo(piece, nl=False)
        click.echo()
        messages.append({"role": "assistant", "content": reply})


@cli.command()
@click.argument("artifact", type=click.Path(), required=False)
@click.option("--url", default=None, help="Instead of ARTIFACT: drive the `llmc serve` at this URL with the workload "
              "(streamed greedy completions, Poisson arrivals at --qps) and report client-side latencies.")
@click.option("--api-key", envvar="LLMC_API_KEY", default=None, help="With --url: the server's API key.")
@click.option("--num-requests", "-n", type=POSITIVE, default=64, show_default=True)
@click.option("--input-len", type=POSITIVE, default=128, show_default=True)
@click.option("--output-len", type=POSITIVE, default=128, show_default=True)
@click.option("--input-spread", type=FiniteFloat(0.0, 1.0, max_open=True), default=0.0, show_default=True,
              help="Prompt lengths uniform in len*(1±spread).")
@click.option("--output-spread", type=FiniteFloat(0.0, 1.0, max_open=True), default=0.0, show_default=True)
@click.option("--prefix-len", type=NON_NEGATIVE, default=0, show_default=True, help="Tokens every prompt shares.")
@click.option("--qps", default="inf", show_default=True, help="Poisson arrival rate; inf = all at once.")
@click.option("--seed", type=NON_NEGATIVE, default=0, show_default=True)
@click.option("--workload", "workload_kind", type=click.Choice(["random", "grounded", "open"]), default="random",
              show_default=True, help="random token ids of --input-len; grounded: answers that quote their prompt "
              "(code edits, quotes, summaries: samples/grounded.jsonl); open: stories and open questions "
              "(samples/open.jsonl). Text prompts keep their own length, and their requests end at EOS.")
@click.option("--ignore-eos", is_flag=True, help="Text workloads: generate --output-len tokens past EOS (random "
              "workloads always do: their prompts have no natural end).")
@click.option("--long-fraction", type=FiniteFloat(0.0, 1.0), default=0.0, show_default=True,
              help="Random workloads: this share of the requests have --long-input-len prompts (the rest "
              "--input-len); --url reports TTFT and TPOT per class.")
@click.option("--long-input-len", type=NON_NEGATIVE, default=0, show_default=True)
@click.option("--kv-memory", default="1GiB", show_default=True)
@click.option("--max-num-seqs", type=POSITIVE, default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=POSITIVE, default=None)
@click.option("--no-prefix-caching", is_flag=True)
@click.option("--baseline", default="none", show_default=True,
              help="none, hf (HF transformers in fp32 on the artifact's own weights, quantised ones dequantised), "
                   "or another artifact's path (e.g. the fp32 build of a quantised one) run on the same workload.")
@click.option("--baseline-batch-size", type=POSITIVE, default=None, help="HF batch size (default: all requests).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=click.Path(dir_okay=False), help="Write latency CDFs and throughput to this PNG.")
@click.option("--bandwidth", type=FiniteFloat(min=0.0, min_open=True), default=None, metavar="GBPS",
              help="Memory bandwidth for the roofline (default: measured once per machine and cached).")
@click.option("--gemm-peak", type=FiniteFloat(min=0.0, min_open=True), default=None, metavar="GFLOPS",
              help="fp32 GEMM peak for the roofline (default: measured once per machine and cached).")
@click.option("--remeasure", is_flag=True, help="Measure the bandwidth and GEMM peak again, and re-check the "
              "artifact's kernel choices on this machine, ignoring and refreshing what is cached (a figure "
              "measured on a busy machine is used once and not cached).")
@click.option("--repeat", type=POSITIVE, default=1, show_default=True,
              help="Run the workload (and the baseline, alternating with it) this many times and report the "
                   "median run of each: on a busy machine one run can be off by 2x.")
@device_option
@threads_option
@speculative_options
@ring_attention_option
@batch_invariant_option
@q4_activations_option
@kv_policy_options
def bench(artifact, url, api_key, num_requests, input_len, output_len, input_spread, output_spread, prefix_len, qps,
          seed, workload_kind, ignore_eos, long_fraction, long_input_len, kv_memory, max_num_seqs,
          max_num_batched_tokens, no_prefix_caching, baseline, baseline_batch_size, as_json, plot, bandwidth,
          gemm_peak, remeasure, repeat, device, threads, speculative, num_speculative_tokens,
          ring_attention_threshold, batch_invariant, q4_activations, kv_policy, kv_budget, kv_recent, kv_sinks):
    """Benchmark ARTIFACT on a synthetic workload; optionally against HF transformers. With
    --speculative, the same workload runs first without it, and the JSON's "speculative" holds the
    acceptance figures and the speedup."""
    from llmc.runtime import memory_report  # bench's stack (the engine ~0.2 s): not for `llmc --help`
    from llmc.runtime.engine import Engine, EngineConfig  # the same
    from llmc.runtime.parallel.report import rank_report  # the same
    from llmc.runtime.roofline import bench_roofline  # the same
    from llmc.tools.bench import (  # the same
        Workload,
        hf_model_from_artifact,
        median_run,
        run_engine,
        run_engine_repeated,
        run_hf_baseline,
        speculative_summary,
        warm_up,
    )

    threads = _threads(threads)
    try:
        qps_value = float(qps)
    except ValueError:
        raise LlmcError(f"--qps {qps!r} is not a number; use e.g. 4 or inf") from None
    if url is not None or artifact is None:
        return _bench_url(url, artifact, api_key, workload_kind, as_json, qps,
                          Workload(num_requests, input_len, output_len, input_spread, output_spread, prefix_len,
                                   qps_value, seed, long_fraction=long_fraction, long_input_len=long_input_len))
    if plot:
        from llmc.tools.bench_plot import check_plot_path  # matplotlib: ~0.2 s; only --plot
        check_plot_path(plot)
    speculative = _speculative(speculative, num_speculative_tokens)
    if speculative is not None and repeat > 1:
        raise LlmcError("--repeat does not combine with --speculative (which already runs the workload twice); "
                        "repeat the command instead")
    workload = Workload(num_requests, input_len, output_len, input_spread, output_spread, prefix_len,
                        qps_value, seed, workload_kind, ignore_eos, long_fraction, long_input_len)
    with _remeasuring(remeasure):
        engine = Engine(artifact, EngineConfig(kv_memory=kv_memory, max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               enable_prefix_caching=not no_prefix_caching, device=device,
                                               threads=threads, ring_attention_threshold=ring_attention_threshold,
                                               batch_invariant=_invariant(batch_invariant),
                                               q4_activations=q4_activations,
                                               recheck_kernels=True if remeasure else None,
                                               **_kv_policy(kv_policy, kv_budget, kv_recent, kv_sinks)),
                        choose_plan=run_site_plan)
    requests = workload.build(engine.model["vocab_size"], engine.tokenizer)
    plain = None
    warm_up(engine)
    if speculative is not None:
        plain, engine = run_engine(engine, requests, progress=not as_json), None   # one model in memory at a time
        engine = Engine(artifact, EngineConfig(kv_memory=kv_memory, max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               enable_prefix_caching=not no_prefix_caching, device=device,
                                               threads=threads, speculative=speculative,
                                               ring_attention_threshold=ring_attention_threshold,
                                               batch_invariant=_invariant(batch_invariant),
                                               q4_activations=q4_activations,
                                               **_kv_policy(kv_policy, kv_budget, kv_recent, kv_sinks)),
                        choose_plan=run_site_plan)
        warm_up(engine)
    base, base_name, base_runs, hf_model = None, baseline, [], None
    if baseline == "hf":   # built first, so that its runs alternate with the engine's
        hf_model, base_name = hf_model_from_artifact(engine), baseline_name(engine.executor.plan)
        pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else engine.eos_token_ids[0]
    hf_run = None if hf_model is None else lambda: base_runs.append(run_hf_baseline(
        hf_model, requests, pad, engine.eos_token_ids, baseline_batch_size, progress=not as_json))
    runs = run_engine_repeated(engine, requests, repeat, progress=not as_json, after_each=hf_run)
    ours = median_run(runs)
    result = {**ours.to_dict(), "workload": vars(workload) | {"qps": qps}, "threads": threads,
              "memory": memory_report.measure(engine).to_dict(),   # this process's RSS split, after the runs
              "native_kernels": _native_kernels(engine) if engine.device.type == "cpu" else None,
              "batch_invariant": engine.executor.invariance() if engine.device.type == "cpu" else None,
              # what the load re-checked of the kernel choices on this machine (compiler/driver/tuning/run_site.py)
              "kernel_recheck": (engine.executor.plan.meta.get("kernel_choice") or {}).get("run_site"),
              "ranks": rank_report(engine),   # a tensor-parallel artifact's ranks: memory, time in collectives
              "speculative": speculative_summary(engine, ours, plain) if plain else None,
              # CPU peaks: a GPU run's roofline would need the GPU's, which are not measured here
              "roofline": bench_roofline(engine, ours, threads, bandwidth, gemm_peak, remeasure)
              if engine.device.type == "cpu" else None}
    if baseline not in ("hf", "none"):
        del engine   # one model in memory at a time
        other = Engine(baseline, EngineConfig(kv_memory=kv_memory, max_num_seqs=max_num_seqs,
                                              max_num_batched_tokens=max_num_batched_tokens,
                                              enable_prefix_caching=not no_prefix_caching, device=device,
                                              threads=threads), choose_plan=run_site_plan)
        warm_up(other)
        base_runs = run_engine_repeated(other, requests, repeat, progress=not as_json)
    if repeat > 1:
        result["repeats"] = {"output_tokens_per_s": [r.output_tokens_per_s for r in runs],
                             "baseline_output_tokens_per_s": [r.output_tokens_per_s for r in base_runs] or None}
    if base_runs:
        base = median_run(base_runs)
        result["baseline"] = {**base.to_dict(), "name": base_name}
        result["ratio"] = ours.output_tokens_per_s / base.output_tokens_per_s
    # the results first: a plot that fails to save must not lose the run
    click.echo(json.dumps(result, indent=2, sort_keys=True, default=str) if as_json else _bench_table(result))
    if plot:
        from llmc.tools.bench_plot import plot_bench  # matplotlib: ~0.2 s; only --plot
        plot_bench(ours, plot, base, title=f"llmc bench: {artifact}",
                   baseline_name="HF" if base_name == "hf" else base_name)


def _bench_url(url, artifact, api_key, workload_kind, as_json, qps, workload) -> None:
    """`llmc bench --url`: the workload against a running server; only the workload options apply."""
    from llmc.tools.bench_http import format_http_bench, run_http, served_model  # httpx, asyncio: ~0.1 s; bench --url

    if url is None:
        raise LlmcError("bench needs ARTIFACT (run it here) or --url URL (drive a running `llmc serve`)")
    if artifact is not None:
        raise LlmcError(f"bench got both ARTIFACT {artifact!r} and --url {url}; give one of them")
    if workload_kind != "random":
        raise LlmcError("--url takes --workload random only: text workloads need the model's tokenizer here")
    model, vocab_size = served_model(url, api_key)
    result = run_http(url, model, workload.build(vocab_size), api_key) | {"workload": vars(workload) | {"qps": qps}}
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_http_bench(result))


def _native_kernels(engine) -> str:
    """The native kernels' status, how the GEMVs round activations (int8 codes for the 4-bit ones where the
    artifact or load asks, else int16), and how much of the weights the decode program streams sits on huge
    pages."""
    from llmc.codegen.native import cpu_native  # ~12 ms; only bench
    executor = getattr(engine, "executor", None)
    program = getattr(executor, "native_decode", None)
    parts = [cpu_native.status()]
    if cpu_native.int16_activations():
        q4 = getattr(executor, "q4_activations", "int16")
        parts.append("int8 GEMVs on int16 activations, 4-bit ones on " +
                     ("int8 activations (llama.cpp's Q8 rounding)" if q4 == "int8" else "int16 activations"))
    if program is not None and program.huge_page_bytes:
        parts.append(f"{program.huge_page_bytes / 2**20:.0f} MiB of weights on huge pages")
    return ", ".join(parts)


def _window_lines(w: dict | None) -> list[str]:
    if not w:
        return []
    return [f"sliding window    {w['window']} tokens: {w['blocks_dropped']} KV blocks dropped, at most "
            f"{w['peak_blocks_dropped']} at once ({w['peak_bytes_saved'] / 2**20:.2f} MiB)"]


def _kv_held_lines(k: dict | None) -> list[str]:
    if not k:
        return []
    return [f"KV per sequence   {k['mean_bytes'] / 2**20:.2f} MiB mean, {k['max_bytes'] / 2**20:.2f} MiB max at "
            f"its most (the full cache: {k['full_cache_mean_bytes'] / 2**20:.2f} MiB mean); KV policy {k['policy']}"]


def _policy_line(sp: dict) -> str:
    """The speculation policy's decisions: steps that verified drafts, and why sequences decoded plainly."""
    steps = sp.get("steps_speculated", 0) + sp.get("steps_plain", 0)
    aside = ", ".join(f"{why} {n}" for why, n in sorted((sp.get("stood_aside") or {}).items(), key=lambda x: -x[1]))
    return (f"  policy          speculated in {sp.get('steps_speculated', 0)} of {steps} decode steps; "
            f"stood aside (sequence-steps): {aside or 'never'}")


def _bench_table(r: dict) -> str:
    from llmc.runtime.memory_report import memory_line  # bench's stack: not for `llmc --help`
    from llmc.runtime.parallel.report import format_ranks  # the same
    from llmc.runtime.roofline import format_roofline  # the same
    from llmc.tools.bench_http import latency_lines, percentile_cells  # httpx and asyncio: ~0.1 s

    lines = [*latency_lines(r),
             f"peak KV usage     {r['peak_kv_usage']:.1%}   KV waste {r['kv_waste']:.2%}",
             f"prefix hit rate   {r['prefix_hit_rate']:.1%}   preemptions {r['preemptions']}",
             *_window_lines(r.get("kv_window")),
             *_kv_held_lines(r.get("kv_per_seq")),
             f"threads           {r['threads']}",
             *([f"memory            {memory_line(r['memory'])}"] if r.get("memory") else []),
             *([f"native kernels    {r['native_kernels']}"] if r.get("native_kernels") else []),
             *([f"batch invariance  {r['batch_invariant']}"] if r.get("batch_invariant") else []),
             *(format_roofline(r["roofline"]) if r["roofline"] else []),
             *format_ranks(r["ranks"])]
    if r["speculative"]:
        sp = r["speculative"]
        lines += [f"speculative       {sp['method']}: {sp['speedup']:.2f}x output tokens/s over plain decoding "
                  f"({sp['plain_output_tokens_per_s']:.1f}), acceptance {sp['acceptance_rate'] or 0:.1%}, "
                  f"mean accepted length {sp['mean_accepted_length'] or 0:.2f}, same tokens as plain "
                  f"{'yes' if sp['same_tokens_as_plain'] else 'NO'}", _policy_line(sp)]
    if "baseline" in r:
        b = r["baseline"]
        name = "HF" if b["name"] == "hf" else b["name"]
        lines += [f"baseline          {name}: {b['output_tokens_per_s']:.1f} output tokens/s, "
                  f"{b['requests_per_s']:.2f} req/s, TPOT ms {percentile_cells(b['tpot_ms'])}",
                  f"ratio             {r['ratio']:.2f}x output tokens/s (ours / baseline)"]
    if r.get("repeats"):
        runs = r["repeats"]
        lines.append(f"repeats           {len(runs['output_tokens_per_s'])} runs, the median shown: output tokens/s "
                     + " / ".join(f"{x:.1f}" for x in runs["output_tokens_per_s"])
                     + ("" if not runs["baseline_output_tokens_per_s"] else
                        "; baseline " + " / ".join(f"{x:.1f}" for x in runs["baseline_output_tokens_per_s"])))
    return "\n".join(lines)


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--format", "format_", type=click.Choice(["onnx"]), default="onnx", show_default=True,
              help="Export format.")
@click.option("--output", "-o", required=True, help="Directory to write (model.onnx, tokenizer/, llmc_onnx.json).")
@click.option("--force", is_flag=True, help="Replace a previous export at --output.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr; print only the result.")
def export(artifact, format_, output, force, quiet):
    """Export ARTIFACT as a standalone model: ONNX that plain onnxruntime runs, with past/present KV."""
    with _sigterm_exits():
        path = export_api(artifact, format=format_, output=output, force=force, quiet=quiet)
    click.echo(f"wrote {path}/model.onnx")


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="LLMC_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1 routes (default: $LLMC_API_KEY, else no key).")
@click.option("--served-model-name", default=None, help="The model's name in the API (default: the artifact's "
              "directory name without .llmc).")
@click.option("--max-queue", type=POSITIVE, default=256, show_default=True,
              help="Requests waiting for the engine before more are refused with 429 and Retry-After.")
@click.option("--ttft-slo-ms", type=FiniteFloat(min=0.0, min_open=True), default=None,
              help="Time-to-first-token SLO: a request predicted to miss it (from the prompt tokens queued "
                   "ahead and the measured prefill speed) is refused at once with 429 and Retry-After, "
                   "rather than queued by deadline.")
@click.option("--max-num-seqs", type=POSITIVE, default=64, show_default=True,
              help="Requests in the engine at once; the rest wait in the server's fair queue.")
@click.option("--shutdown-timeout", type=FiniteFloat(min=0.0), default=30.0, show_default=True,
              help="On SIGTERM, seconds running requests may finish before they are aborted.")
@click.option("--kv-memory", default="1GiB", show_default=True, help="KV cache budget.")
@click.option("--max-request-bytes", type=POSITIVE, default=8 << 20, show_default=True,
              help="A request body over this many bytes is refused (413) before it is read.")
@click.option("--max-n", type=POSITIVE, default=16, show_default=True,
              help="The most choices (n, best_of) one request may ask for; more is a 400.")
@click.option("--metrics-need-key", is_flag=True,
              help="/metrics needs the --api-key too (by default it is open to Prometheus, as vLLM's).")
@click.option("--result-cache", default=None, metavar="SIZE",
              help="Keep up to SIZE (256MiB, ...) of results whose output is determined (greedy or seeded) and "
                   "answer a repeated request from them (header X-Cache: hit). Off by default.")
@click.option("--result-cache-ttl", type=FiniteFloat(min=0.0, min_open=True), default=None, metavar="SECONDS",
              help="Seconds a cached result stays valid (default: until evicted).")
@click.option("--semantic-cache-threshold", type=FiniteFloat(min=0.0, max=1.0, min_open=True), default=None,
              metavar="COSINE", help="Answer requests sent with \"semantic_cache\": true from the result of an "
              "earlier one whose text is this close in meaning (cosine of the model's own hidden states; on "
              "docs/benchmarks.md's paraphrase set 0.98 hit half the paraphrases and 3 of 20 different "
              "questions). Off by default.")
@click.option("--semantic-cache-entries", type=POSITIVE, default=10_000, show_default=True,
              help="Results the semantic cache keeps (the oldest goes first).")
@click.option("--disaggregate", default=None, metavar="prefill:P,decode:D",
              help="Run prefill and decode in engine processes of their own (P and D of them, --threads split "
                   "between them, --kv-memory and --max-num-seqs each), the KV blocks of each request moved "
                   "from one to the other after its first token (docs/disaggregated_serving.md).")
@device_option
@threads_option
@speculative_options
@q4_activations_option
@kv_policy_options
def serve(artifact, host, port, api_key, served_model_name, max_queue, ttft_slo_ms, max_num_seqs, shutdown_timeout,
          kv_memory, max_request_bytes, max_n, metrics_need_key, result_cache, result_cache_ttl,
          semantic_cache_threshold, semantic_cache_entries, disaggregate, device, threads, speculative,
          num_speculative_tokens, q4_activations, kv_policy, kv_budget, kv_recent, kv_sinks):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions),
    with /health and Prometheus /metrics. Requests leave the queue by priority, then fairly between
    `user`s (weighted fair queueing on tokens). SIGTERM drains: admission stops, running requests get
    --shutdown-timeout seconds, the rest end with finish_reason "abort"."""
    from llmc.runtime.server.launch import serve as serve_artifact  # fastapi, uvicorn: ~0.6 s; only serve

    serve_artifact(artifact, host, port, api_key=api_key, max_queue=max_queue, ttft_slo_ms=ttft_slo_ms,
                   served_model_name=served_model_name, shutdown_timeout=shutdown_timeout, kv_memory=kv_memory,
                   max_request_bytes=max_request_bytes, max_n=max_n, metrics_need_key=metrics_need_key,
                   result_cache=result_cache, result_cache_ttl=result_cache_ttl,
                   semantic_cache_threshold=semantic_cache_threshold, semantic_cache_entries=semantic_cache_entries,
                   disaggregate=disaggregate, device=device,
                   threads=_threads(threads), max_num_seqs=max_num_seqs,
                   speculative=_speculative(speculative, num_speculative_tokens), q4_activations=q4_activations,
                   **_kv_policy(kv_policy, kv_budget, kv_recent, kv_sinks))


@cli.command("eval")
@click.argument("artifact", type=click.Path())
@click.option("--text", "text_file", type=click.Path(dir_okay=False),
              help="UTF-8 text to score (default: samples/eval.txt of the source checkout).")
@click.option("--ref", type=click.Path(),
              help="Reference artifact: also report KL(ref || ours) and top-1 agreement.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=4096, show_default=True,
              help="Score the text's first N tokens.")
@click.option("--context", type=POSITIVE, default=512, show_default=True, help="Tokens per window.")
@click.option("--stride", type=POSITIVE, default=256, show_default=True,
              help="Tokens between window starts; each later window scores its last STRIDE.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar; print only the result.")
@device_option
@threads_option
@kv_policy_options
def eval_command(artifact, text_file, ref, max_tokens, context, stride, as_json, quiet, device, threads, kv_policy,
                 kv_budget, kv_recent, kv_sinks):
    """Perplexity of ARTIFACT on a text: windows of 512 tokens, stride 256, each token scored once. With
    --kv-policy, ARTIFACT runs through the engine with that KV policy, each window prefilled chunk by chunk
    with the policy's evictions between chunks (the --ref keeps the full cache)."""
    # the executor: ~0.2 s; only eval
    from llmc.tools.evaluate import DEFAULT_TEXT, evaluate_text, format_summary, read_eval_text

    apply_threads(_threads(threads))
    text = read_eval_text(text_file)
    policy = None if kv_policy is None else _kv_policy(kv_policy, kv_budget, kv_recent, kv_sinks)
    if policy is None and (kv_budget, kv_recent, kv_sinks) != (None, None, None):
        raise LlmcError("--kv-budget, --kv-recent and --kv-sinks need --kv-policy h2o or streaming")
    result = evaluate_text(artifact, text, ref=ref, max_tokens=max_tokens, progress=not quiet, device=device,
                           context=context, stride=stride, kv_policy=policy)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        click.echo(format_summary(result, artifact, text_file or str(DEFAULT_TEXT), ref))


from llmc.cli_distill import distill_command  # noqa: E402  (its module makes the flags from the options)

cli.add_command(distill_command)


# Bare `llmc` raises this (click >= 8.2) to show the help, which is what the user asked for.
_SHOW_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


@cli.group()
def cache():
    """What llmc keeps on this machine ($LLMC_CACHE, else ~/.cache/llmc): kernel timings, the
    roofline's peaks, built kernels, the sample model."""


@cache.command("info")
@click.option("--json", "as_json", is_flag=True)
def cache_info_command(as_json):
    """Where each part of the cache is, its size, and when and under what load its measurements were taken."""
    entries = cache_info()
    if as_json:
        click.echo(json.dumps({"root": str(cache_root()), "entries": entries}, indent=2, sort_keys=True))
        return
    click.echo(f"cache {cache_root()}")
    for e in entries:
        click.echo(f"  {e['name']:<16} {e['files']:>5} files {e['bytes'] / 2**20:>9.1f} MiB  {e['what']}")
        measured = e.get("measured") or []
        if measured:
            click.echo(f"  {'':<16} {_measured_line(measured)}")


def _measured_line(records: list[dict]) -> str:
    """When and under what load the cached measurements `records` were taken, in one line."""
    times = sorted(r.get("at", "?") for r in records)
    others = [r["other_cores"] for r in records if r.get("other_cores") is not None]
    load = f"other processes at most {max(others):.1f} cores" if others else "other processes' share unknown"
    return (f"measured {times[0]} to {times[-1]}, {load}, load average at most "
            f"{max(r.get('loadavg', 0.0) for r in records):.1f}")


@cache.command("build")
def cache_build_command():
    """Build this machine's native CPU kernels into the cache now (`make setup` does): otherwise the
    first compile or load builds them (8-11 s of C compiling on 2 cores, beside its own work)."""
    from llmc.codegen.native import cpu_native
    click.echo(f"native kernels: {cpu_native.status()}")


@cache.command("clear")
@click.argument("what", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Everything, built kernels and the sample model too.")
def cache_clear_command(what, everything):
    """Remove WHAT (names from `llmc cache info`; default: the measurements, kernel timings and
    bandwidth.json) from the cache; they are measured or built again when next needed."""
    removed = clear_cache(list(ENTRIES) if everything else list(what) or None)
    click.echo("\n".join(f"removed {p}" for p in removed) or "nothing to remove")


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="llmc", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except _SHOW_HELP as e:
        e.show()
        sys.exit(2)
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx else "llmc"
        _fail(f"{e.format_message().rstrip('.')}; see `{command} --help`")
    except click.ClickException as e:
        _fail(e.format_message())
    except LlmcError as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        sys.exit(130)
    if argv is None and sys.argv[1:2] == ["compile"]:
        _end_without_teardown()


def _end_without_teardown() -> None:
    """End a finished `llmc compile` process without the interpreter's teardown, which spends
    seconds (a tenth of a compile) collecting every object of torch's and transformers' modules
    and writes nothing; exit handlers run and output is flushed first, and a compile leaves no
    thread at work."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
