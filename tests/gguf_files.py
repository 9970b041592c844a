"""Writing llama.cpp-style GGUF files of small llamas in tests: the header a config and
tokenizer give, then the tensors the test chooses."""

import json

import gguf


def llama_writer(path, config, tokenizer) -> gguf.GGUFWriter:
    """A GGUF writer for `path` holding `config`'s hyperparameters and `tokenizer`'s BPE vocabulary."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_vocabulary(writer, tokenizer)
    return writer


def add_vocabulary(writer: gguf.GGUFWriter, tokenizer) -> None:
    """`tokenizer`'s BPE vocabulary and merges, as llama.cpp's gpt2 tokenizer model."""
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_token_types([1] * len(tokens))


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tensors(path, tensors: dict):
    """A GGUF of `tensors` (name -> (values, GGML type; F32/F16 values as numpy floats, others as
    their block bytes)), parsed back by llmc's reader."""
    from gguf import GGMLQuantizationType as Q

    from llmc.compiler.frontends.gguf import PlainArrayReader

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        writer.add_tensor(name, values, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    finish(writer)
    return PlainArrayReader(path)
