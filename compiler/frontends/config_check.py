"""Check a model config's sizes and constants (positive, bounded integers; finite positive floats)
before any model is built from it, so a hostile value is named instead of crashing a constructor."""

from __future__ import annotations

import math

from llmc.errors import ModelLoadError

# Sizes every supported architecture reads; an absent one takes transformers' default.
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
TOKEN_FIELDS = ("bos_token_id", "eos_token_id")  # the ids the runtime uses; eos may be a list
MAX_SIZE = 2**31 - 1  # no real model dimension comes near; bigger ones overflow tensor constructors


def check_config_values(config, where: str) -> None:
    """Refuse a config (a transformers config, or config.json's object before transformers reads it)
    whose sizes are not positive integers up to MAX_SIZE, whose KV heads do not divide its attention
    heads, whose norm epsilon or rope theta is not a positive finite number, or whose special token
    ids lie outside the vocabulary."""
    get = config.get if isinstance(config, dict) else lambda field: getattr(config, field, None)
    for field in SIZE_FIELDS:
        value = get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
            raise ModelLoadError(f"{where}: {field} is {value!r}; expected a positive integer up to {MAX_SIZE}: "
                                 f"restore the original config")
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads}); restore the original config")
    for field in POSITIVE_FLOAT_FIELDS:
        value = float_setting(get, field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{where}: {field} is {value!r}; expected a positive finite number: "
                                 f"restore the original config")
    check_token_ids(get, where)


def float_setting(get, field: str):
    """A float setting, wherever this transformers version keeps it (rope_theta moved into rope_parameters)."""
    value = get(field)
    if value is None and isinstance(get("rope_parameters"), dict):
        value = get("rope_parameters").get(field)
    return value


def check_token_ids(get, where: str) -> None:
    vocab_size = get("vocab_size")
    for field in TOKEN_FIELDS:
        value = get(field)
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                    isinstance(vocab_size, int) and token >= vocab_size):
                vocabulary = f"the {vocab_size}-token vocabulary" if isinstance(vocab_size, int) else "any vocabulary"
                raise ModelLoadError(f"{where}: {field} {value!r} is not a token id of {vocabulary}; "
                                     f"restore the original config")
