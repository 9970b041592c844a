"""A compile's wall-clock timings: printed as one line and, with `llmc compile --report FILE`,
written as JSON beside the artifact. They are never part of the artifact, whose bytes depend on
its inputs alone."""

from __future__ import annotations

import json
import os
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


def timing_line(report: dict) -> str:
    """One line: the total, then each stage and the passes together."""
    parts = [f"{s['name']} {s['seconds']:.2f} s" for s in report["stages"]]
    parts.append(f"{len(report['passes'])} passes {sum(p['seconds'] for p in report['passes']):.2f} s")
    return f"llmc: compiled in {report['seconds']:.1f} s ({', '.join(parts)})"
