"""A manifest is not hashed, so `llmc run` and `llmc inspect` check it: each `model` field edited
to another well-typed value is refused because graph.json and plan.json say otherwise, and each
edited to a wrong type is refused by the schema; either way one line naming the field, exit 2."""

import json
import random
from pathlib import Path

import pytest
from llmc_cli import error_line, llmc_in_process

MODEL_FIELDS = ["num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                "max_position_embeddings", "kv_bytes_per_token", "eos_token_ids", "bos_token_id", "kv_dtype",
                "kv_cache", "architecture", "hf_config"]
COMMANDS = [("run", "--prompt", "hello", "--max-tokens", "2"), ("inspect",)]


def set_model_field(art: Path, field: str, value) -> None:
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["model"][field] = value
    (art / "manifest.json").write_text(json.dumps(manifest))


def other_value(field: str, value, rng: random.Random):
    """A well-typed value of `field` that differs from `value`."""
    if field == "eos_token_ids":
        return [value[0] + rng.randint(1, 9)]
    if isinstance(value, int):
        return value + rng.randint(1, 9)
    if field == "kv_dtype":
        return rng.choice(["bfloat16", "float16", "int8"])
    if field == "kv_cache":
        return {"dtype": "int8", "scales": "static", "scale_params": "kv_scales.{layer}"}
    if field == "architecture":
        return rng.choice(["MistralForCausalLM", "Qwen2ForCausalLM"])
    return {**value, "num_key_value_heads": value["num_key_value_heads"] + rng.randint(1, 9)}


def ill_typed_value(field: str, rng: random.Random):
    """A value of the wrong type (or out of range) for `field`."""
    choices = {"architecture": [7, None, ["LlamaForCausalLM"]],
               "bos_token_id": ["1", 1.0, True, -1],
               "eos_token_ids": [2, ["2"], [2.0], [-1], None],
               "kv_dtype": ["float33", 4, None],
               "kv_cache": [[], "float32", None, {"dtype": "nope"}, {"dtype": "int8", "scale_params": "{0}"}],
               "hf_config": [[], "x", None],
               **dict.fromkeys(["name", "source_kind", "source_sha256"], [5, None, ["x"], {"a": 1}])}
    default = [str(rng.randint(1, 99)), float(rng.randint(1, 99)), True, 0, -rng.randint(1, 99), None, [2]]
    return rng.choice(choices.get(field, default))


def refused_by_both_commands(art: Path, capfd) -> list[str]:
    messages = []
    for command in COMMANDS:
        code, stdout, err = llmc_in_process(capfd, command[0], art, *command[1:])
        assert code == 2 and stdout == "", (command, err)
        messages.append(error_line(err))
    return messages


@pytest.mark.parametrize("field", MODEL_FIELDS)
def test_a_model_field_at_odds_with_graph_and_plan_is_refused_naming_it_and_both_values(field, art, capfd):
    before = json.loads((art / "manifest.json").read_text())["model"][field]
    after = other_value(field, before, random.Random())
    set_model_field(art, field, after)
    for message in refused_by_both_commands(art, capfd):
        assert f"model.{field} is " in message and str(art) in message and "recompile" in message, message
        if field not in ("kv_cache", "hf_config"):  # tables are shortened in the line
            assert json.dumps(after) in message and json.dumps(before) in message, message


@pytest.mark.parametrize("field", MODEL_FIELDS + ["name", "source_kind", "source_sha256"])
def test_a_model_field_of_the_wrong_type_is_refused_naming_it(field, art, capfd):
    bad = ill_typed_value(field, random.Random())
    set_model_field(art, field, bad)
    for message in refused_by_both_commands(art, capfd):
        assert f"model.{field}" in message and str(art) in message, message


def test_a_missing_model_field_is_refused_naming_it(art, capfd):
    field = random.choice(MODEL_FIELDS)
    manifest = json.loads((art / "manifest.json").read_text())
    del manifest["model"][field]
    (art / "manifest.json").write_text(json.dumps(manifest))
    for message in refused_by_both_commands(art, capfd):
        assert f"model.{field} is missing" in message, message
