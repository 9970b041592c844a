"""Load an ONNX decoder (a `.onnx` file, or a directory holding one): input_ids [batch, tokens] (plus
optional attention_mask and position_ids) -> logits, exported without a KV cache or built by ONNX
Runtime GenAI's model builder, whose past KV inputs only its attention ops read (as the empty past:
llmc runs its own cache). The graph runs as a torch module (onnx_torch) that llmc traces and lowers
like any other model; the model config comes from a config.json beside the file, else the builder's
genai_config.json, else the model's metadata; the tokenizer from the directory. MatMulNBits weights
stored symmetric int4 keep their codes and scales (LoadedModel.stored_quant)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import onnx
import torch
import transformers

from llmc.compiler.frontends.config_check import attention_windows, check_attention_fields, check_config_values
from llmc.compiler.frontends.model import LoadedModel, call_transformers, first_line, hash_files, read_json_object
from llmc.compiler.frontends.onnx_contrib import set_windows
from llmc.compiler.frontends.onnx_torch import ONNX_DTYPES, OnnxGraphModule
from llmc.errors import ModelLoadError, UnsupportedModelError

INPUTS = ("input_ids", "attention_mask", "position_ids")
# what tracing, the KV cache and the runtime need; heads and layers are checked against the graph by lowering
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "max_position_embeddings")


def load_onnx(path: Path, source: str | None = None) -> LoadedModel:
    model_path = find_onnx(path)
    folder = model_path.parent
    proto = read_onnx(model_path)
    graph = OnnxGraphModule(proto.graph)
    inputs = check_io(proto, graph, model_path)
    config = read_config(folder, proto, model_path)
    set_windows(graph.steps, attention_windows(config))
    tokenizer = read_tokenizer(folder, model_path)
    module = OnnxCausalLM(graph, config, inputs).eval()
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")]
    return LoadedModel(module=module, config=config, tokenizer=tokenizer, name=folder.resolve().name,
                       source_hash=hash_files(files, root=folder), source=source or str(path), kind="onnx",
                       stored_quant=graph.stored_quant("graph."))


def find_onnx(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.onnx"))
    if len(found) != 1:
        raise ModelLoadError(f"directory '{path}' holds {len(found)} .onnx files "
                             f"({', '.join(p.name for p in found)}); pass the one to compile")
    return found[0]


def read_onnx(path: Path) -> onnx.ModelProto:
    try:
        proto = onnx.load(str(path))  # external data (model.onnx.data) beside it loads with it
    except Exception as e:  # protobuf's DecodeError and onnx's own errors share no base class
        raise ModelLoadError(f"'{path}' is not a readable ONNX model ({first_line(e)}); re-export it") from e
    subgraphs = [n.name or n.op_type for n in proto.graph.node
                 if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)]
    if subgraphs:
        raise UnsupportedModelError(f"'{path}': ONNX node '{subgraphs[0]}' holds a subgraph (If/Loop/Scan), "
                                    f"which llmc cannot read; export the model without control flow")
    return proto


def check_io(proto: onnx.ModelProto, graph: OnnxGraphModule, path: Path) -> dict[str, torch.dtype]:
    """The graph's inputs to feed (name -> dtype): input_ids, and optionally attention_mask and
    position_ids; any other input must be one nothing computing the logits reads (a past KV input,
    which attention reads as empty)."""
    initializers = {i.name for i in proto.graph.initializer}
    inputs = {}
    for i in proto.graph.input:
        if i.name in initializers or i.name not in INPUTS and i.name not in graph.reads:
            continue
        if i.name not in INPUTS:
            raise UnsupportedModelError(f"'{path}': ONNX input '{i.name}' is not one of {', '.join(INPUTS)}; llmc "
                                        f"reads decoders exported without a KV cache, or whose past KV inputs "
                                        f"only GroupQueryAttention reads (llmc runs its own cache)")
        inputs[i.name] = ONNX_DTYPES.get(i.type.tensor_type.elem_type, torch.int64)
    if "input_ids" not in inputs:
        raise UnsupportedModelError(f"'{path}': the ONNX graph has no input_ids input; export the decoder "
                                    f"as input_ids -> logits")
    return inputs


def read_config(folder: Path, proto: onnx.ModelProto, model_path: Path):
    """config.json beside the model, else the builder's genai_config.json, else the model's metadata;
    every REQUIRED_FIELDS must be known."""
    config_path, genai_path = folder / "config.json", folder / "genai_config.json"
    if config_path.is_file():
        data, where = read_json_object(config_path), f"'{config_path}'"
    elif genai_path.is_file():
        data, where = genai_fields(read_json_object(genai_path), genai_path), f"'{genai_path}'"
    else:
        data, where = {}, f"'{model_path}' (no config.json beside it)"
    for prop in proto.metadata_props:
        if prop.key not in data:
            try:
                data[prop.key] = json.loads(prop.value)
            except ValueError:
                data[prop.key] = prop.value
    for field in REQUIRED_FIELDS:
        if data.get(field) is None:
            raise ModelLoadError(f"{where}: the model's {field} is unknown; put a config.json with it "
                                 f"beside the .onnx file")
    check_config_values(data, where)
    model_type = data.get("model_type")
    if model_type in transformers.CONFIG_MAPPING:
        config = call_transformers(folder, transformers.AutoConfig.for_model, **data)
    else:
        config = transformers.PretrainedConfig(**data)
    check_attention_fields(config, where)
    return config


# config field -> where genai_config.json holds it, under "model"
GENAI_FIELDS = {"vocab_size": ("vocab_size",), "max_position_embeddings": ("context_length",),
                "bos_token_id": ("bos_token_id",), "eos_token_id": ("eos_token_id",),
                "pad_token_id": ("pad_token_id",), "hidden_size": ("decoder", "hidden_size"),
                "num_attention_heads": ("decoder", "num_attention_heads"),
                "num_key_value_heads": ("decoder", "num_key_value_heads"),
                "num_hidden_layers": ("decoder", "num_hidden_layers"), "head_dim": ("decoder", "head_size"),
                "sliding_window": ("decoder", "sliding_window", "window_size")}


def genai_fields(genai: dict, path: Path) -> dict:
    """The config fields genai_config.json gives. Its model type is left out: transformers would fill
    that architecture's defaults for what the file does not say (intermediate size, rope theta)."""
    data = {}
    for field, keys in GENAI_FIELDS.items():
        value = genai.get("model")
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            data[field] = value
    decoder = genai["model"].get("decoder") if isinstance(genai.get("model"), dict) else None
    window = decoder.get("sliding_window") if isinstance(decoder, dict) else None
    if isinstance(window, dict) and window.get("layers"):
        raise UnsupportedModelError(f"'{path}': decoder.sliding_window.layers={window['layers']!r} gives some "
                                    f"layers a sliding window, which llmc does not read; pass a model without it")
    return data


def read_tokenizer(folder: Path, model_path: Path):
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"'{model_path}': no tokenizer.json beside it; save the model's tokenizer in "
                             f"'{folder}' (tokenizer.save_pretrained)")
    return call_transformers(folder, transformers.AutoTokenizer.from_pretrained, folder, local_files_only=True)


class OnnxCausalLM(torch.nn.Module):
    """The ONNX graph behind a Hugging Face causal LM's call: (input_ids, position_ids) -> .logits."""

    def __init__(self, graph: OnnxGraphModule, config, inputs: dict[str, torch.dtype]):
        super().__init__()
        self.config = config
        self.inputs = inputs
        self.graph = graph
        outputs = self.graph.outputs
        self.logits_index = outputs.index("logits") if "logits" in outputs else 0

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **_) -> SimpleNamespace:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1])[None].expand_as(input_ids)
        given = {"input_ids": input_ids, "position_ids": position_ids,
                 "attention_mask": torch.ones_like(input_ids) if attention_mask is None else attention_mask}
        feeds = {name: given[name].to(dtype) for name, dtype in self.inputs.items()}
        # a graph without position_ids counts positions itself: those of a fresh sequence, which the
        # runtime's positions replace (one row: llmc traces a single sequence)
        positions = None if "position_ids" in self.inputs or input_ids.shape[0] != 1 else position_ids.reshape(-1)
        out = self.graph(feeds, positions)
        return SimpleNamespace(logits=out[self.logits_index])

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, pad_token_id: int = 0, **_) -> torch.Tensor:
        """Sampled continuations for calibration (transformers' generate, as calibration calls it:
        left-padded rows, end-of-sequence suppressed): each row alone, its whole prefix every step."""
        eos = getattr(self.config, "eos_token_id", None)
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            seq = ids[mask.bool()][None]
            for _ in range(max_new_tokens):
                logits = self(input_ids=seq).logits[0, -1] / temperature
                logits[eos] = float("-inf")
                seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1)[None]], dim=1)
            pads = torch.full((int((mask == 0).sum()),), pad_token_id, dtype=seq.dtype)
            rows.append(torch.cat([pads, seq[0]]))
        return torch.stack(rows)
