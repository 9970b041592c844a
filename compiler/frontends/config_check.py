"""Check a model config's sizes and constants (positive, bounded integers; finite positive floats)
before any model is built from it, so a hostile value is named instead of crashing a constructor;
and read the fields that change what attention computes: a sliding window is carried into the IR
(per layer), the others are refused, since lowering has no op for them."""

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


# Config fields that change what attention computes and that llmc does not carry, with what they do.
UNCARRIED_ATTENTION_FIELDS = {
    "alibi": "adds ALiBi position biases to attention scores",
    "attention_chunk_size": "restricts attention to fixed chunks",
    "use_bidirectional_attention": "makes attention bidirectional",
}
# Rotary variants whose frequencies depend on the sequence length: a trace fixes one length's.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_attention_fields(config, where: str) -> None:
    """Refuse a transformers config that sets an attention field llmc does not carry, naming it."""
    text = getattr(config, "text_config", config)
    for field, effect in UNCARRIED_ATTENTION_FIELDS.items():
        value = getattr(text, field, None)
        if value not in (None, False, 0):
            raise ModelLoadError(f"{where}: {field}={value!r} {effect}, which llmc does not compile; "
                                 f"pass a model without it")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} changes the rotary frequencies with the "
                             f"sequence length, which llmc does not compile; pass a model with another rope")


def attention_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention) as the config gives it: Mistral's
    `sliding_window` on every layer, or on the layers `layer_types` marks "sliding_attention"
    (Qwen2's max_window_layers, Gemma 2's alternation); Qwen2's use_sliding_window=false turns it off."""
    text = getattr(config, "text_config", config)
    layers = getattr(text, "num_hidden_layers", 0)
    window = getattr(text, "sliding_window", None)
    if window is None or getattr(text, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(text, "layer_types", None)
    if types is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in types]
