"""Check a model config's sizes and constants (positive, bounded integers; finite positive floats)
before any model is built from it, so a hostile value is named instead of crashing a constructor."""

from __future__ import annotations

import math

from llmc.errors import ModelLoadError

# Sizes every supported architecture reads; head_dim may be absent (hidden_size / heads is meant).
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
OPTIONAL_FIELDS = ("head_dim", "num_key_value_heads")
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
MAX_SIZE = 2**31 - 1  # no real model dimension comes near; bigger ones overflow tensor constructors


def check_config_values(config, where: str) -> None:
    """Refuse a config whose sizes are not positive integers up to MAX_SIZE, whose KV heads do not
    divide its attention heads, or whose norm epsilon or rope theta is not a positive finite number."""
    for field in SIZE_FIELDS:
        value = getattr(config, field, None)
        if value is None and field in OPTIONAL_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
            raise ModelLoadError(f"{where}: {field} is {value!r}; expected a positive integer up to {MAX_SIZE}: "
                                 f"restore the original config")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads}); restore the original config")
    for field in POSITIVE_FLOAT_FIELDS:
        value = float_setting(config, field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{where}: {field} is {value!r}; expected a positive finite number: "
                                 f"restore the original config")


def float_setting(config, field: str):
    """A float setting, wherever this transformers version keeps it (rope_theta moved into rope_parameters)."""
    value = getattr(config, field, None)
    if value is None and isinstance(getattr(config, "rope_parameters", None), dict):
        value = config.rope_parameters.get(field)
    return value
