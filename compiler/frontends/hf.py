"""Load a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files) with
transformers' own model classes, after checking each file so a bad one is named plainly."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from llmc.compiler.frontends.config_check import check_attention_fields, check_config_values
from llmc.compiler.frontends.model import (
    LoadedModel,
    call_transformers,
    first_line,
    hash_files,
    read_json_object,
)
from llmc.compiler.frontends.safetensors_table import INDEX, read_safetensors_table, read_tensor, tensor_files
from llmc.compiler.frontends.tensor_table import (
    StoredTensor,
    check_loading_info,
    check_tensor_table,
    empty_model,
    load_weights,
    meta_model,
    placeholder,
    with_tied_names,
)
from llmc.compiler.weight_store import LazyTensor
from llmc.errors import ModelLoadError, UnsupportedModelError

EXPECTED_FILES = "config.json, *.safetensors and tokenizer files (tokenizer.json or tokenizer.model)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# JSON files transformers reads from a checkpoint directory besides config.json.
JSON_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", INDEX)


def load_hf_dir(path: Path, source: str | None = None, lazy: bool = False) -> LoadedModel:
    """Check and load the checkpoint in directory `path`; with `lazy`, a checkpoint whose tensors
    load under their own names stays in its files until read (LoadedModel.lazy_weights)."""
    config_path = find_config(path)
    check_config_values(read_config(config_path), f"'{config_path}'")
    for weights in find_safetensors(path):
        check_safetensors(weights)
    check_tokenizer_files(path)
    check_json_files(path)
    config = call_transformers(path, AutoConfig.from_pretrained, path, local_files_only=True)
    check_attention_fields(config, f"'{config_path}'")
    where, stored = read_safetensors_table(path)
    meta = meta_model(config, f"'{config_path}'")
    check_tensor_table(meta, stored, where)
    tokenizer = call_transformers(path, AutoTokenizer.from_pretrained, path, local_files_only=True)
    check_tokenizer(tokenizer, path)
    if lazy and loads_by_name(meta, stored):
        module, values = lazy_module(path, config, stored, where)
    else:
        module, values = pretrained_module(path, config, where), {}
    return LoadedModel(module=module.eval(), config=module.config, tokenizer=tokenizer,
                       name=path.resolve().name, source_hash=hash_source_dir(path),
                       source=source or str(path), kind="hf", lazy_weights=values)


def pretrained_module(path: Path, config, where: str) -> torch.nn.Module:
    """The model as transformers loads it, every weight read into float32."""
    module, info = call_transformers(path, AutoModelForCausalLM.from_pretrained, path, config=config,
                                     dtype=torch.float32, attn_implementation=attention_implementation(config),
                                     use_safetensors=True,
                                     local_files_only=True, output_loading_info=True)
    check_loading_info(info, where)
    return module


def loads_by_name(meta: torch.nn.Module, stored: dict[str, StoredTensor]) -> bool:
    """Whether every stored tensor is a float tensor the model holds under the same name, so it can
    be read into place without transformers' renames and merges."""
    names = set(meta.state_dict())
    return all(name in names and tensor.is_float for name, tensor in stored.items())


def lazy_module(path: Path, config, stored: dict[str, StoredTensor], where: str):
    """The model on untouched placeholders, and each weight as a lazy float32 read of its file."""
    module = empty_model(config, where, attention_implementation(config))
    files = tensor_files(path)
    values = {name: LazyTensor(t.shape, torch.float32, lambda f=files[name], n=name: read_tensor(f, n).float())
              for name, t in stored.items()}
    load_weights(module, {name: placeholder(t) for name, t in values.items()}, where)
    return module, with_tied_names(module, values)


def find_config(path: Path) -> Path:
    config_path = path / "config.json"
    if not config_path.is_file():
        found = sorted(p.name for p in path.iterdir())
        more = " …" if len(found) > 12 else ""
        listing = f"found {', '.join(found[:12])}{more}" if found else "it is empty"
        raise ModelLoadError(f"directory '{path}' is not a model: no config.json ({listing}); "
                             f"expected {EXPECTED_FILES}")
    return config_path


def read_config(config_path: Path) -> dict:
    """config.json's object, once transformers has a causal-LM class for its model_type, its
    architecture is that class, and it is not pre-quantised."""
    config = read_json_object(config_path)
    check_causal_lm_class(config, config_path)
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UnsupportedModelError(f"'{config_path}': the checkpoint is pre-quantised (quantization_config "
                                    f"{method!r}); pass its float checkpoint and quantise with "
                                    f"`llmc compile --quant`")
    return config


def check_causal_lm_class(config: dict, config_path: Path) -> None:
    """Any decoder transformers builds as a causal LM may go on to tracing, where lowering decides
    whether llmc computes it; a model_type without such a class, or an architecture naming another
    class (a classifier head, another model's class), is refused here."""
    model_type = config.get("model_type")
    expected = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    if expected is None:
        raise UnsupportedModelError(f"'{config_path}': model_type {model_type!r} has no causal-LM class in "
                                    f"transformers {transformers.__version__}; llmc compiles decoder-only causal "
                                    f"LMs (model types such as llama, qwen3, gemma, gpt_neox, gpt2)")
    architectures = config.get("architectures") or [expected]
    if not isinstance(architectures, list):
        raise ModelLoadError(f"'{config_path}': architectures is {architectures!r}, not a list of class names; "
                             f"restore the original config")
    if architectures[0] != expected:
        raise UnsupportedModelError(f"'{config_path}': architecture {architectures[0]} is not supported: llmc "
                                    f"compiles the causal LM of model_type {model_type!r}, {expected}; pass "
                                    f"a causal-LM checkpoint or restore the original config")


def attention_implementation(config) -> str:
    """SDPA where the model class has it (lowering raises whole SDPA calls), else eager attention
    (lowering raises its matmul-softmax-matmul, or refuses it)."""
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def find_safetensors(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (f" (found {', '.join(pickled)}: llmc reads only safetensors; re-save with "
                f"save_pretrained(dir, safe_serialization=True))" if pickled else "")
        raise ModelLoadError(f"directory '{path}' has no *.safetensors weights{hint}")
    return files


def check_safetensors(path: Path) -> None:
    """safe_open checks the header and that the tensors exactly cover the file (catches truncation)."""
    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"weights file '{path}' is truncated or corrupt ({first_line(e)}); "
                             f"re-download or re-save it") from e


def check_tokenizer_files(path: Path) -> None:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"directory '{path}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                             f"save one there with tokenizer.save_pretrained(dir)")


def check_json_files(path: Path) -> None:
    """Each JSON file transformers will read holds a JSON object, and tokenizer.json a tokenizer."""
    for name in JSON_FILES:
        if (path / name).is_file():
            read_json_object(path / name)
    tokenizer_json = path / "tokenizer.json"
    if tokenizer_json.is_file():
        try:
            Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise ModelLoadError(f"'{tokenizer_json}' is not a valid tokenizer ({first_line(e)}); "
                                 f"re-download it or save one with tokenizer.save_pretrained(dir)") from e


def check_tokenizer(tokenizer, path: Path) -> None:
    """The runtime encodes with it: refuse a setting it would crash on, then encode once."""
    limit = tokenizer.model_max_length
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ModelLoadError(f"'{path / 'tokenizer_config.json'}': model_max_length is {limit!r}; expected a "
                             f"positive integer: restore the original file")
    call_transformers(path, tokenizer, "Hello, world")


def hash_source_dir(path: Path) -> str:
    """Hash every visible file at the top of the directory, the model's source bytes."""
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    return hash_files(files, root=path)

