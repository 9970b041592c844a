"""The README is a user guide whose commands work: every `llmc ...` line in its code blocks parses
against the CLI (options, choices and types, without running anything), its Python examples print
what they promise, it keeps the test command CI runs, and docs/cli.md is the CLI's current --help."""

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from llmc.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SEPARATOR = "<<llmc readme: next example>>"


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def llmc_commands(text: str) -> list[list[str]]:
    """Each `llmc ...` line of the shell blocks as argv (continuations joined, comments dropped)."""
    commands = []
    for lang, body in code_blocks(text):
        if lang == "python":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["llmc"]:
                commands.append(argv[1:])
    return commands


def dry_run(args: list[str]) -> None:
    """Parse `llmc ARGS` as the CLI would, stopping before the command runs."""
    with click.Context(cli, info_name="llmc", **cli.context_settings) as ctx:
        command = cli.get_command(ctx, args[0])
        if command is None:
            raise click.UsageError(f"no such command {args[0]!r}", ctx)
        command.make_context(args[0], list(args[1:]), parent=ctx).close()


def python_examples(text: str) -> list[str]:
    """The tour's runnable examples: the Python blocks that do not need a running server."""
    return [body for lang, body in code_blocks(text) if lang == "python" and "OpenAI(" not in body]


def test_the_readme_is_a_guide_not_a_log():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "tiny-llama" in text and "random weights" in text


def test_the_readme_keeps_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().split()
    assert ci[-2:] == ["make", "test"]
    shell = "\n".join(body for lang, body in code_blocks(README.read_text()) if lang != "python")
    assert re.search(r"^make test\b", shell, re.M)


def test_the_readme_shows_every_subcommand():
    shown = {argv[0] for argv in llmc_commands(README.read_text())}
    assert set(cli.commands) <= shown | {"cache"}, set(cli.commands) - shown


@pytest.mark.parametrize("args", llmc_commands(README.read_text()), ids=" ".join)
def test_every_readme_command_parses(args, monkeypatch):
    # Files the examples name (prompts.txt, article.txt) need not exist: parse, do not open.
    monkeypatch.setattr(click.File, "convert", lambda self, value, param, ctx: value)
    dry_run(args)


def test_a_wrong_command_does_not_parse():
    with pytest.raises(click.UsageError):
        dry_run(["compile", "smollm2-135m", "--quant", "int3", "-o", "x.llmc"])
    with pytest.raises(click.UsageError):
        dry_run(["run", "smol.llmc", "--no-such-flag"])
    with pytest.raises(click.UsageError):
        dry_run(["complie", "smollm2-135m"])


def test_every_python_block_is_python():
    for lang, body in code_blocks(README.read_text()):
        if lang == "python":
            ast.parse(body)


@pytest.mark.smollm2
def test_the_python_examples_print_text(smollm2_gguf, tmp_path):
    """Runs the README's Python examples as written, in a fresh process (SmolLM2's compile is most
    of the time; the GGUF comes from LLMC_CACHE, as the fixture fetched it)."""
    first, *rest = python_examples(README.read_text())
    script = "\n".join([first, f"print({SEPARATOR!r})", *rest])
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    answer, completions = done.stdout.split(SEPARATOR)
    assert answer.strip(), "the first example printed nothing"
    assert completions.strip()


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_readme_link_leads_somewhere():
    for target in re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", README.read_text()):
        path, anchor = ROOT / target[0], target[1]
        assert path.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            assert anchor in {github_anchor(h) for h in headings}, target


def test_docs_cli_md_is_current():
    spec = importlib.util.spec_from_file_location("cli_doc", ROOT / "bench" / "cli_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "cli.md").read_text() == module.markdown(), \
        "docs/cli.md is stale: .venv/bin/python bench/cli_doc.py > docs/cli.md"
