"""Property: whatever an attacker writes into an artifact's plan.json, graph.json and manifest.json
(random aten op names, attrs, shapes and values, deletions; every hash re-computed), llmc.load
either refuses it with an LlmcError or loads it and generates, with no other exception and no file
written outside the test's temporary directory."""

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmc
from llmc.compiler.artifact import sha256_file
from llmc.errors import LlmcError
from llmc.runtime.sampling_params import SamplingParams

FILES = ("plan.json", "graph.json", "manifest.json")
ATEN_NAMES = sorted(n for n in dir(torch.ops.aten) if not n.startswith("_ops") and n.isidentifier())
KERNEL_OPS = ("aten", "linear", "rms_norm", "attention", "flash_attention", "qlinear", "split", "swiglu",
              "add_rms_norm", "embedding", "select_rows", "cast", "rope", "silu", "mul", "add", "no_such_op")
SYMBOLS = ("tokens", "rows", "tokens*2", "tokens//0", "rows+tokens", "x", "tokens*100000000000", "-tokens")

# JSON leaves an attacker might write: edge-case numbers, dtype and op names, references.
_numbers = st.one_of(st.integers(-3, 3), st.integers(0, 130),
                     st.sampled_from([0, -1, 2 ** 31, 2 ** 62, 10 ** 12, 10 ** 30]),
                     st.floats(allow_nan=True, allow_infinity=True))
_leaves = st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=8),
                    st.sampled_from(["float32", "int64", "bfloat16", "symint", "complex64", "tokens", "logits",
                                     "input_ids", "cpu.aten", "cpu.linear", "aten.add.Tensor", "{layer}"]),
                    st.sampled_from(SYMBOLS), st.builds(lambda k: {"$in": k}, st.integers(-1, 6)),
                    st.sampled_from([{"$dtype": "float32"}, {"$dtype": "qint8"}, {"$device": "meta"},
                                     {"$layout": "sparse_coo"}, {"$float": "nan"}, {"$memory_format": "__class__"}]))
# each draw a fresh copy: sampled_from gives its dicts themselves, so an edit inside one drawn earlier changed
# the strategy's constant, and a later draw of it put the dict inside itself (a cycle, a RecursionError)
_json = st.recursive(_leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=8).map(copy.deepcopy)


def _paths(value, prefix=()):
    """Every path (tuple of keys and indices) into a JSON value."""
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _parent(doc, path):
    for key in path[:-1]:
        doc = doc[key]
    return doc


def _steps(doc) -> list:
    steps = doc.get("steps", doc.get("nodes"))
    return steps if isinstance(steps, list) and steps and all(isinstance(x, dict) for x in steps) else []


def _pick(data, items: list, label: str):
    """One of `items`, drawn as an index in a fixed range: the lists come from the document as earlier
    edits left it, and a draw whose bounds follow their length made hypothesis report "inconsistent
    data generation" (a 646- against a 653-path manifest) when it replayed a prefix."""
    return items[data.draw(st.integers(0, 1 << 16), label=label) % len(items)]


def _mutate(data, doc):
    """One random edit of a JSON document, in place: anywhere (replace, delete, duplicate), or aimed
    at what the runtime interprets (a step's op, attrs, aten target and arguments, a value's shape)."""
    steps = _steps(doc)
    aimed = ["aten", "attr", "kernel", "shape"] if steps else []
    kind = _pick(data, ["replace", "delete", "duplicate"] + aimed, "kind")
    if kind in ("replace", "delete", "duplicate"):
        path = _pick(data, [p for p in _paths(doc) if p], "path")
        parent, key = _parent(doc, path), path[-1]
        if kind == "delete":
            del parent[key]
        elif kind == "duplicate" and isinstance(parent, list):
            parent.insert(_pick(data, range(len(parent) + 1), "position"), parent[key])
        else:
            parent[key] = data.draw(_json, label="value")
        return
    step = _pick(data, steps, "step")
    attrs = step["attrs"] = step["attrs"] if isinstance(step.get("attrs"), dict) else {}
    if kind == "aten":
        name = data.draw(st.sampled_from(ATEN_NAMES), label="aten op")
        overloads = getattr(getattr(torch.ops.aten, name), "overloads", lambda: ["default"])() or ["default"]
        overload = data.draw(st.sampled_from(overloads), label="overload")
        refs = st.builds(lambda k: {"$in": k}, st.integers(0, 4))
        attrs.update(target=f"aten.{name}.{overload}",
                     args=data.draw(st.lists(st.one_of(refs, _numbers, st.lists(st.integers(-2, 8), max_size=3), _json),
                                             max_size=4), label="args"),
                     kwargs=data.draw(st.dictionaries(st.sampled_from(["dim", "dtype", "alpha", "out", "keepdim"]),
                                                      _json, max_size=2), label="kwargs"))
        step.update({"kernel": "cpu.aten"} if "kernel" in step else {"op": "aten"})
    elif kind == "attr":
        key = _pick(data, sorted(attrs) + ["layer", "head_dim", "extra"], "attr")
        attrs[key] = data.draw(st.one_of(_numbers, _json), label="attr value")
    elif kind == "kernel":
        op = data.draw(st.sampled_from(KERNEL_OPS), label="op")
        step.update({"kernel": f"cpu.{op}"} if "kernel" in step else {"op": op})
    else:
        names = [v for v in step.get("outputs", []) + step.get("inputs", []) if isinstance(v, str)]
        types = doc.get("types") if isinstance(doc.get("types"), dict) else {}
        name = _pick(data, names, "value") if names else None
        if isinstance(types.get(name), dict):
            types[name]["shape"] = data.draw(st.lists(st.one_of(_numbers, st.sampled_from(SYMBOLS)), max_size=4),
                                             label="shape")


@pytest.fixture(scope="module")
def originals(artifact):
    return {name: json.loads((artifact / name).read_text()) for name in FILES}


@pytest.fixture(scope="module")
def sandbox(artifact, tmp_path_factory):
    """A working copy of the artifact (rewritten by every example) and, beside it, a file that
    must never change."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(artifact, root / "work.llmc")
    (root / "victim.bin").write_bytes(os.urandom(64))
    return root


class WriteWatch:
    """Records every file opened for writing, renamed or removed outside the allowed roots (an
    audit hook: it also sees what torch and transformers do on llmc's behalf through Python)."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def __init__(self, allowed: list[Path]):
        self.allowed = [str(p.resolve()) for p in allowed]
        self.armed = False
        self.seen: list[tuple] = []
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if not self.armed:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1] or "r", args[2] or 0
            if any(c in str(mode) for c in "wax+") or flags & self.WRITE_FLAGS:
                self._check(event, args[0])
        elif event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"):
            self._check(event, args[0])

    def _check(self, event, path):
        resolved = os.path.realpath(os.fsdecode(path)) if not isinstance(path, int) else str(path)
        if not any(resolved.startswith(root) for root in self.allowed):
            self.seen.append((event, resolved))


@pytest.fixture(scope="module")
def watch(sandbox):
    return WriteWatch([sandbox / "work.llmc", Path(tempfile.gettempdir())])


def _write(sandbox: Path, docs: dict) -> Path:
    """Write the documents into the working copy, the manifest listing the new files' sha256."""
    work = sandbox / "work.llmc"
    files = docs["manifest.json"].get("files")
    for name in FILES[:2]:
        (work / name).write_text(json.dumps(docs[name]))
        if isinstance(files, dict) and name in files:
            files[name] = sha256_file(work / name)
    (work / "manifest.json").write_text(json.dumps(docs["manifest.json"]))
    return work


def _load_and_generate(work: Path):
    try:
        llm = llmc.load(work, kv_memory="256KiB")
    except LlmcError:
        return
    try:
        llm.generate(["hi there", {"prompt_token_ids": [3, 1, 4]}], SamplingParams(max_tokens=2))
    except LlmcError:
        pass


@settings(max_examples=int(os.environ.get("LLMC_FUZZ_EXAMPLES", 500)), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_a_tampered_artifact_is_refused_or_runs_and_writes_nothing_outside(originals, sandbox, watch, data):
    docs = json.loads(json.dumps(originals))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        name = data.draw(st.sampled_from(FILES), label="file")
        _mutate(data, docs[name])
    victim = (sandbox / "victim.bin").read_bytes()
    work = _write(sandbox, docs)
    watch.armed = True
    try:
        _load_and_generate(work)
    finally:
        watch.armed = False
    assert not watch.seen, watch.seen
    assert (sandbox / "victim.bin").read_bytes() == victim
