"""Artifact files whose sha256 was checked before and that have not changed since, known by the
file's identity and times (device, inode, size, mtime, ctime), as git's index knows a file is
unchanged: a large weights file is hashed on its first load, not on every one (hashing 4.6 GB
took a third of an 8B model's load). Any write to the file, a rename over it or a chmod moves
its ctime, which no user can set back; a record is trusted only from a directory of this user's
that no one else can write. LLMC_REHASH=1 hashes every time."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

# below this a file is hashed each time: cheaper than keeping a record of it
REMEMBERED_BYTES = 64 << 20
REHASH_ENV = "LLMC_REHASH"


def records_dir(make: bool = False) -> Path | None:
    """The user's private record directory (made 0700 when `make`), or None where it is absent or
    not private."""
    root = Path(os.environ.get("LLMC_CACHE") or "~/.cache/llmc").expanduser() / "verified"
    try:
        if make:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(root)
    except OSError:
        return None
    private = (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
               and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    return root if private else None


def identity(info: os.stat_result) -> list[int]:
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def _record_path(root: Path, file: Path) -> Path:
    return root / (hashlib.sha256(str(file.resolve()).encode()).hexdigest() + ".json")


def known_digest(file: Path) -> str | None:
    """The sha256 recorded for `file` when it was last hashed, if the file is unchanged since."""
    if os.environ.get(REHASH_ENV) == "1":
        return None
    try:
        info = os.stat(file)
        root = records_dir() if info.st_size >= REMEMBERED_BYTES else None
        if root is None:
            return None
        record = json.loads(_record_path(root, file).read_text())
        return record["sha256"] if record.get("identity") == identity(info) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def remember(file: Path, digest: str, info: os.stat_result) -> None:
    """Record that `file`, as `info` describes it (taken before hashing), hashes to `digest`."""
    root = records_dir(make=True) if info.st_size >= REMEMBERED_BYTES else None
    if root is None:
        return
    try:
        if identity(os.stat(file)) != identity(info):   # changed while it was hashed: no record
            return
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": identity(info), "sha256": digest}, f)
        os.replace(tmp, _record_path(root, file))
    except OSError:
        pass   # a record is an optimisation; failing to write one changes nothing


__all__ = ["known_digest", "remember", "identity", "REMEMBERED_BYTES", "REHASH_ENV"]
