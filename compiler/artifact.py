"""Write and read compiled artifacts: a directory of manifest.json (format version, sha256 of
every file), graph.json, plan.json, weights.safetensors, tokenizer/ and, for Triton plans, kernels/
with its index kernels.json. A tensor-parallel artifact holds graph, plan and weights once per rank,
under rank0/, rank1/, ...; its manifest's `parallel` section says what each rank holds.
Writes are atomic and byte-deterministic, and --force replaces nothing but a previous artifact.
An artifact is untrusted input: reads refuse symlinks, check every hash and the manifest's schema,
read no unhashed file but the manifest, and never unpickle."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

import torch

from llmc.compiler.bounded_input import file_kind, read_json_bytes
from llmc.compiler.bounded_input import parse_json as parse_bounded_json
from llmc.compiler.manifest_schema import RECOMPILE, check_manifest, check_model_agrees
from llmc.compiler.tokenizer_files import load_tokenizer as load_checked
from llmc.compiler.verified_files import known_digest, remember
from llmc.compiler.weight_store import Entry, LazyTensor, WeightStore
from llmc.compiler.weights_file import map_weights_file, write_weights_file
from llmc.errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TIMINGS = "timings.json"  # older llmc's wall-clock build log: tolerated, never read
MAX_MANIFEST_BYTES = 64 << 20  # the one file read unhashed: bounded
GRAPH = "graph.json"
PLAN = "plan.json"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
KERNELS_DIR = "kernels"
KERNEL_INDEX = "kernels.json"  # what each file under kernels/ is and which plan steps launch it
DATA_DIR = "ort"  # ONNX files of the plan's ONNX Runtime segments, read by the runtime (hashed as all files)


# A write that fails for want of room: the user's to fix, not a bug (one line, not a traceback).
FULL_DISK = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
             errno.EFBIG: "a file grew larger than the file system takes"}


@dataclass(frozen=True)
class OutputKind:
    """What a staged output directory is, for --force: `problem(path)` says why an existing path
    is not a previous output of this kind (None: it is, and may be replaced)."""
    name: str                                   # "llmc artifact", "ONNX export"
    writer: str                                 # "compile", "export": who races for the path
    problem: Callable[[Path], str | None]


@dataclass(frozen=True)
class RankFiles:
    """What one rank runs: its graph, plan and weights (an unsharded model is one rank)."""
    graph_json: str
    plan_json: str
    weights: dict[str, torch.Tensor]


@dataclass
class Artifact:
    path: Path
    manifest: dict
    graph_json: str
    plan_json: str
    weights: dict[str, torch.Tensor]
    tokenizer_dir: Path
    kernels: dict[str, str] = field(default_factory=dict)  # name under kernels/ -> source text
    data: dict[str, bytes] = field(default_factory=dict)   # path under DATA_DIR/ (with it) -> bytes


def write_artifact(path, *, graph_json: str, plan_json: str, weights: dict[str, torch.Tensor], tokenizer,
                   manifest: dict, kernels: dict[str, str] | None = None, force: bool = False,
                   kernel_index: list[dict] | None = None) -> Path:
    """Write an artifact to `path` via a temporary sibling directory renamed into place (see
    staged_output), so a failed write leaves nothing behind. The same inputs give byte-identical
    files."""
    path = Path(path)
    with staged_output(path, force) as staging:
        write_contents(staging, [RankFiles(graph_json, plan_json, weights)], tokenizer, manifest, kernels or {},
                       kernel_index)
    return path


@contextmanager
def staged_output(path: Path, force: bool, kind: OutputKind | None = None) -> Iterator[Path]:
    """Check that `path` may be written (absent, or with force a previous output of `kind`, by
    default an llmc artifact) and that its parent takes a directory, then yield an empty staging
    sibling to fill. On a normal exit the staging directory, its modes made 0644/0755, replaces
    `path`; on any exception (SIGINT, a SIGTERM the CLI turns into SystemExit) it goes, with any
    parent directories made for it."""
    kind = kind or ARTIFACT
    check_output(path, force, kind)
    made = make_parents(path)
    # SIGTERM and SIGINT wait until the cleanup below covers the new directory: one landing inside mkdtemp
    # after its mkdir, or before the try, would leave the directory behind (seen under load)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        remove_empty(made)
        raise ArtifactError(f"cannot write output '{path}': its directory '{path.parent}' does not take new "
                            f"entries ({e.strerror}); choose another -o") from None
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield staging
        set_modes(staging)
        move_into_place(staging, path, force, kind)
        if kind is ARTIFACT:
            remember_hashes(path)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty(made)
        if isinstance(e, OSError) and e.errno in FULL_DISK:
            raise ArtifactError(f"cannot write output '{path}': {FULL_DISK[e.errno]} while writing "
                                f"{Path(e.filename).name if e.filename else 'it'}; nothing was left behind; free "
                                f"space or choose another -o") from None
        raise


def remember_hashes(path: Path) -> None:
    """Record the sha256 the manifest just took of each large file of the artifact at `path`
    (compiler/verified_files.py), so that its first load need not hash its weights again (1.9 GB: ~1.5 s):
    this process wrote them into a staging directory only it could write (mkdtemp's 0700) and nothing
    has changed them since."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for name, digest in files.items():
        try:
            info = os.stat(path / name)
        except OSError:
            continue
        remember(path / name, digest, info)


def check_output(path: Path, force: bool, kind: OutputKind | None = None) -> None:
    """Refuse an existing `path` without force, and with it anything but a previous output of
    `kind` (default: an llmc artifact)."""
    if os.path.lexists(path):
        if not force:
            raise ArtifactError(f"output '{path}' exists; pass --force to overwrite")
        check_replaceable(path, kind or ARTIFACT)


def check_replaceable(path: Path, kind: OutputKind) -> None:
    problem = kind.problem(path)
    if problem is not None:
        raise ArtifactError(f"output '{path}' {problem}; --force replaces only a previous {kind.name}: "
                            f"move it away or choose another -o")


def artifact_problem(path: Path) -> str | None:
    """Why `path` is not (only) an llmc artifact, or None when it is: a real directory whose
    manifest.json has a format_version and a files table listing every file under it."""
    if path.is_symlink():
        return "is a symlink"
    if not path.is_dir():
        return "is a file, not an llmc artifact"
    manifest_path = path / MANIFEST
    if manifest_path.is_symlink() or not manifest_path.is_file():
        return f"is a directory without an llmc {MANIFEST}"
    try:
        manifest = parse_json(path, MANIFEST, read_bounded(manifest_path))
    except (OSError, ArtifactError):
        manifest = None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("format_version"), int)
            and isinstance(manifest.get("files"), dict)):
        return f"has a {MANIFEST} that is no llmc manifest"
    listed = set(manifest["files"]) | {MANIFEST, TIMINGS}
    for entry in walk_entries(path):
        name = entry.relative_to(path).as_posix()
        if entry.is_symlink():
            return f"holds the symlink {name}, which is no part of an llmc artifact"
        if entry.is_dir() and not any(f.startswith(name + "/") for f in listed):
            return f"holds the directory {name}, which its {MANIFEST} does not list"
        if not entry.is_dir() and name not in listed:
            return f"holds {name}, which its {MANIFEST} does not list"
    return None


ARTIFACT = OutputKind("llmc artifact", "compile", artifact_problem)


def make_parents(path: Path) -> list[Path]:
    """Create the missing directories above `path`; return them, innermost first."""
    missing = []
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"cannot write output '{path}': '{parent}' is not a directory; choose another -o")
    for i, directory in enumerate(reversed(missing)):
        try:
            directory.mkdir()
        except OSError as e:
            remove_empty(missing[len(missing) - i:])
            raise ArtifactError(f"cannot write output '{path}': cannot create directory '{directory}' "
                                f"({e.strerror}); choose another -o") from None
    return missing


def remove_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (or gone): someone else uses it


def set_modes(root: Path) -> None:
    """Files 0644 and directories 0755, whatever the umask or mkstemp made them, so that whoever
    may read the artifact's directory can load it."""
    root.chmod(0o755)
    for entry in walk_entries(root):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def write_contents(root: Path, ranks: list[RankFiles], tokenizer, manifest: dict, kernels: dict[str, str],
                   kernel_index: list[dict] | None = None, data: dict[str, bytes] | None = None) -> None:
    """Fill the staging directory `root` (with one rank, its files at the top; with several, each
    in its rank's directory, whose weight aliases join its entry of manifest["parallel"]); the
    manifest, written last, hashes every other file."""
    if len(ranks) == 1:
        manifest = dict(manifest, weight_aliases=write_rank_files(root, ranks[0]))
    else:
        entries = [dict(entry, weight_aliases=write_rank_files(root / entry["dir"], files))
                   for entry, files in zip(manifest["parallel"]["ranks"], ranks)]
        manifest = dict(manifest, weight_aliases={}, parallel=dict(manifest["parallel"], ranks=entries))
    tokenizer.save_pretrained(root / TOKENIZER_DIR)
    for name, source in sorted(kernels.items()):
        kernel_path = root / KERNELS_DIR / checked_relative(name, f"kernel name {name!r}")
        kernel_path.parent.mkdir(parents=True, exist_ok=True)
        kernel_path.write_bytes(source.encode())
    if kernel_index is not None:
        (root / KERNEL_INDEX).write_bytes(dump_json(kernel_index).encode())
    write_data(root, data or {})
    manifest = dict(manifest, format_version=FORMAT_VERSION,
                    files={name: sha256_file(root / name) for name in list_files(root)})
    (root / MANIFEST).write_bytes(dump_json(manifest).encode())


def write_data(root: Path, data: dict[str, bytes]) -> None:
    """Files under DATA_DIR/ by path (the plan's ONNX Runtime segments)."""
    for name, content in sorted(data.items()):
        relative = checked_relative(name, f"data file {name!r}")
        if relative.parts[0] != DATA_DIR:
            raise ValueError(f"data file {name!r} is not under {DATA_DIR}/")
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(content)


def write_rank_files(folder: Path, files: RankFiles) -> dict[str, str]:
    """Write one rank's graph, plan and weights into `folder`; returns its weight aliases."""
    folder.mkdir(exist_ok=True)
    (folder / GRAPH).write_bytes(files.graph_json.encode())
    (folder / PLAN).write_bytes(files.plan_json.encode())
    stored, aliases = dedupe_weights(weight_entries(files.weights))
    write_weights_file(folder / WEIGHTS, stored)
    return aliases


def weight_entries(weights) -> dict[str, Entry]:
    """Each weight as stored: a WeightStore's lazy entries stay unmade until written."""
    if isinstance(weights, WeightStore):
        return {name: weights.entry(name) for name in weights}
    return dict(weights)


def dedupe_weights(weights: dict[str, Entry]) -> tuple[dict[str, Entry], dict[str, str]]:
    """Store each distinct view once (tied embeddings share one tensor); the other names become
    aliases of the first name in sorted order. Returns (stored, {alias: stored name})."""
    first_name: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name in sorted(weights):
        entry = weights[name]
        if not isinstance(entry, (torch.Tensor, LazyTensor)):
            raise TypeError(f"weight {name!r} is a {type(entry).__name__}, not a torch.Tensor")
        first = first_name.setdefault(view_key(name, entry), name)
        if first != name:
            aliases[name] = first
    storage_uses: dict[object, int] = {}
    for key in first_name:
        storage_uses[key[0]] = storage_uses.get(key[0], 0) + 1
    stored = {}
    for key, name in sorted(first_name.items(), key=lambda item: item[1]):
        entry = weights[name]
        if isinstance(entry, torch.Tensor):
            entry = entry.detach().to("cpu").contiguous()
            # different views of one storage (slices of a fused tensor) must be saved as separate copies
            entry = entry.clone() if storage_uses[key[0]] > 1 else entry
        stored[name] = entry
    return stored, aliases


def view_key(name: str, tensor: Entry) -> tuple:
    """Equal for two tensors exactly when they are the same view of the same memory (a lazy
    tensor: the same lazy tensor)."""
    if isinstance(tensor, LazyTensor):
        return (("lazy", id(tensor)),)
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return (name,)  # no memory to share
    storage = (tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr())
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def move_into_place(staging: Path, path: Path, force: bool, kind: OutputKind) -> None:
    """Rename the finished staging directory to `path`. With force, a previous output there is
    set aside first and removed after. If another writer put something at `path` meanwhile, that
    stays as it is and this write fails."""
    old = set_aside(path, kind) if force else None
    try:
        os.rename(staging, path)  # fails onto anything but an absent path or an empty directory
    except OSError as e:
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)
            old = None
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise ArtifactError(f"another {kind.writer} wrote '{path}' at the same time; it is left as it is, "
                                f"retry") from None
        raise ArtifactError(f"cannot move the finished {kind.name} to '{path}' ({e.strerror}); retry") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def set_aside(path: Path, kind: OutputKind) -> Path | None:
    """Move the previous output at `path` to a hidden sibling and return it (None: nothing is
    there). What was moved is checked again: it may have changed since the write began."""
    if not os.path.lexists(path):
        return None
    check_replaceable(path, kind)
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
    try:
        os.rename(path, old)
    except FileNotFoundError:
        return None  # another writer set it aside first
    problem = kind.problem(old)
    if problem is not None:
        try:
            os.rename(old, path)
        except OSError:
            raise ArtifactError(f"output '{path}' changed while compiling and {problem}; it now lies at "
                                f"'{old}'") from None
        raise ArtifactError(f"output '{path}' changed while compiling and {problem}; it is left as it is")
    return old


def read_artifact(path, verify: bool = True, rank: int = 0) -> Artifact:
    """Read the artifact at `path` as rank `rank` runs it (its own graph, plan and weights, and the
    manifest as rank_view gives it); with verify, first check every file against the manifest but
    other ranks' files. Either way the manifest must fit its schema and agree with graph.json and
    plan.json."""
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"artifact '{path}' {not_a_directory(path)}; an artifact is the directory "
                            f"`llmc compile` writes")
    manifest = rank_view(read_manifest(path), rank, f"artifact '{path}'")
    if verify:
        verify_files(path, manifest)
    folder = path / manifest["rank_dir"] if "rank_dir" in manifest else path
    graph_json, plan_json = read_text(folder, GRAPH), read_text(folder, PLAN)
    check_model_agrees(manifest, parse_json(path, GRAPH, graph_json), parse_json(path, PLAN, plan_json),
                       f"artifact '{path}'" + (f" ({manifest['rank_dir']})" if "rank_dir" in manifest else ""))
    return Artifact(path=path, manifest=manifest, graph_json=graph_json, plan_json=plan_json,
                    weights=read_weights(folder, manifest), tokenizer_dir=path / TOKENIZER_DIR,
                    kernels=read_kernels(path), data=read_data(path))


def not_a_directory(path: Path) -> str:
    """What `path`, which is no directory, is: missing, or which kind of thing."""
    kind = file_kind(path)
    return f"not found ({kind})" if kind.startswith("no such") else f"exists but is {kind}, not an artifact directory"


def rank_file(view: dict, name: str) -> str:
    """Where the file `name` (graph.json, plan.json, weights) of the rank a rank_view shows lies."""
    return f"{view['rank_dir']}/{name}" if "rank_dir" in view else name


def rank_count(manifest: dict) -> int:
    parallel = manifest.get("parallel") or {}
    return parallel.get("tp", 1) * parallel.get("pp", 1)


def rank_view(manifest: dict, rank: int, where: str) -> dict:
    """The manifest as rank `rank` sees it: for a tensor-parallel artifact, `model` and `report`
    with the rank's own heads and KV bytes, its weight aliases, and `rank_dir`, its folder."""
    parallel = manifest.get("parallel")
    if parallel is None:
        if rank != 0:
            raise ArtifactError(f"{where} is not sharded; it has no rank {rank}")
        return manifest
    ranks = parallel["ranks"]
    count = rank_count(manifest)
    if len(ranks) != count or [e["dir"] for e in ranks] != [f"rank{r}" for r in range(len(ranks))]:
        raise ArtifactError(f"{where}: manifest.json parallel.ranks does not list rank0 .. rank{count - 1} "
                            f"in order; {RECOMPILE}")
    if not 0 <= rank < len(ranks):
        raise ArtifactError(f"{where} has ranks 0 to {len(ranks) - 1}, not {rank}")
    own = {k: ranks[rank][k] for k in ("num_heads", "num_kv_heads", "kv_bytes_per_token", "num_layers")
           if ranks[rank].get(k) is not None}
    return {**manifest, "model": {**manifest["model"], **own}, "weight_aliases": ranks[rank]["weight_aliases"],
            "report": {**manifest["report"], "kv_bytes_per_token": own["kv_bytes_per_token"]},
            "rank": rank, "rank_dir": ranks[rank]["dir"]}


def read_manifest(path: Path) -> dict:
    """The manifest of the artifact at `path`, checked against its schema (manifest_schema.py),
    once the artifact is known to hold no symlink or special file."""
    refuse_links(path)
    manifest_path = path / MANIFEST
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise ArtifactError(f"artifact '{path}' has no {MANIFEST}: not an llmc artifact, or its write "
                            f"was interrupted; compile one with `llmc compile`")
    manifest = parse_json(path, MANIFEST, read_bounded(manifest_path))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ArtifactError(f"artifact '{path}': {MANIFEST} has no 'files' table; recompile")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact '{path}' has format version {manifest.get('format_version')!r}; "
                            f"this llmc reads version {FORMAT_VERSION}; recompile with this llmc")
    check_manifest(manifest, f"artifact '{path}'")
    return manifest


def read_bounded(file: Path) -> str:
    """A small text file that no hash vouches for, refused when it is large."""
    with open(file, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"'{file}' is larger than {MAX_MANIFEST_BYTES >> 20} MiB; it is no llmc manifest")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise ArtifactError(f"'{file}' is not UTF-8 text ({e}); recompile") from None


def parse_json(path: Path, name: str, text: str):
    """The JSON of the artifact's file `name`, nested within bounded_input's depth."""
    return parse_bounded_json(text, f"artifact '{path}': {name}", ArtifactError, "; recompile")


def refuse_links(path: Path) -> None:
    """Refuse an artifact holding anything but plain files and directories: a symlink (to
    /dev/zero, or out of the artifact), a FIFO or a device would be read as if it were data."""
    for entry in walk_entries(path):
        mode = entry.lstat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
            raise ArtifactError(f"artifact '{path}': {entry.relative_to(path).as_posix()} is {kind}; an "
                                f"artifact holds only plain files and directories, recompile it")


def walk_entries(root: Path) -> Iterator[Path]:
    """Every file, directory and link under root, never following a link."""
    for directory, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            yield Path(directory) / name


def verify_files(path: Path, manifest: dict) -> None:
    """Check every listed file's hash (but other ranks' files, which this rank never reads), and
    refuse files the manifest does not list."""
    listed = manifest["files"]
    unlisted = sorted(set(list_files(path)) - set(listed) - {MANIFEST, TIMINGS})
    if unlisted:
        raise ArtifactError(f"artifact '{path}': file {unlisted[0]} is not listed in {MANIFEST} "
                            f"(added after compiling?); remove it or recompile")
    others = {e["dir"] + "/" for e in (manifest.get("parallel") or {}).get("ranks", [])} - {
        f"{manifest.get('rank_dir')}/"}
    for name, digest in sorted(listed.items()):
        if not any(name.startswith(d) for d in others):
            verify_file(path, name, digest)


def verify_file(path: Path, name: str, digest: str) -> Path:
    """The listed file `name` of the artifact at `path`, after checking its sha256."""
    file = path / checked_relative(name, f"artifact '{path}': {MANIFEST} entry {name!r}")
    if file.is_symlink() or not file.is_file():
        raise ArtifactError(f"artifact '{path}': file {name} is missing; recompile")
    if known_digest(file) == digest:   # hashed before and unchanged since (compiler/verified_files.py)
        return file
    info = os.stat(file)
    if sha256_file(file) != digest:
        raise ArtifactError(f"artifact '{path}': file {name} fails its sha256 check "
                            f"(tampered or truncated); recompile")
    remember(file, digest, info)
    return file


def read_weights(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    try:
        weights = map_weights_file(path / WEIGHTS)  # safetensors: plain bytes, no code runs on load
    except (ValueError, OSError, RecursionError) as e:   # a header nested 100,000 deep: RecursionError
        raise ArtifactError(f"artifact '{path}': file {WEIGHTS} cannot be read "
                            f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); recompile") from None
    for alias, name in sorted(manifest.get("weight_aliases", {}).items()):
        if name not in weights:
            raise ArtifactError(f"artifact '{path}': weight alias {alias!r} names missing weight {name!r}; "
                                f"recompile")
        weights[alias] = weights[name]
    return weights


def read_kernels(path: Path) -> dict[str, str]:
    kernels_dir = path / KERNELS_DIR
    if not kernels_dir.is_dir():
        return {}
    return {name: (kernels_dir / name).read_text() for name in list_files(kernels_dir)}


def read_data(path: Path) -> dict[str, bytes]:
    data_dir = path / DATA_DIR
    if not data_dir.is_dir():
        return {}
    return {f"{DATA_DIR}/{name}": (data_dir / name).read_bytes() for name in list_files(data_dir)}


def read_text(path: Path, name: str) -> str:
    """A JSON document of the artifact (graph.json, plan.json), within bounded_input's cap."""
    try:
        return read_json_bytes(path / name, f"artifact '{path}': file {name}", ArtifactError).decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact '{path}': file {name} cannot be read ({e}); recompile") from e


def load_tokenizer(artifact: Artifact):
    """The artifact's tokenizer as a transformers PreTrainedTokenizerFast, checked as untrusted input
    and against the model's vocabulary (compiler/tokenizer_files.py)."""
    return load_checked(artifact.tokenizer_dir, artifact.manifest["model"]["vocab_size"], f"artifact '{artifact.path}'")


def list_files(root: Path) -> list[str]:
    """Every file under root, as sorted POSIX paths relative to it."""
    found = []
    for directory, _, files in os.walk(root):
        found += [(Path(directory) / f).relative_to(root).as_posix() for f in files]
    return sorted(found)


def checked_relative(name: str, what: str) -> PurePosixPath:
    relative = PurePosixPath(name)
    if not relative.parts or "\\" in name or relative.is_absolute() or ".." in relative.parts:
        raise ArtifactError(f"{what} is not a plain relative path inside the artifact")
    return relative


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dump_json(value) -> str:
    return json.dumps(value, sort_keys=True, indent=1) + "\n"
