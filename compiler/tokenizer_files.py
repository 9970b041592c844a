"""An artifact's tokenizer, read as the untrusted input it is: every file within the JSON size cap,
tokenizer.json and tokenizer_config.json valid JSON of bounded depth, no `auto_map` to custom code,
every token id inside the model's embedding; then transformers loads it, and what it still refuses
is one ArtifactError naming the file. Chat templates run in transformers' Jinja sandbox; a template
the sandbox stops (or that fails) is one RuntimeLlmcError too."""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.bounded_input import JSON_BYTES_ENV, json_limit, parse_json, read_json_bytes
from llmc.errors import ArtifactError, RuntimeLlmcError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def load_tokenizer(folder: Path, vocab_size: int, where: str):
    """The tokenizer in `folder` (a transformers PreTrainedTokenizerFast) for a model whose embedding
    has `vocab_size` rows, after the checks above; `where` names the artifact in errors."""
    check_tokenizer_files(folder, vocab_size, where)
    # transformers: ~0.5 s after torch; compiler.artifact imports this module for every reader
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:   # tokenizers reports a bad file as a bare Exception; transformers as many kinds
        raise ArtifactError(f"{where}: its tokenizer cannot be loaded ({_first_line(e)}); recompile") from None
    if len(tokenizer) > vocab_size:
        raise ArtifactError(f"{where}: its tokenizer has {len(tokenizer)} tokens, more than the model's embedding "
                            f"has rows ({vocab_size}); recompile")
    try:   # settings transformers accepts at load but trips on at use (a list for model_max_length)
        tokenizer.decode(tokenizer(SMOKE_TEXT)["input_ids"])
    except Exception as e:
        raise ArtifactError(f"{where}: its tokenizer fails on plain text ({type(e).__name__}: {_first_line(e)}); "
                            f"recompile") from None
    return tokenizer


def check_tokenizer_files(folder: Path, vocab_size: int, where: str) -> None:
    if not folder.is_dir():
        raise ArtifactError(f"{where} has no tokenizer/ directory; recompile")
    limit = json_limit()
    for file in sorted(folder.iterdir()):
        if file.stat().st_size > limit:
            raise ArtifactError(f"{where}: tokenizer/{file.name} is larger than {limit >> 20} MiB; recompile, or set "
                                f"{JSON_BYTES_ENV} (bytes) to raise the limit")
    config = _json_object(folder / TOKENIZER_CONFIG, where)
    if config is not None and "auto_map" in config:
        raise ArtifactError(f"{where}: tokenizer/{TOKENIZER_CONFIG} field 'auto_map' names custom tokenizer code, "
                            f"which llmc never runs; recompile from a model whose tokenizer transformers ships")
    if config is not None:
        _check_config_fields(config, where)
    tokenizer = _json_object(folder / TOKENIZER_JSON, where)
    if tokenizer is not None:
        _check_ids(tokenizer, vocab_size, where)


SMOKE_TEXT = "Hello, world! 123 <b>é</b>\n"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_FLAGS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "legacy", "do_lower_case")


def _bad_config_field(config: dict) -> str | None:
    """The first tokenizer_config.json field whose value is not of the kind transformers uses."""
    for key in _SPECIAL:
        value = config.get(key)
        if not (value is None or isinstance(value, str)
                or isinstance(value, dict) and isinstance(value.get("content"), str)):
            return key
    for key in _FLAGS:
        if not isinstance(config.get(key, False), (bool, type(None))):
            return key
    length = config.get("model_max_length", 1)
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not length >= 1:
        return "model_max_length"
    for key in ("padding_side", "truncation_side"):
        if config.get(key, "left") not in ("left", "right"):
            return key
    template = config.get("chat_template")
    if not (template is None or isinstance(template, str) or isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in template)):
        return "chat_template"
    return None


def _check_config_fields(config: dict, where: str) -> None:
    bad = _bad_config_field(config)
    if bad is not None:
        raise ArtifactError(f"{where}: tokenizer/{TOKENIZER_CONFIG} field {bad!r} holds "
                            f"{json_repr(config[bad])}, not what a tokenizer takes there; recompile")


def json_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_object(path: Path, where: str) -> dict | None:
    if not path.is_file():
        return None
    what = f"{where}: tokenizer/{path.name}"
    value = parse_json(read_json_bytes(path, what, ArtifactError), what, ArtifactError, "; recompile")
    if not isinstance(value, dict):
        raise ArtifactError(f"{what} holds no JSON object; recompile")
    return value


def _check_ids(tokenizer: dict, vocab_size: int, where: str) -> None:
    """Every id tokenizer.json gives a token must name a row of the model's embedding."""
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = (list(vocab.values()) if isinstance(vocab, dict)
           else list(range(len(vocab))) if isinstance(vocab, list) else [])
    added = tokenizer.get("added_tokens")
    ids += [t.get("id") for t in added if isinstance(t, dict)] if isinstance(added, list) else []
    bad = next((i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size), None)
    if bad is not None or len(ids) > 2 * vocab_size + 1024:
        shown = f"token id {bad!r}" if bad is not None else f"{len(ids)} tokens"
        raise ArtifactError(f"{where}: tokenizer/{TOKENIZER_JSON} has {shown}, which the model's embedding of "
                            f"{vocab_size} rows does not fit; recompile")


def render_chat_template(tokenizer, messages, where: str, tools: list[dict] | None = None) -> str:
    """The prompt the tokenizer's chat template makes of `messages` (and the `tools` it offers), run in
    transformers' Jinja sandbox; a template the sandbox stops (SecurityError, a range too big) or that
    fails is refused."""
    import jinja2  # jinja2: only chat templates; the engine imports this module (tests/test_lean_runtime.py)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, OverflowError, MemoryError, RecursionError, ArithmeticError, LookupError,
            TypeError, ValueError, AttributeError) as e:
        raise RuntimeLlmcError(f"the chat template of {where} failed ({type(e).__name__}: {_first_line(e)}); "
                               f"pass plain prompts, or recompile with a working template") from None


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__


def vocab_difference(ours: dict[str, int], theirs: dict[str, int], we: str, they: str) -> str:
    """The first way two vocabularies (token -> id) differ, for an error line naming both roles."""
    if len(ours) != len(theirs):
        return f"{len(ours)} tokens against {len(theirs)}"
    token = min(t for t in ours if theirs.get(t) != ours[t])
    return f"token {token!r} is id {ours[token]} in the {we} and {theirs.get(token)} in the {they}"


__all__ = ["vocab_difference", "check_tokenizer_files", "load_tokenizer", "render_chat_template"]
