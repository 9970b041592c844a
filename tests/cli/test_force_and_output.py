"""`llmc compile -o OUT`: OUT is checked before any work. --force replaces a previous llmc artifact
and nothing else (a directory of user data, a file, a symlink, an artifact holding a file of the
user's); an output that cannot be written is refused; SIGTERM removes the staging directory; two
forced compiles racing for one OUT leave one complete artifact. Each refusal is one line, exit 2,
with every file outside OUT (and OUT itself) as it was."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from llmc_cli import error_line, llmc_in_process

from llmc.compiler.artifact import read_artifact

LLMC = Path(sys.executable).parent / "llmc"


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the compile gets as far as loading the model: refusals come first."""
    def load_model(source):
        raise AssertionError(f"the compile loaded {source} before refusing its output")
    monkeypatch.setattr("llmc.compiler.pipeline.load_model", load_model)


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under root: a link's target, a file's bytes and mode, a directory's mode."""
    out = {}
    for p in sorted(root.rglob("*")):
        name = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[name] = ("link", os.readlink(p))
        elif p.is_file():
            out[name] = ("file", p.read_bytes(), p.stat().st_mode)
        else:
            out[name] = ("dir", p.stat().st_mode)
    return out


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def user_data(root: Path) -> Path:
    (root / "userdata").mkdir(parents=True)
    (root / "userdata" / "important.txt").write_text(f"{uuid.uuid4()}\n")
    return root


def make_output(kind: str, out: Path, compiled: Path) -> None:
    if kind == "directory-of-user-data":
        user_data(out)
    elif kind == "empty-directory":
        out.mkdir()
    elif kind == "plain-file":
        out.write_text(f"{uuid.uuid4()}\n")
    elif kind == "symlink-to-a-directory":
        out.symlink_to(user_data(out.parent / "elsewhere"))
    elif kind == "symlink-to-an-artifact":
        out.symlink_to(shutil.copytree(compiled, out.parent / "real.llmc"))
    elif kind == "dangling-symlink":
        out.symlink_to(out.parent / "nowhere")
    elif kind == "manifest-that-is-not-llmc":
        user_data(out)
        (out / "manifest.json").write_text(json.dumps({"name": "my web app", "version": 3}))
    elif kind == "artifact-holding-a-user-file":
        shutil.copytree(compiled, out)
        (out / "notes.txt").write_text("mine\n")
    elif kind == "artifact-holding-a-symlink":
        shutil.copytree(compiled, out)
        (out / "tokenizer" / "link").symlink_to(out.parent)


NOT_ARTIFACTS = ["directory-of-user-data", "empty-directory", "plain-file", "symlink-to-a-directory",
                 "symlink-to-an-artifact", "dangling-symlink", "manifest-that-is-not-llmc",
                 "artifact-holding-a-user-file", "artifact-holding-a-symlink"]


@pytest.mark.parametrize("kind", NOT_ARTIFACTS)
def test_force_refuses_to_replace_anything_but_an_llmc_artifact(kind, compiled, tmp_path, capfd, no_model_load):
    out = tmp_path / "out.llmc"
    make_output(kind, out, compiled)
    before = snapshot(tmp_path)
    code, stdout, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", out, "--force")
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert f"output '{out}'" in message and "--force replaces only a previous llmc artifact" in message
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


def test_force_replaces_a_previous_artifact(compiled, tmp_path, capfd):
    out = Path(shutil.copytree(compiled, tmp_path / "out.llmc"))
    (out / "timings.json").write_text("{}")   # an older llmc's build log is part of its artifact
    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", out, "--force", "-q")
    assert code == 0, err
    assert not (out / "timings.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out.llmc"]
    read_artifact(out)


def unwritable_outputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "a-file").write_text("x\n")
    return {"proc": (Path("/proc") / f"llmc-{uuid.uuid4().hex}.llmc", "does not take new entries"),
            "parent-is-a-file": (tmp_path / "a-file" / "x.llmc", "is not a directory"),
            "grandparent-is-a-file": (tmp_path / "a-file" / "sub" / "x.llmc", "is not a directory")}


@pytest.mark.parametrize("case", ["proc", "parent-is-a-file", "grandparent-is-a-file"])
def test_an_output_that_cannot_be_written_is_refused_before_the_compile(case, tmp_path, capfd, no_model_load):
    out, why = unwritable_outputs(tmp_path)[case]
    before = snapshot(tmp_path)
    code, stdout, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", out)
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert f"cannot write output '{out}'" in message and why in message and "-o" in message
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_output_in_a_read_only_directory_is_refused_before_the_compile(tmp_path, capfd, no_model_load):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", locked / "x.llmc")
    assert code == 2 and "cannot write output" in error_line(err)
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("case", ["directory", "missing-directory", "proc"])
def test_a_report_file_that_cannot_be_written_is_refused_before_the_compile(case, tmp_path, capfd, no_model_load):
    report = {"directory": tmp_path, "missing-directory": tmp_path / "no" / "r.json",
              "proc": Path("/proc") / f"llmc-{uuid.uuid4().hex}.json"}[case]
    code, stdout, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", tmp_path / "x.llmc", "--report", report)
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert "--report" in message and str(report) in message
    assert list(tmp_path.iterdir()) == []


def test_parents_made_for_a_failed_compile_are_removed(tmp_path, capfd):
    out = tmp_path / "new" / "deeper" / "x.llmc"
    code, _, err = llmc_in_process(capfd, "compile", tmp_path / "no-such-model", "-o", out)
    assert code == 2 and "no-such-model" in error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_compile_prints_its_timings_and_writes_them_only_to_the_report(tmp_path, capfd):
    report = tmp_path / "report.json"
    code, stdout, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", tmp_path / "x.llmc", "--report", report)
    assert code == 0, err
    assert "llmc: compiled in" in err and "passes" in err
    timings = json.loads(report.read_text())
    assert timings["seconds"] > 0 and [s["name"] for s in timings["stages"]][0] == "load"
    passes = next(s for s in timings["stages"] if s["name"] == "passes")
    assert passes["details"]["count"] == len(timings["passes"]) and timings["startup_seconds"] > 0
    assert "compile time" not in stdout and not (tmp_path / "x.llmc" / "timings.json").exists()


def staging_dirs(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(".x.llmc.tmp-")]


def test_sigterm_during_a_compile_removes_its_staging_directory(tmp_path):
    # a calibrated compile takes seconds, so the signal lands mid-compile even on a loaded machine;
    # should the compile still win the race (exit 0), the attempt proves nothing and is repeated
    for attempt in range(3):
        work = tmp_path / f"out{attempt}"
        work.mkdir()
        args = ["compile", "tiny-llama", "-o", str(work / "x.llmc"), "--quant", "int4-gptq"]
        proc = subprocess.Popen([str(LLMC), *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not staging_dirs(work) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert staging_dirs(work), "the compile never made its staging directory"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            break
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert list(work.iterdir()) == []


def test_a_sigterm_that_lands_in_a_finalizer_still_exits():
    # Python drops an exception raised inside __del__: the handler must take the signal again after
    from llmc.cli import _sigterm_exits

    class SignalsInItsFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)   # the handler runs here, in the finalizer's frame

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)
    with pytest.raises(SystemExit) as exc, _sigterm_exits():
        SignalsInItsFinalizer()
        for _ in range(500):   # the compile going on
            time.sleep(0.01)
    assert exc.value.code == 128 + signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)) == before


def test_two_forced_compiles_racing_for_one_output_leave_one_whole_artifact(compiled, tmp_path):
    out = Path(shutil.copytree(compiled, tmp_path / "x.llmc"))
    procs = [subprocess.Popen([str(LLMC), "compile", "tiny-llama", "-o", str(out), "--force", "-q"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 0 or (code == 2 and "another compile wrote" in error_line(err)), err
    assert any(code == 0 for code, _ in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.llmc"]
    read_artifact(out)
