"""Random-weight Llama checkpoints in real shapes and real file formats (GGUF q4_0/q4_1/q4_k/q8_0, or
an HF bf16 safetensors folder) with SmolLM2's real tokenizer, for speed and memory tests of models
too big to download. Usage:
    python bench/make_model.py --shape llama-1b --format q4_1 -o PATH [--seed N]
    python bench/make_model.py --shape llama-1b --format hf-bf16 -o DIR [--layers 4 ...]"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import struct
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

Q = gguf.GGMLQuantizationType


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool = True

    def __post_init__(self):
        assert self.hidden % self.heads == 0, f"hidden {self.hidden} is not a multiple of heads {self.heads}"
        assert self.heads % self.kv_heads == 0, f"heads {self.heads} is not a multiple of kv heads {self.kv_heads}"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "llama-1b": Shape(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8),    # Llama-3.2-1B
    "llama-3b": Shape(hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8),    # Llama-3.2-3B
    "llama-8b": Shape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, tied=False),  # Llama-3.1-8B
    "ci-300m": Shape(hidden=1536, ffn=4096, layers=12, heads=24, kv_heads=8),     # ~300 MB in Q4_1
    "tiny": Shape(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2),
}
GGUF_FORMATS = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q4_k": Q.Q4_K, "q8_0": Q.Q8_0}
FILE_TYPES = {Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
              Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
FORMATS = [*GGUF_FORMATS, "hf-bf16"]

VOCAB = 49152   # SmolLM2's tokenizer
CONTEXT = 4096
ROPE_THETA = 500000.0
RMS_EPS = 1e-5
WEIGHT_STD = 0.02
SHARD_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]   # torch order: [out_features, in_features] for weights
    role: str                # "embedding", "linear", "output" (an untied lm head) or "norm"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def llama_tensors(shape: Shape) -> list[TensorSpec]:
    """Every tensor of a Llama of `shape`, named as llama.cpp and HF name them."""
    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", "model.embed_tokens.weight", (VOCAB, h), "embedding")]
    for i in range(shape.layers):
        specs += layer_tensors(i, shape, h, q_dim, kv_dim)
    specs.append(TensorSpec("output_norm.weight", "model.norm.weight", (h,), "norm"))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", "lm_head.weight", (VOCAB, h), "output"))
    return specs


def layer_tensors(i: int, shape: Shape, h: int, q_dim: int, kv_dim: int) -> list[TensorSpec]:
    blk, hf = f"blk.{i}", f"model.layers.{i}"
    rows = [("attn_norm", "input_layernorm", (h,), "norm"),
            ("attn_q", "self_attn.q_proj", (q_dim, h), "linear"),
            ("attn_k", "self_attn.k_proj", (kv_dim, h), "linear"),
            ("attn_v", "self_attn.v_proj", (kv_dim, h), "linear"),
            ("attn_output", "self_attn.o_proj", (h, q_dim), "linear"),
            ("ffn_norm", "post_attention_layernorm", (h,), "norm"),
            ("ffn_gate", "mlp.gate_proj", (shape.ffn, h), "linear"),
            ("ffn_up", "mlp.up_proj", (shape.ffn, h), "linear"),
            ("ffn_down", "mlp.down_proj", (h, shape.ffn), "linear")]
    return [TensorSpec(f"{blk}.{g}.weight", f"{hf}.{n}.weight", s, role) for g, n, s, role in rows]


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """Each tensor's own stream: the same (seed, name) draws the same bytes whatever else the file holds."""
    return np.random.default_rng([seed, *name.encode()])


# --- GGUF blocks, drawn as bytes (quantising float weights would take minutes for 8B on two cores) ---

def random_words(rng: np.random.Generator, n_bytes: int) -> np.ndarray:
    return rng.bit_generator.random_raw(n_bytes // 8)   # uint64, all 64 bits random


def bell_nibbles(rng: np.random.Generator, n_bytes: int) -> np.ndarray:
    """Bytes of two 4-bit codes, each the sum of two uniform 0..7 draws plus 1: a triangle on 1..15
    symmetric about 8 (Q4_0's zero), so the weights have a bell-like shape and mean 0."""
    lows = np.uint64(0x7777777777777777)
    codes = (random_words(rng, n_bytes) & lows) + (random_words(rng, n_bytes) & lows)
    return (codes + np.uint64(0x1111111111111111)).view(np.uint8)   # no nibble carries: 7 + 7 + 1 = 15


NIBBLE_STD = math.sqrt(2 * (8 ** 2 - 1) / 12)   # 3.24: std of the sum of two uniform 0..7 draws


def bell_int8(rng: np.random.Generator, n_bytes: int) -> np.ndarray:
    """int8 codes, each the sum of four uniform 0..63 draws minus 126: nearly normal on -126..126."""
    lows = np.uint64(0x3F3F3F3F3F3F3F3F)
    codes = sum(random_words(rng, n_bytes) & lows for _ in range(4))   # at most 252 a byte: no carries
    return (codes.view(np.uint8) - np.uint8(126)).view(np.int8)


INT8_STD = math.sqrt(4 * (64 ** 2 - 1) / 12)   # 36.9


def fp16_scales(rng: np.random.Generator, n: int, typical: float) -> np.ndarray:
    """n fp16 block scales within 25% of `typical`, as bytes [n, 2]."""
    return (typical * rng.uniform(0.75, 1.25, n)).astype(np.float16).view(np.uint8).reshape(n, 2)


def q4_0_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    # block: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
    d = fp16_scales(rng, n_blocks, WEIGHT_STD / NIBBLE_STD)
    return np.hstack([d, bell_nibbles(rng, 16 * n_blocks).reshape(n_blocks, 16)])


def q4_1_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    # block: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m, with m = -8 d to centre the codes on 0
    d = fp16_scales(rng, n_blocks, WEIGHT_STD / NIBBLE_STD)
    m = (d.view(np.float16) * np.float16(-8)).view(np.uint8)
    return np.hstack([d, m, bell_nibbles(rng, 16 * n_blocks).reshape(n_blocks, 16)])


def q8_0_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    # block: fp16 d, 32 int8 codes; w = d * q
    d = fp16_scales(rng, n_blocks, WEIGHT_STD / INT8_STD)
    return np.hstack([d, bell_int8(rng, 32 * n_blocks).view(np.uint8).reshape(n_blocks, 32)])


def q4_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Super-blocks of 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for the 8
    sub-blocks of 32, 128 bytes of nibbles; w = d * scale * q - dmin * min. With min = scale and
    dmin = 8 d, w = d * scale * (q - 8): mean 0 whatever the scales."""
    scales = rng.integers(32, 64, (n_blocks, 8), dtype=np.uint8)
    d = fp16_scales(rng, n_blocks, WEIGHT_STD / NIBBLE_STD / 47.5)   # 47.5: the scales' mean
    dmin = (d.view(np.float16) * np.float16(8)).view(np.uint8)
    nibbles = bell_nibbles(rng, 128 * n_blocks).reshape(n_blocks, 128)
    return np.hstack([d, dmin, pack_k_scales(scales, scales), nibbles])


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """llama.cpp's 12-byte packing of 8 six-bit scales and mins [n, 8]: bytes 0-3 hold scales 0-3 and the
    top 2 bits of scales 4-7, bytes 4-7 the same for mins, bytes 8-11 the low 4 bits of scales and mins 4-7."""
    low_sc, high_sc = scales[:, :4], scales[:, 4:]
    low_m, high_m = mins[:, :4], mins[:, 4:]
    return np.hstack([low_sc | (high_sc >> 4) << 6, low_m | (high_m >> 4) << 6,
                      (high_sc & 0x0F) | (high_m & 0x0F) << 4])


BLOCK_WRITERS = {Q.Q4_0: q4_0_blocks, Q.Q4_1: q4_1_blocks, Q.Q4_K: q4_k_blocks, Q.Q8_0: q8_0_blocks}


def gguf_type(spec: TensorSpec, linear_type: Q) -> Q:
    return {"norm": Q.F32, "embedding": Q.Q8_0, "output": Q.Q8_0}.get(spec.role, linear_type)


def gguf_data(spec: TensorSpec, qtype: Q, seed: int) -> np.ndarray:
    """The tensor's bytes as the writer takes them: F32 values, or block bytes [rows, bytes per row]."""
    if qtype == Q.F32:
        return np.ones(spec.shape, np.float32)
    rows, cols = spec.shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block_size == 0, f"{spec.gguf_name}: {cols} columns do not fill {qtype.name} blocks"
    blocks = BLOCK_WRITERS[qtype](tensor_rng(seed, spec.gguf_name), rows * cols // block_size)
    return blocks.reshape(rows, cols // block_size * type_size)


def gguf_nbytes(spec: TensorSpec, qtype: Q) -> int:
    if qtype == Q.F32:
        return 4 * spec.numel
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return spec.numel // block_size * type_size


# --- GGUF file ---

def default_tokenizer_gguf() -> Path:
    from llmc.compiler.frontends.samples import fetch_smollm2
    return fetch_smollm2()


@functools.cache
def tokenizer_fields(tokenizer_gguf: Path) -> list[tuple[str, object, list]]:
    """(key, value, GGUF value types) of every tokenizer.* field of a GGUF."""
    reader = gguf.GGUFReader(tokenizer_gguf)
    return [(key, field.contents(), field.types) for key, field in reader.fields.items()
            if key.startswith("tokenizer.")]


def add_llama_keys(writer: gguf.GGUFWriter, shape: Shape, qtype: Q, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(VOCAB)


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer_gguf: Path) -> None:
    for key, value, types in tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)


def write_gguf(path: Path, shape: Shape, qtype: Q, seed: int, name: str, tokenizer_gguf: Path) -> None:
    """Header, metadata and tensor infos first, then one tensor's bytes in memory at a time."""
    specs = llama_tensors(shape)
    writer = gguf.GGUFWriter(path, "llama")
    add_llama_keys(writer, shape, qtype, name)
    add_tokenizer(writer, tokenizer_gguf)
    types = [gguf_type(spec, qtype) for spec in specs]
    for spec, t in zip(specs, types):
        rows = spec.shape if t == Q.F32 else (spec.shape[0], gguf_nbytes(spec, t) // spec.shape[0])
        dtype = np.float32 if t == Q.F32 else np.uint8
        writer.add_tensor_info(spec.gguf_name, rows, np.dtype(dtype), gguf_nbytes(spec, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with progress_bar(sum(gguf_nbytes(s, t) for s, t in zip(specs, types))) as bar:
        for spec, t in zip(specs, types):
            writer.write_tensor_data(gguf_data(spec, t, seed))
            bar.update(gguf_nbytes(spec, t))
    writer.close()


def progress_bar(total_bytes: int) -> tqdm:
    return tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr, mininterval=1.0)


# --- HF folder: bf16 safetensors shards ---

def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into shards of about `shard_bytes` of bf16 each."""
    shards, size = [[]], 0
    for spec in specs:
        if shards[-1] and size + 2 * spec.numel > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += 2 * spec.numel
    return shards


def safetensors_header(specs: list[TensorSpec]) -> bytes:
    """The 8-byte little-endian header length and the JSON header (padded to 8 bytes) of a bf16 file."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec in specs:
        header[spec.hf_name] = {"dtype": "BF16", "shape": list(spec.shape),
                                "data_offsets": [offset, offset + 2 * spec.numel]}
        offset += 2 * spec.numel
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def bf16_bytes(spec: TensorSpec, seed: int) -> np.ndarray:
    import torch
    if spec.role == "norm":
        values = np.ones(spec.shape, np.float32)
    else:
        values = tensor_rng(seed, spec.hf_name).standard_normal(spec.shape, dtype=np.float32)
        values *= WEIGHT_STD
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()


def write_safetensors(path: Path, specs: list[TensorSpec], seed: int, bar: tqdm) -> None:
    # Written by hand, header first: safetensors' save_file needs every tensor of the shard in memory at once.
    with open(path, "wb") as f:
        f.write(safetensors_header(specs))
        for spec in specs:
            bf16_bytes(spec, seed).tofile(f)
            bar.update(2 * spec.numel)


def llama_config(shape: Shape, tokenizer):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=CONTEXT, rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA,
        tie_word_embeddings=shape.tied, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16")


def write_hf(folder: Path, shape: Shape, seed: int, tokenizer_gguf: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig
    folder.mkdir(parents=True, exist_ok=True)
    specs = llama_tensors(shape)
    shards = plan_shards(specs, SHARD_BYTES)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with progress_bar(sum(2 * s.numel for s in specs)) as bar:
        for name, shard in zip(names, shards):
            write_safetensors(folder / name, shard, seed, bar)
    index = {"metadata": {"total_size": sum(2 * s.numel for s in specs)},
             "weight_map": {spec.hf_name: name for name, shard in zip(names, shards) for spec in shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_gguf.parent, gguf_file=tokenizer_gguf.name)
    tokenizer.save_pretrained(folder)
    llama_config(shape, tokenizer).save_pretrained(folder)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)


# --- entry points ---

def make_model(shape: Shape, fmt: str, output: Path, seed: int = 0, name: str = "random-llama",
               tokenizer_gguf: Path | None = None) -> Path:
    """Write a random-weight Llama of `shape` in `fmt` (a GGUF_FORMATS key or "hf-bf16") to `output`."""
    assert seed >= 0, "seeds are non-negative"
    tokenizer_gguf = Path(tokenizer_gguf or default_tokenizer_gguf())
    output = Path(output)
    if fmt == "hf-bf16":
        write_hf(output, shape, seed, tokenizer_gguf)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(output, shape, GGUF_FORMATS[fmt], seed, name, tokenizer_gguf)
    return output


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    for dim in ("hidden", "ffn", "layers", "heads", "kv-heads"):
        p.add_argument(f"--{dim}", type=int, help=f"override the shape's {dim}")
    p.add_argument("--tokenizer-gguf", type=Path, help="a GGUF whose tokenizer to copy (default: SmolLM2-135M)")
    return p.parse_args(argv)


def chosen_shape(args: argparse.Namespace) -> tuple[Shape, str]:
    """The preset with any dimensions the flags override, and a name saying which."""
    overrides = {k: getattr(args, k) for k in ("hidden", "ffn", "layers", "heads", "kv_heads")
                 if getattr(args, k) is not None}
    name = f"random-{args.shape}" + "".join(f"-{k}{v}" for k, v in overrides.items())
    return dataclasses.replace(SHAPES[args.shape], **overrides), name


def main(argv=None) -> None:
    args = parse_args(argv)
    shape, name = chosen_shape(args)
    start = time.perf_counter()
    out = make_model(shape, args.format, args.output, args.seed, name, args.tokenizer_gguf)
    print(f"{out}: {disk_bytes(out) / 1e9:.3f} GB in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
