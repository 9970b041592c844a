"""Inputs that are too big, too deep or of the wrong kind: a prompts file, stdin, --prompt-file,
--text or --calib past the input cap (/dev/zero among them, refused while reading, not after);
manifest.json or a re-hashed plan.json nested 100,000 deep; a tokenizer that is not JSON, maps to
custom code or does not fit the model's embedding; chat templates the Jinja sandbox stops; a path
that exists but is no artifact or model. Each is one `llmc: error:` line, exit 2, and writes
nothing: the working directory stays empty and the artifact as it was."""

import errno
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.compiler import bounded_input
from llmc.compiler.calibration import read_calib_bytes
from llmc.errors import ArtifactError, LlmcError, PassError

LLMC = Path(sys.executable).parent / "llmc"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    # torch kernels throughout: `--kernels auto` may put the norms tampered below inside ONNX Runtime segments
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("art") / "tiny.llmc", kernels="cpu")


def snapshot(*roots: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in root.rglob("*")}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty working directory that must stay empty."""
    directory = tmp_path / "work"
    directory.mkdir()
    monkeypatch.chdir(directory)
    yield directory
    assert list(directory.iterdir()) == []


def refused(capfd, *args) -> str:
    code, out, err = llmc_in_process(capfd, *args)
    assert code == 2 and out == "", (code, out, err)
    return error_line(err)


def tampered(artifact: Path, tmp_path: Path, edit) -> Path:
    """A copy of the artifact edited by `edit(copy)`, every listed (or added) file re-hashed: what a
    tamperer who also rewrites the manifest hands over."""
    copy = tmp_path / "tampered.llmc"
    shutil.copytree(artifact, copy)
    edit(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"] = {name: digest for name, digest in manifest["files"].items() if (copy / name).is_file()}
    for file in sorted(p for p in copy.rglob("*") if p.is_file() and p.name != "manifest.json"):
        manifest["files"][file.relative_to(copy).as_posix()] = hashlib.sha256(file.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


# --- size caps --------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--prompts-file", "--prompt-file"])
def test_dev_zero_as_a_prompts_file_is_refused_at_the_input_cap(artifact, work, capfd, option):
    line = refused(capfd, "run", artifact, option, "/dev/zero")
    assert f"{option} '/dev/zero' is larger than 64 MiB" in line and "LLMC_MAX_INPUT_BYTES" in line


def test_a_prompts_file_over_a_lowered_cap_is_refused_and_one_under_it_runs(artifact, work, capfd, monkeypatch,
                                                                          tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nagain\n")
    monkeypatch.setenv("LLMC_MAX_INPUT_BYTES", "10")
    assert "is larger than 10 bytes" in refused(capfd, "run", artifact, "--prompts-file", prompts)
    monkeypatch.setenv("LLMC_MAX_INPUT_BYTES", "100")
    code, out, _ = llmc_in_process(capfd, "run", artifact, "--prompts-file", prompts, "--max-tokens", "2")
    assert code == 0 and out.count("--- ") == 2


def test_stdin_past_the_cap_is_refused(artifact, work, capfd, monkeypatch):
    class Stdin(io.TextIOWrapper):
        def isatty(self):
            return False
    monkeypatch.setenv("LLMC_MAX_INPUT_BYTES", "1000")
    monkeypatch.setattr("sys.stdin", Stdin(io.BytesIO(b"a prompt\n" * 1000)))
    assert refused(capfd, "run", artifact).startswith("stdin is larger than 1000 bytes")


def test_an_unusable_cap_value_is_refused(artifact, work, capfd, monkeypatch):
    monkeypatch.setenv("LLMC_MAX_INPUT_BYTES", "lots")
    assert "LLMC_MAX_INPUT_BYTES='lots' is not a positive number of bytes" in refused(
        capfd, "run", artifact, "--prompt-file", "/dev/zero")


def test_eval_text_past_the_cap_is_refused(artifact, work, capfd):
    refusal = refused(capfd, "eval", artifact, "--text", "/dev/zero")
    assert "evaluation text '/dev/zero' is larger than 64 MiB" in refusal


def test_calibration_text_past_the_cap_is_refused_while_reading(monkeypatch):
    with pytest.raises(PassError, match=r"calibration file '/dev/zero' is larger than 64 MiB"):
        read_calib_bytes(Path("/dev/zero"))
    monkeypatch.setenv("LLMC_MAX_INPUT_BYTES", str(1 << 20))
    with pytest.raises(PassError, match="larger than 1 MiB"):
        read_calib_bytes(Path("/dev/zero"))


def test_compile_with_dev_zero_as_calibration_text_fails_in_one_line(work, capfd, tmp_path):
    out = tmp_path / "out.llmc"
    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "--quant", "int4-gptq", "--calib", "/dev/zero",
                                   "-o", out, "--quiet")
    assert code == 2 and "Traceback" not in err
    assert error_line(err.splitlines()[-1]) == ("calibration file '/dev/zero' is a device, not a text file; pass a "
                                                "plain text file to --calib")   # before any model loads
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_compile_with_an_endless_fifo_as_calibration_text_stops_at_the_cap(work, capfd, tmp_path, monkeypatch):
    fifo = tmp_path / "calib.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"yes 'the calibration text goes on' > {fifo}"])
    monkeypatch.setenv("LLMC_MAX_INPUT_BYTES", str(1 << 20))
    try:
        out = tmp_path / "out.llmc"
        code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "--quant", "int4-gptq", "--calib", fifo,
                                       "-o", out, "--quiet")
    finally:
        writer.kill()
        writer.wait()
    assert code == 2 and "Traceback" not in err
    assert f"calibration file '{fifo}' is larger than 1 MiB" in error_line(err.splitlines()[-1])
    assert not out.exists()


# --- JSON depth ------------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_manifest_nested_100000_deep_is_one_line_in_run_and_inspect(artifact, work, capfd, tmp_path):
    def nest(copy):
        text = (copy / "manifest.json").read_text().rstrip()
        (copy / "manifest.json").write_text(text[:-1] + ', "deep": ' + DEEP + "}")
    copy = tmp_path / "deep.llmc"
    shutil.copytree(artifact, copy)
    nest(copy)
    before = snapshot(copy)
    for command in (["run", copy, "-p", "hi"], ["inspect", copy]):
        assert "manifest.json is nested more than 64 levels deep" in refused(capfd, *command)
    with pytest.raises(ArtifactError, match="nested more than 64"):
        llmc.load(copy)
    assert snapshot(copy) == before


@pytest.mark.parametrize("name", ["plan.json", "graph.json"])
def test_a_rehashed_plan_or_graph_nested_100000_deep_is_one_line(artifact, work, capfd, tmp_path, name):
    def nest(copy):
        text = (copy / name).read_text().rstrip()
        (copy / name).write_text(text[:-1] + ', "deep": ' + DEEP + "}")
    copy = tampered(artifact, tmp_path, nest)
    for command in (["run", copy, "-p", "hi"], ["inspect", copy]):
        assert f"{name} is nested more than 64 levels deep" in refused(capfd, *command)


def test_json_depth_counts_without_recursion():
    assert bounded_input.json_depth(1) == 0
    assert bounded_input.json_depth({"a": [1, {"b": []}]}) == 4
    assert bounded_input.json_depth(json.loads("[" * 500 + "]" * 500)) == bounded_input.MAX_JSON_DEPTH + 1


# --- tokenizers and chat templates ---------------------------------------------------------------

def _tokenizer_json(copy, change):
    path = copy / "tokenizer" / "tokenizer.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _config(copy, change):
    path = copy / "tokenizer" / "tokenizer_config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _extra_tokens(data, count):
    data["added_tokens"] += [{"id": 512 + i, "content": f"<extra{i}>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True} for i in range(count)]


TOKENIZER_CASES = {
    "not-json": (lambda c: (c / "tokenizer" / "tokenizer.json").write_text("{not json"),
                 "tokenizer/tokenizer.json is not valid JSON"),
    "not-an-object": (lambda c: (c / "tokenizer" / "tokenizer.json").write_text("[1, 2]"),
                      "tokenizer/tokenizer.json holds no JSON object"),
    "nested-deep": (lambda c: (c / "tokenizer" / "tokenizer.json").write_text(DEEP),
                    "tokenizer/tokenizer.json is nested more than 64 levels deep"),
    "auto-map": (lambda c: _config(c, lambda d: d.__setitem__("auto_map", {"AutoTokenizer": ["evil.Tok", None]})),
                 "tokenizer/tokenizer_config.json field 'auto_map' names custom tokenizer code"),
    "extra-tokens": (lambda c: _tokenizer_json(c, lambda d: _extra_tokens(d, 2000)),
                     "tokenizer/tokenizer.json has token id 512, which the model's embedding of 512 rows does not fit"),
    "config-not-json": (lambda c: (c / "tokenizer" / "tokenizer_config.json").write_text("{oops"),
                        "tokenizer/tokenizer_config.json is not valid JSON"),
    "special-tokens-not-json": (lambda c: (c / "tokenizer" / "special_tokens_map.json").write_text("{oops"),
                                "its tokenizer cannot be loaded (Expecting property name"),
    "not-a-tokenizer": (lambda c: (c / "tokenizer" / "tokenizer.json").write_text(
        '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": 5}}'), "its tokenizer cannot be loaded"),
    "missing": (lambda c: shutil.rmtree(c / "tokenizer"), "has no tokenizer/ directory"),
    "huge-id": (lambda c: _tokenizer_json(c, lambda d: d["model"]["vocab"].__setitem__("zz", 10**12)),
                "has token id 1000000000000"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_a_hostile_tokenizer_is_refused_naming_the_file(artifact, work, capfd, tmp_path, case):
    edit, message = TOKENIZER_CASES[case]
    copy = tampered(artifact, tmp_path, edit)
    before = snapshot(copy)
    assert message in refused(capfd, "run", copy, "-p", "hi", "--max-tokens", "2")
    with pytest.raises(ArtifactError, match="tokenizer"):
        llmc.load(copy)
    assert snapshot(copy) == before


def test_a_tokenizer_file_past_the_json_cap_is_refused(artifact, work, capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_MAX_JSON_BYTES", "20000")   # the tokenizer.json is 21 kB, graph and plan less
    assert "tokenizer/tokenizer.json is larger than" in refused(capfd, "run", artifact, "-p", "hi")


TEMPLATES = {
    "security": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    "overflow": ("{% for i in range(10**12) %}x{% endfor %}", "OverflowError"),
    "raises": ("{{ raise_exception('no chat here') }}", "no chat here"),
    "undefined-call": ("{{ messages.nope() }}", "the chat template of"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_chat_template_the_sandbox_stops_is_one_line(artifact, work, capfd, tmp_path, case):
    template, message = TEMPLATES[case]
    copy = tampered(artifact, tmp_path, lambda c: (c / "tokenizer" / "chat_template.jinja").write_text(template))
    line = refused(capfd, "run", copy, "-p", "hi", "--chat", "--max-tokens", "2")
    assert line.startswith("the chat template of the model in") and message in line
    with pytest.raises(LlmcError, match="chat template"):
        llmc.load(copy).chat([{"role": "user", "content": "hi"}])


# --- paths of the wrong kind -----------------------------------------------------------------------

def test_run_on_a_file_says_it_is_no_artifact_directory(work, capfd):
    assert refused(capfd, "run", "/etc/passwd", "-p", "hi").startswith(
        "artifact '/etc/passwd' exists but is a file, not an artifact directory")
    assert "exists but is a device" in refused(capfd, "inspect", "/dev/null")
    assert "not found" in refused(capfd, "run", "/no/such/artifact", "-p", "hi")


def compile_refused(capfd, *args) -> str:
    """The error line of a refused compile (after any progress lines it printed first)."""
    code, out, err = llmc_in_process(capfd, "compile", *args)
    assert code == 2 and "Traceback" not in err, err
    return error_line(err.splitlines()[-1])


def test_compile_of_a_device_or_fifo_says_it_is_no_model(work, capfd, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "model path '/dev/zero' exists but is a device, not a model" in compile_refused(
        capfd, "/dev/zero", "-o", tmp_path / "out.llmc")
    assert "exists but is a FIFO, not a model" in compile_refused(capfd, fifo, "-o", tmp_path / "out.llmc")
    assert not (tmp_path / "out.llmc").exists()


# --- absurd numbers in a re-hashed plan --------------------------------------------------------------

def _set_attr(copy, kernel, attr, value):
    """Set `attr` of every step of `kernel` (and its graph node) to `value`."""
    for name, key in (("plan.json", "steps"), ("graph.json", "nodes")):
        data = json.loads((copy / name).read_text())
        for step in data[key]:
            if (step.get("kernel") or step.get("op", "")).split(".")[-1] == kernel:
                step["attrs"][attr] = value
        (copy / name).write_text(json.dumps(data))


@pytest.mark.parametrize("kernel,attr,value,shown", [
    ("add_rms_norm", "eps", -1, "-1"),
    ("add_rms_norm", "eps", 1e38, "1e+38"),
    ("rms_norm", "eps", -1.0, "-1.0"),
    ("flash_attention", "scale", 0.0, "0.0"),
    ("flash_attention", "scale", 1e30, "1e+30"),
])
def test_an_absurd_numeric_attr_is_refused_at_load_naming_node_and_attr(artifact, work, capfd, tmp_path, kernel,
                                                                        attr, value, shown):
    copy = tampered(artifact, tmp_path, lambda c: _set_attr(c, kernel, attr, value))
    line = refused(capfd, "run", copy, "-p", "hi", "--max-tokens", "2")
    assert f"kernel cpu.{kernel}): attr {attr!r} is {shown}, not " in line and "(node '" in line
    with pytest.raises(LlmcError, match=f"attr {attr!r} is"):
        llmc.load(copy)


# --- a full disk ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_compile_that_fills_the_disk_is_one_line_and_leaves_nothing(work, capfd, tmp_path, monkeypatch, code):
    from llmc.compiler import artifact as artifact_module

    def full_disk(path, tensors, progress=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)   # part of the file, then the device is full
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(artifact_module, "write_weights_file", full_disk)
    out = tmp_path / "sub" / "out.llmc"
    line = compile_refused(capfd, "tiny-llama", "-o", out)
    assert line.startswith(f"cannot write output '{out}': ") and "free space or choose another -o" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]   # no staging directory, no made parent


@pytest.mark.parametrize("header,message", [
    (struct.pack("<Q", 2**62) + b"{}", "its header claims 4611686018427387904 bytes"),
    (struct.pack("<Q", 200_000) + DEEP.encode(), "maximum recursion depth"),
    (struct.pack("<Q", 2) + b"[]", "its header is no JSON object"),
])
def test_a_rehashed_weights_file_with_a_lying_header_is_one_line(artifact, work, capfd, tmp_path, header, message):
    copy = tampered(artifact, tmp_path, lambda c: (c / "weights.safetensors").write_bytes(header))
    line = refused(capfd, "run", copy, "-p", "hi")
    assert "file weights.safetensors cannot be read" in line and message in line


def test_a_model_config_nested_100000_deep_is_one_line(work, capfd, tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"a": ' + DEEP + "}")
    (source / "model.safetensors").write_bytes(b"")
    (source / "tokenizer.json").write_text("{}")
    line = compile_refused(capfd, source, "-o", tmp_path / "out.llmc")
    assert "config.json' is nested more than 64 levels deep" in line
    assert not (tmp_path / "out.llmc").exists()


def _chat(artifact, stdin, work) -> subprocess.CompletedProcess:
    """`llmc chat` as a process reading `stdin` (a path, or bytes piped in)."""
    env = {**os.environ, "LLMC_MAX_INPUT_BYTES": str(1 << 20)}
    command = [LLMC, "chat", artifact, "--max-tokens", "2"]
    if isinstance(stdin, bytes):
        return subprocess.run(command, input=stdin, capture_output=True, timeout=300, cwd=work, env=env)
    with open(stdin, "rb") as f:
        return subprocess.run(command, stdin=f, capture_output=True, timeout=300, cwd=work, env=env)


def test_chat_reading_dev_zero_is_refused_at_the_line_cap(artifact, work):
    result = _chat(artifact, "/dev/zero", work)
    assert result.returncode == 2
    assert error_line(result.stderr.decode()) == ("a line read from stdin is larger than 1048576 bytes; pass shorter "
                                                  "lines, or set LLMC_MAX_INPUT_BYTES (bytes) to raise the limit")


def test_chat_answers_piped_lines_and_refuses_one_that_is_not_utf8(artifact, work):
    result = _chat(artifact, b"hello\n\nagain\n", work)
    assert result.returncode == 0 and result.stdout.decode().count(">>> ") == 4   # blank line re-prompted
    result = _chat(artifact, b"hello\n\xff\xfe\n", work)
    assert result.returncode == 2
    assert "the line read from stdin is not valid UTF-8" in error_line(result.stderr.decode())


def test_a_plan_past_the_json_cap_is_refused_before_it_is_parsed(artifact, work, capfd, monkeypatch):
    smallest = min((artifact / n).stat().st_size for n in ("plan.json", "graph.json"))
    monkeypatch.setenv("LLMC_MAX_JSON_BYTES", str(smallest - 1))
    line = refused(capfd, "run", artifact, "-p", "hi")
    assert "is larger than" in line and "LLMC_MAX_JSON_BYTES" in line and ".json" in line
