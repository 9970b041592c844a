"""A compile's wall-clock timings: printed as one line and, with `llmc compile --report FILE`,
written as JSON beside the artifact. They are never part of the artifact, whose bytes depend on
its inputs alone. The stages (load, trace, calibrate, passes, plan, write) cover the compile's
`seconds`; `startup_seconds` is the process's life before the compile began (for `llmc compile`,
the interpreter's start and the imports of torch, transformers and the compiler; in a longer-lived
Python process, everything it did before)."""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path

from llmc.errors import ArtifactError


def check_report_path(path: str | Path | None) -> None:
    """Refuse, before any work, a report path that cannot be written: a directory, or one whose
    directory is missing or takes no new files (probed by making and removing a temporary file)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"--report '{path}' is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ArtifactError(f"--report '{path}': directory '{parent}' does not exist; create it or choose "
                            f"another file")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.probe-")
    except OSError as e:
        raise ArtifactError(f"--report '{path}' cannot be written ({e.strerror}); choose another file") from None
    os.close(fd)
    os.unlink(probe)


def write_report(path: str | Path, report: dict) -> None:
    """Write `report` as JSON to `path`, replacing the file whole."""
    path = Path(path)
    staging = None
    try:
        fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(report, indent=1, sort_keys=True) + "\n")
        os.chmod(staging, 0o644)
        os.replace(staging, path)
    except BaseException as e:
        if staging is not None:
            Path(staging).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ArtifactError(f"--report '{path}' cannot be written ({e.strerror}); the artifact itself "
                                f"was written") from None
        raise


def process_age() -> float | None:
    """Seconds since this process started (from Linux's /proc), None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])   # field 22, starttime, after "pid (comm)"
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def timing_line(report: dict) -> str:
    """One line: the total, then each stage (the passes by their count), the time per GB of
    weights written and the process's peak memory, then the process's time before it."""
    parts = [f"{len(report['passes'])} passes {s['seconds']:.2f} s" if s["name"] == "passes"
             else f"{s['name']} {s['seconds']:.2f} s" for s in report["stages"]]
    startup = report.get("startup_seconds")
    after = f", after {startup:.1f} s in this process before it" if startup is not None else ""
    scale = ""
    if report.get("weight_bytes") and report.get("peak_rss_bytes"):
        scale = (f"; {report['seconds'] / (report['weight_bytes'] / 1e9):.1f} s per GB of weights, "
                 f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB")
    return f"llmc: compiled in {report['seconds']:.1f} s ({', '.join(parts)}){scale}{after}"


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far: Linux's VmHWM, which is this program's own (the
    ru_maxrss of a process started by a large one counts the parent's pages it was forked with)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
