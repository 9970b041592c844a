"""Check a checkpoint's tensor table (names, shapes and dtypes read from file headers) against the
tensors its config's model defines, built on the meta device: a missing, extra, misshapen or
non-float tensor is refused in one line before any weight is allocated."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from llmc.compiler.frontends.model import first_line
from llmc.compiler.weight_store import LazyTensor
from llmc.errors import ModelLoadError

try:
    from transformers import conversion_mapping  # transformers 5 only
except ImportError:
    conversion_mapping = None

SHOWN_NAMES = 4


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a checkpoint file declares it, in the model's (torch) dimension order."""
    shape: tuple[int, ...]
    dtype: str           # the file's own name for it: "F32", "BF16", "Q4_1", "I32", ...
    is_float: bool       # floating point or a float quantisation, so it can fill a float parameter


def meta_model(config, where: str) -> torch.nn.Module:
    """The config's causal-LM module on the meta device: every parameter's name and shape, no memory."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, RuntimeError, AttributeError, KeyError) as e:
        raise ModelLoadError(f"{where}: the config does not describe a model transformers can build "
                             f"({first_line(e)}); fix or re-download the config") from e


def empty_model(config, where: str, attention: str = "sdpa") -> torch.nn.Module:
    """The config's causal-LM module with its parameters on the meta device (to be assigned the
    file's tensors) and its computed buffers (rotary frequencies) built as from_pretrained does."""
    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    except (ValueError, TypeError, RuntimeError, AttributeError, KeyError) as e:
        raise ModelLoadError(f"{where}: the config does not describe a model transformers can build "
                             f"({first_line(e)}); fix or re-download the config") from e


def load_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Assign `state` to `module`'s parameters and tie what the config ties; any tensor still
    without weights (on the meta device) is refused, as from_pretrained's missing keys are."""
    module.load_state_dict(state, strict=False, assign=True)
    module.tie_weights()
    empty = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    check_loading_info({"missing_keys": empty}, where)


def placeholder(lazy: LazyTensor) -> torch.Tensor:
    """Uninitialised memory of the lazy tensor's shape for the module to be traced with: never
    read, so never resident (the compile swaps in the lazy values after tracing, see
    compiler/frontends/model.py: LoadedModel.lazy_weights)."""
    return torch.empty(lazy.shape, dtype=lazy.dtype)


def with_tied_names(module: torch.nn.Module, stored: dict) -> dict:
    """`stored` under every name its weights go by once the config's ties are made: a tied LM
    head is the embedding's tensor, and tracing may name it either way."""
    params = list(module.named_parameters(remove_duplicate=False))
    source = {id(tensor): name for name, tensor in params if name in stored}
    return stored | {name: stored[source[id(tensor)]] for name, tensor in params if id(tensor) in source}


def check_tensor_table(module: torch.nn.Module, stored: dict[str, StoredTensor], where: str) -> None:
    """Refuse unless `stored` supplies exactly the tensors of `module` (a meta model), with its shapes.

    Tied copies (an LM head tied to the embedding) need only one name of their group; tensors named
    after a computed buffer (the rotary `inv_freq` older checkpoints saved) are ignored, as
    transformers ignores them."""
    sources, targets = merged_weights(module)  # left to transformers' loading report (check_loading_info)
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()
                if not any(p.search(name) for p in targets)}
    renames = weight_renames(module)
    stored = {loaded_name(name, renames): tensor for name, tensor in stored.items()
              if not any(p.search(name) for p in sources)}
    aliases = tied_aliases(module)
    missing = [name for name in expected
               if name not in stored and not any(alias in stored for alias in aliases.get(name, ()))]
    if missing:
        raise ModelLoadError(f"{where} lacks {count(missing, 'tensor')} the config's {type(module).__name__} "
                             f"needs ({listing(missing)}); the checkpoint is incomplete: re-download or "
                             f"re-save it, and check its config matches the weights")
    computed = {name.rsplit(".", 1)[-1] for name, _ in module.named_buffers()} - set(expected)
    unexpected = [name for name in stored if name not in expected and name.rsplit(".", 1)[-1] not in computed]
    if unexpected:
        raise ModelLoadError(f"{where} holds {count(unexpected, 'tensor')} the config's {type(module).__name__} "
                             f"does not have ({listing(unexpected)}); the weights are of another architecture "
                             f"or the config was edited: pass a checkpoint whose config matches its weights")
    for name, shape in expected.items():
        tensor = stored.get(name)
        if tensor is None:
            continue  # a tied copy, supplied under another name of its group
        if tensor.shape != shape:
            raise ModelLoadError(f"{where}: tensor '{name}' is {list(tensor.shape)} in the file but the config "
                                 f"implies {list(shape)}; the config and the weights disagree: restore the "
                                 f"original config or re-download the checkpoint")
        if not tensor.is_float:
            raise ModelLoadError(f"{where}: tensor '{name}' is stored as {tensor.dtype}, not a floating-point "
                                 f"type; re-save the checkpoint with float weights")


def conversion_rules(module: torch.nn.Module, kind: str) -> list:
    """The rules of class `kind` ("WeightRenaming", "WeightConverter") transformers applies to
    checkpoint names as it loads them into `module`; none before transformers 5."""
    if conversion_mapping is None:
        return []
    cls = getattr(conversion_mapping, kind)
    return [rule for rule in conversion_mapping.get_model_conversion_mapping(module) if isinstance(rule, cls)]


def weight_renames(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(pattern, replacement) pairs for the names transformers renames (GPT-NeoX's embed_out to lm_head)."""
    return [(source, rule.target_patterns[0]) for rule in conversion_rules(module, "WeightRenaming")
            for source in rule.source_patterns]


def merged_weights(module: torch.nn.Module) -> tuple[list[re.Pattern], list[re.Pattern]]:
    """(checkpoint-name, model-name) patterns of tensors transformers merges as it loads them
    (Mixtral's per-expert weights into one tensor per layer); a `*` in a pattern is an index."""
    rules = conversion_rules(module, "WeightConverter")
    compile_all = (lambda patterns: [re.compile(re.escape(p).replace(r"\*", r"\d+")) for p in patterns])
    return ([p for rule in rules for p in compile_all(rule.source_patterns)],
            [p for rule in rules for p in compile_all(rule.target_patterns)])


def loaded_name(name: str, renames: list[tuple[str, str]]) -> str:
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name


def check_loading_info(info: dict, where: str) -> None:
    """transformers' own report after loading: any parameter it had to initialise itself is refused."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(f"{where}: transformers found no weights for {count(missing, 'tensor')} "
                             f"({listing(missing)}) and would fill them with random values; re-download "
                             f"or re-save the checkpoint")
    mismatched = [str(entry[0]) if isinstance(entry, tuple) else str(entry)
                  for entry in info.get("mismatched_keys") or ()]
    if mismatched:
        raise ModelLoadError(f"{where}: tensors {listing(mismatched)} do not have the shapes the config "
                             f"implies; restore the original config or re-download the checkpoint")


def tied_aliases(module: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter shared under several names -> the other names it goes by."""
    names_by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
    return {name: tuple(other for other in names if other != name)
            for names in names_by_tensor.values() if len(names) > 1 for name in names}


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def count(items: list, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"
