"""The `llmc` command line as the issue lists it: targets, compile (from a sample and from an HF
checkpoint, with the pipeline flags), inspect, and run (streamed, batched, stdin, chat). The
console script runs as a real subprocess for compile, run, targets and inspect; the variations
run `llmc.cli.main` in-process, which saves a torch import each."""

import ast
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from llmc_cli import llmc_in_process
from safetensors import safe_open

import llmc
from llmc import SamplingParams
from llmc.cli import main
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import read_artifact
from llmc.compiler.frontends import load_model
from llmc.compiler.pipeline import full_pipeline
from llmc.compiler.targets import TARGETS, get_target
from llmc.passes.lowering import LOWERING
from llmc.runtime.executor import PlanExecutor

LLMC = Path(sys.executable).parent / "llmc"
ISSUE_TARGETS = ["cpu", "cpu-bf16", "h100-fp8", "h100-bf16", "a100-bf16", "a100-int8", "rtx4090-int4", "orin-int4"]
CPU_PIPELINE = list(get_target("cpu").default_pipeline)   # cleanup, then the fusions
GREEDY_8 = ["--max-tokens", "8", "--temperature", "0"]


def llmc_process(*args) -> subprocess.CompletedProcess:
    """The console script as a user runs it: real exit code, real stdout and stderr."""
    return subprocess.run([str(LLMC), *map(str, args)], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)




@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """`llmc compile tiny-llama --target cpu -o X`, once for the module."""
    path = tmp_path_factory.mktemp("cli") / "tiny.llmc"
    result = llmc_process("compile", "tiny-llama", "--target", "cpu", "-o", path)
    assert result.returncode == 0, result.stderr
    return path, result


@pytest.fixture(scope="module")
def artifact(compiled):
    return compiled[0]


@pytest.fixture(scope="module")
def model(artifact):
    return llmc.load(artifact)


def greedy_text(model, prompt) -> str:
    return model.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text


def manifest_of(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def run_plan(path: Path, token_ids: torch.Tensor) -> torch.Tensor:
    """logits [tokens, vocab] of the artifact's plan on one sequence, every row selected."""
    art = read_artifact(path)
    executor = PlanExecutor(Plan.from_json(art.plan_json), art.weights, data=art.data)
    positions = torch.arange(len(token_ids))
    return executor.run_values({"input_ids": token_ids, "positions": positions,
                                "logits_indices": positions})["logits"]


# -- targets ---------------------------------------------------------------------------------
def test_targets_lists_every_target_with_its_facts_and_default_pipeline():
    result = llmc_process("targets")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sorted(TARGETS) == sorted(ISSUE_TARGETS)
    for name in ISSUE_TARGETS:
        t = TARGETS[name]
        [index] = [i for i, line in enumerate(lines) if line.startswith(f"{name}: ")]
        facts = lines[index]
        assert t.arch in facts and f"{t.memory_bytes / 2**30:.0f} GiB" in facts
        assert f"{t.bandwidth_bytes_per_s / 1e9:.1f} GB/s" in facts and f"weights {t.weight_dtype}" in facts
        assert lines[index + 1].strip() == f"pipeline: {', '.join(full_pipeline(t))}"


def test_targets_json_is_every_targets_full_record():
    result = llmc_process("targets", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert sorted(listed) == sorted(ISSUE_TARGETS)
    assert listed["cpu"]["default_pipeline"] == CPU_PIPELINE
    assert listed["h100-fp8"]["peak_tflops"]["fp8"] == 1979.0 and listed["h100-fp8"]["arch"] == "sm_90"
    for name, record in listed.items():
        assert record == json.loads(json.dumps(TARGETS[name].to_dict()))


# -- compile and inspect ---------------------------------------------------------------------
def test_compile_writes_an_artifact_and_prints_its_summary(compiled):
    path, result = compiled
    assert (path / "manifest.json").is_file() and (path / "weights.safetensors").is_file()
    assert result.stdout.startswith(f"artifact {path}: tiny-llama (LlamaForCausalLM) for target cpu")
    assert manifest_of(path)["target"]["name"] == "cpu"


def graph_op_counts(path: Path) -> dict[str, int]:
    return dict(Counter(node["op"] for node in json.loads((path / "graph.json").read_text())["nodes"]))


def stored_weight_bytes(path: Path) -> int:
    with safe_open(path / "weights.safetensors", "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


def test_inspect_shows_op_counts_pass_log_and_memory(artifact):
    result = llmc_process("inspect", artifact)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    [ops_line] = [line for line in text.splitlines() if line.strip().startswith("ops:")]
    fused = {"flash_attention": 2, "add_rms_norm": 4, "rms_norm": 1, "swiglu": 2, "embedding": 1}
    assert fused.items() <= graph_op_counts(artifact).items()
    for op, count in graph_op_counts(artifact).items():
        assert f"{op} {count}" in ops_line
    passes = text.split("  passes:\n")[1].splitlines()
    assert [line.split()[0] for line in passes] == CPU_PIPELINE
    assert all(line.split()[1] == "matches" and int(line.split()[2]) >= 0 for line in passes)
    # tiny-llama: 2 layers x 2 KV heads x head_dim 16, K and V, float32
    assert "KV cache: 512 bytes/token" in text
    assert "activations: peak" in text and "weights: float32" in text


def test_inspect_json_has_the_machine_readable_figures(artifact):
    result = llmc_process("inspect", artifact, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"target", "op_counts", "weight_bytes", "kv_bytes_per_token", "activation_peak_bytes",
            "passes"} <= set(report)
    assert report["target"] == "cpu"
    assert report["op_counts"] == graph_op_counts(artifact)
    assert report["weight_bytes"] == {"float32": stored_weight_bytes(artifact)}
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert 0 < report["activation_peak_bytes"] <= report["activation_naive_bytes"]
    assert [p["name"] for p in report["passes"]] == CPU_PIPELINE
    assert report["passes"] == manifest_of(artifact)["pipeline"]   # compile timings are no part of it


# -- run -------------------------------------------------------------------------------------
def test_run_streams_one_prompts_greedy_completion(artifact, model):
    result = llmc_process("run", artifact, "--prompt", "The river", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    want = greedy_text(model, "The river")
    assert want and result.stdout == want + "\n"


class WriteLog(io.StringIO):
    """stdout that remembers each write, to see text arrive piece by piece."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_run_writes_one_prompts_text_as_it_is_generated(artifact, model, monkeypatch):
    stdout = WriteLog()
    monkeypatch.setattr(sys, "stdout", stdout)
    main(["run", str(artifact), "--prompt", "hello", *GREEDY_8])
    pieces = [w for w in stdout.writes if w]
    assert len(pieces) > 2 and pieces[-1] == "\n"
    assert "".join(pieces) == greedy_text(model, "hello") + "\n"


def batch_outputs(stdout: str) -> dict[str, str]:
    """`--- 'prompt'\\ntext` blocks -> {prompt: text}."""
    pairs = [block.split("\n", 1) for block in stdout.split("--- ")[1:]]
    return {ast.literal_eval(prompt): text.removesuffix("\n") for prompt, text in pairs}


def test_run_batches_the_prompts_of_a_file(artifact, model, tmp_path, capsys):
    prompts = ["hello", "The weather changed", "one, two, three"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(prompts) + "\n\n")
    code, out, err = llmc_in_process(capsys, "run", artifact, "--prompts-file", prompts_file, *GREEDY_8)
    assert code == 0, err
    assert batch_outputs(out) == {p: greedy_text(model, p) for p in prompts}


def test_run_reads_prompts_piped_on_stdin(artifact, model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nA small town\n"))
    code, out, err = llmc_in_process(capsys, "run", artifact, *GREEDY_8)
    assert code == 0, err
    assert batch_outputs(out) == {p: greedy_text(model, p) for p in ["hello", "A small town"]}


def test_run_chat_wraps_the_prompt_in_the_chat_template(artifact, model, capsys):
    code, out, err = llmc_in_process(capsys, "run", artifact, "--chat", "--prompt", "hi", *GREEDY_8)
    assert code == 0, err
    templated = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert templated == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out == greedy_text(model, templated) + "\n"
    assert out != greedy_text(model, "hi") + "\n"


# -- compile from an HF checkpoint and with pipeline flags -----------------------------------
def test_compile_from_an_hf_checkpoint_gives_the_samples_logits(artifact, tmp_path, capsys):
    tiny = load_model("tiny-llama")
    checkpoint = tmp_path / "tiny-hf"
    tiny.module.save_pretrained(checkpoint, safe_serialization=True)
    tiny.tokenizer.save_pretrained(checkpoint)
    capsys.readouterr()
    output = tmp_path / "hf.llmc"
    code, _, err = llmc_in_process(capsys, "compile", checkpoint, "--target", "cpu", "-o", output)
    assert code == 0, err
    assert manifest_of(output)["model"]["source_kind"] == "hf"
    token_ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(7))
    from_hf = run_plan(output, token_ids)
    torch.testing.assert_close(from_hf, run_plan(artifact, token_ids), rtol=0, atol=0)
    with torch.no_grad():
        reference = tiny.module(token_ids[None]).logits[0]
    torch.testing.assert_close(from_hf, reference, rtol=1e-4, atol=1e-4)


def test_print_ir_after_and_dump_ir_show_the_graph_around_passes(tmp_path, capsys):
    dump = tmp_path / "ir"
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "-o", tmp_path / "x.llmc", "-q",
                                   "--print-ir-after", "dce", "--dump-ir", dump)
    assert code == 0, err
    steps = LOWERING + CPU_PIPELINE   # lowering's steps are passes too
    assert err.count("// IR after") == steps.count("dce") and "// IR after dce\n" in err
    dumped = [f"{i:02d}_{name}.{when}.txt" for i, name in enumerate(steps, 1)
              for when in ("before", "after")]
    assert sorted(p.name for p in dump.iterdir()) == sorted(dumped)
    after_dce = (dump / f"{len(LOWERING) + 3:02d}_dce.after.txt").read_text()
    assert "attention" in after_dce and after_dce in err


@pytest.mark.parametrize("flags, pipeline", [
    (["--passes", "dce,remove_noops"], [("dce", {}), ("remove_noops", {})]),
    (["--disable-pass", "fold_constants"], [(p, {}) for p in CPU_PIPELINE if p != "fold_constants"]),
    (["--pass-option", "fold_constants.max_growth=4"],
     [(p, {"max_growth": 4.0} if p == "fold_constants" else {}) for p in CPU_PIPELINE]),
], ids=["passes", "disable-pass", "pass-option"])
def test_pipeline_flags_are_recorded_in_the_manifest(flags, pipeline, tmp_path, capsys):
    out = tmp_path / "x.llmc"
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "-o", out, "-q", *flags)
    assert code == 0, err
    recorded = manifest_of(out)["pipeline"]
    assert [(p["name"], p["options"]) for p in recorded] == pipeline
    code, report, err = llmc_in_process(capsys, "inspect", out, "--json")
    assert code == 0, err
    assert [(p["name"], p["options"]) for p in json.loads(report)["passes"]] == pipeline
