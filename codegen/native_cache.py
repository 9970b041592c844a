"""Where code built or rendered for this machine is kept (the native C kernels' shared libraries,
the Triton kernel sources the runtime imports) so that no one else can plant what llmc then runs:
a private directory (the user's own, mode 0700), each library's sha256 recorded beside it when it
is built, and owner, mode and hash checked on the open file right before it is loaded.

A cache directory that is group- or world-writable or belongs to someone else is refused unless
LLMC_SHARED_CACHE=1 says the user trusts everyone who can write there."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from llmc.errors import LlmcError

SHARED_ENV = "LLMC_SHARED_CACHE"
DIGEST_SUFFIX = ".sha256"
MAX_LIBRARY_BYTES = 256 << 20   # far above the kernels' few hundred KiB; a larger file is not ours


class CacheRefused(LlmcError):
    """A cache directory or file that llmc will not load code from; the message says why."""


def shared_allowed() -> bool:
    return os.environ.get(SHARED_ENV, "") == "1"


def private_directory(path: Path) -> Path:
    """`path` (its parent resolved), created 0700 where missing (parents too), after checking it
    and its parent are directories of this user that no one else can write to (the parent may be a
    sticky one, as /tmp); an own directory left group- or world-readable by an older llmc is
    narrowed to 0700. `path` itself may not be a symlink."""
    path = Path(path)
    try:
        if not os.path.lexists(path.parent):
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.path.lexists(path):
            path.mkdir(mode=0o700)
    except FileExistsError:   # made by a concurrent run: checked below as any other
        pass
    except OSError as e:
        raise CacheRefused(f"cache directory '{path}' cannot be made ({e.strerror}); point LLMC_CACHE at a "
                           f"directory of your own") from None
    path = Path(os.path.realpath(path.parent)) / path.name   # a linked cache root is checked (and used) where it leads
    _check_directory(path.parent, narrow=False)
    _check_directory(path, narrow=True)
    return path


def _check_directory(path: Path, narrow: bool) -> None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "no directory"
        raise CacheRefused(f"cache directory '{path}' is {kind}")
    if shared_allowed():
        return
    if info.st_uid != os.getuid() and (narrow or info.st_uid != 0):   # the parent may be root's (/tmp)
        raise CacheRefused(f"cache directory '{path}' belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); "
                           f"point LLMC_CACHE at a directory of your own, or set {SHARED_ENV}=1 to trust it")
    writable = info.st_mode & 0o022 and not (info.st_mode & stat.S_ISVTX and not narrow)
    if writable:
        raise CacheRefused(f"cache directory '{path}' is writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
                           f"`chmod go-w` it, point LLMC_CACHE elsewhere, or set {SHARED_ENV}=1 to trust it")
    if narrow and stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)   # readable by others (an older llmc's default mode): only narrowed


def digest_path(library: Path) -> Path:
    return library.with_name(library.name + DIGEST_SUFFIX)


def record(built: Path, target: Path) -> None:
    """Move the freshly built file `built` to `target` in the same private directory, its sha256
    written beside it first (both renamed into place atomically)."""
    digest = _sha256_of(built.read_bytes())
    fd, tmp = tempfile.mkstemp(suffix=DIGEST_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.chmod(built, 0o700)
        os.replace(built, target)
        os.replace(tmp, digest_path(target))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def verified_open(library: Path) -> Iterator[str]:
    """The library's path, held open while the caller loads it: opened without following links, it
    must be a regular file of this user that no one else can write, whose sha256 is the one recorded
    beside it. Raises CacheRefused otherwise (FileNotFoundError where it is not there). The path,
    not /proc/self/fd/N, is what the caller loads: the dynamic loader recognises a library it
    loaded by its name, and N is reused."""
    fd = os.open(library, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        _check_file(library, info)
        data = _read_fd(fd, info.st_size)
        recorded = _recorded_digest(library)
        if _sha256_of(data) != recorded:
            raise CacheRefused(f"'{library}' does not match the sha256 recorded when it was built")
        yield str(library)   # only this user can swap it before the load: the directory is private
    finally:
        os.close(fd)


def _check_file(library: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise CacheRefused(f"'{library}' is not a regular file")
    if info.st_size > MAX_LIBRARY_BYTES:
        raise CacheRefused(f"'{library}' is {info.st_size} bytes, more than llmc builds")
    if shared_allowed():
        return
    if info.st_uid != os.getuid():
        raise CacheRefused(f"'{library}' belongs to uid {info.st_uid}, not to you")
    if info.st_mode & 0o022:
        raise CacheRefused(f"'{library}' is writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def _recorded_digest(library: Path) -> str:
    path = digest_path(library)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CacheRefused(f"'{library}' has no recorded sha256 ({path.name}): llmc did not build it") from None
    except OSError as e:
        raise CacheRefused(f"the recorded sha256 of '{library}' cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        _check_file(path, info)
        return _read_fd(fd, 128).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _read_fd(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def warn(message: str) -> None:
    """One warning line on stderr (the run goes on without what was refused)."""
    print(f"llmc: warning: {message}", file=sys.stderr, flush=True)


__all__ = ["SHARED_ENV", "CacheRefused", "digest_path", "private_directory", "record", "shared_allowed",
           "verified_open", "warn"]
