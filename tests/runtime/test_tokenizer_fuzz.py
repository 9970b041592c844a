"""Property: whatever an attacker writes into an artifact's tokenizer files (tokenizer.json's vocabulary,
merges, added tokens, normaliser and pre-tokeniser; tokenizer_config.json's fields and chat
template, hostile Jinja included; every hash re-computed), llmc.load and LLM.chat either refuse
it with an LlmcError or run, with no other exception and no file written outside the test's
temporary directory (the audit hook of test_artifact_fuzz)."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_artifact_fuzz import WriteWatch, _json, _mutate, _paths, _pick

import llmc
from llmc.compiler.artifact import sha256_file
from llmc.errors import LlmcError
from llmc.runtime.sampling_params import SamplingParams

FILES = ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")
# templates an attacker or a careless operator might ship: sandbox escapes, huge loops and strings,
# recursion, undefined names, raise_exception, and plain text that is not Jinja at all
TEMPLATES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for i in range(10**9) %}x{% endfor %}",
    "{{ 'a' * 10**9 }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ raise_exception('no') }}",
    "{{ messages[0].content.upper() }}{{ undefined_thing.attr }}",
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{{ cycler.__init__.__globals__ }}",
    "{% set x = namespace(a=1) %}{{ x.__dict__ }}",
    "{%",
    "",
)


@pytest.fixture(scope="module")
def sandbox(artifact, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokfuzz")
    shutil.copytree(artifact, root / "work.llmc")
    (root / "victim.bin").write_bytes(os.urandom(64))
    return root


@pytest.fixture(scope="module")
def originals(artifact):
    return {name: json.loads((artifact / name).read_text()) for name in FILES}


@pytest.fixture(scope="module")
def watch(sandbox):
    return WriteWatch([sandbox / "work.llmc", Path(tempfile.gettempdir())])


def _edit(data, docs: dict) -> None:
    name = data.draw(st.sampled_from(FILES), label="file")
    doc = docs[name]
    if name.endswith("config.json") and data.draw(st.booleans(), label="template"):
        doc["chat_template"] = data.draw(st.one_of(st.sampled_from(TEMPLATES), st.text(max_size=40)),
                                         label="chat_template")
    elif name.endswith("tokenizer.json") and data.draw(st.booleans(), label="aimed"):
        path = _pick(data, [p for p in _paths(doc) if p and p[0] in ("model", "added_tokens", "normalizer",
                                                                     "pre_tokenizer", "decoder")], "path")
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(_json, label="value")
    else:
        _mutate(data, doc)


def _write(work: Path, docs: dict) -> None:
    manifest = json.loads((work / "manifest.json").read_text())
    for name, doc in docs.items():
        (work / name).write_text(json.dumps(doc))
        if name in manifest.get("files", {}):
            manifest["files"][name] = sha256_file(work / name)
    (work / "manifest.json").write_text(json.dumps(manifest))


def _load_and_chat(work: Path) -> None:
    try:
        llm = llmc.load(work, kv_memory="256KiB")
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
        llm.generate(["hi there"], SamplingParams(max_tokens=2))
    except LlmcError:
        pass


@settings(max_examples=int(os.environ.get("LLMC_FUZZ_EXAMPLES", 25)), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_tampered_tokenizer_files_are_refused_or_run_and_write_nothing_outside(originals, sandbox, watch, data):
    docs = json.loads(json.dumps(originals))
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        _edit(data, docs)
    victim = (sandbox / "victim.bin").read_bytes()
    work = sandbox / "work.llmc"
    _write(work, docs)
    watch.armed = True
    try:
        _load_and_chat(work)
    finally:
        watch.armed = False
        _write(work, originals)
    assert not watch.seen, watch.seen
    assert (sandbox / "victim.bin").read_bytes() == victim


@pytest.mark.parametrize("field,value", [("model_max_length", []), ("model_max_length", 0), ("eos_token", 5),
                                         ("add_bos_token", "yes"), ("padding_side", "middle"),
                                         ("chat_template", {"a": 1})])
def test_a_tokenizer_config_field_of_the_wrong_kind_is_refused_naming_it(artifact, tmp_path, field, value):
    work = tmp_path / "work.llmc"
    shutil.copytree(artifact, work)
    config = json.loads((work / FILES[1]).read_text())
    config[field] = value
    _write(work, {FILES[1]: config})
    with pytest.raises(LlmcError, match=f"field '{field}'"):
        llmc.load(work, kv_memory="256KiB")
