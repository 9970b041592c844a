"""Run the `llmc` command line inside the test process (fast, and coverage sees it)."""

from llmc.cli import main


def llmc_in_process(capture, *args) -> tuple[int, str, str]:
    """`llmc.cli.main(args)` in this process: (exit code, stdout, stderr). `capture` is pytest's
    capsys or capfd; output captured before the call is dropped."""
    capture.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out, err = capture.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one stderr line of a refused command, without its "llmc: error: " prefix."""
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert lines[0].startswith("llmc: error: "), lines[0]
    return lines[0].removeprefix("llmc: error: ")
