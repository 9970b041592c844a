"""Calibration token sequences for lossy passes: cut from a user's text file, or, with none,
text the source model samples itself from a fixed list of prompts under a fixed seed."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch

from llmc.cache import cache_root, write_json
from llmc.compiler.bounded_input import read_input
from llmc.compiler.quant import fast_bf16
from llmc.errors import PassError

# Short, generic openings across registers (story, explanation, dialogue, list, code, news) so
# the sampled text exercises varied activations; written for llmc, no corpus is shipped.
PROMPTS = (
    "Once upon a time, in a village by the sea,",
    "The main reason the sky looks blue during the day is",
    "Here is a simple recipe for vegetable soup:",
    "Dear team, I am writing to let you know that",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: Why do leaves change colour in autumn?\nAnswer:",
    "The history of the printing press begins",
    "Three tips for learning a new language quickly:\n1.",
    "The city council met on Tuesday evening to discuss",
    "In mathematics, a prime number is",
    "She opened the old wooden box and found",
    "User: Can you help me plan a trip to the mountains?\nAssistant:",
    "The experiment was repeated five times, and the results showed",
    "When the train finally arrived at the station,",
    "A good night's sleep matters because",
    "The following table lists the planets of the solar system in order:",
)
TEMPERATURE = 0.8
# Sampling runs on a bfloat16 copy of a float32 model up to SAMPLE_COPY_BYTES of parameters: a decode step
# reads half the bytes and runs on the CPU's bf16 matrix units (SmolLM2, 8 x 128 tokens: 12.9 -> 8.6 s on
# the 2-core Xeon). The text only has to be the model's own plausible continuation, and a fixed seed still
# fixes it; larger models sample in place rather than hold a second copy, and so does every model where the
# CPU has no bf16 arithmetic (fast_bf16: an AVX2 Zen 3 multiplied bf16 6x slower than fp32).
SAMPLE_DTYPE = torch.bfloat16
SAMPLE_ROWS = 8   # the row count oneDNN's reordered weights are tuned for: a decode step of the sampled batch
SAMPLE_COPY_BYTES = 2 << 30


def calibration_sequences(loaded, calib_file: str | Path | None, num_samples: int, seq_len: int,
                          seed: int = 0) -> list[torch.LongTensor]:
    """`num_samples` token sequences of `seq_len` tokens each (fewer if `calib_file` is short),
    identical for the same model, file and seed. `loaded` is a frontends LoadedModel."""
    check_sizes(num_samples, seq_len, loaded.config)
    if calib_file is not None:
        return sequences_from_file(loaded.tokenizer, Path(calib_file), num_samples, seq_len)
    path = cache_root() / CACHE_NAME / f"{generation_key(loaded.source_hash, num_samples, seq_len, seed)}.json"
    kept = cached_sequences(path, num_samples, seq_len, len(loaded.tokenizer))
    if kept is not None:
        return kept
    seqs = generated_sequences(loaded.module, loaded.tokenizer, num_samples, seq_len, seed)
    write_json(path, [s.tolist() for s in seqs])   # atomically; a cache that cannot be written is skipped
    return seqs


# Sampled text is kept per model, seed and size in $LLMC_CACHE/calibration: the same model's next calibrated
# compile skips the sampling (SmolLM2, 8 x 128 tokens: 13 s of a 56 s GPTQ compile on 2 cores). It is the
# same text the sampling gives (a fixed seed), so keeping it changes no artifact.
CACHE_NAME = "calibration"


def generation_key(source_hash: str, num_samples: int, seq_len: int, seed: int) -> str:
    """What fixes a sampled calibration set: the model's bytes, the prompts, the sampling and the library
    versions whose arithmetic draws the tokens."""
    import transformers  # deferred: loading a model imports it anyway; this module is imported earlier
    dtype = SAMPLE_DTYPE if fast_bf16() else torch.float32
    what = [source_hash, PROMPTS, TEMPERATURE, str(dtype), num_samples, seq_len, seed, torch.__version__,
            transformers.__version__]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def cached_sequences(path: Path, num_samples: int, seq_len: int, vocab: int) -> list[torch.LongTensor] | None:
    """The sequences kept at `path` where they are whole and of the shape asked (else None: sampled again)."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(rows, list) and len(rows) == num_samples and all(
            isinstance(r, list) and len(r) == seq_len and all(type(t) is int and 0 <= t < vocab for t in r)
            for r in rows)):
        return None
    return [torch.tensor(r, dtype=torch.long) for r in rows]




def calibration_source(calib_file: str | Path | None, seed: int = 0) -> str:
    """How the calibration set was made, for the manifest: the file's sha256 or the seed."""
    if calib_file is None:
        return f"self-generated:{seed}"
    return f"sha256:{hashlib.sha256(read_calib_bytes(Path(calib_file))).hexdigest()}"


def check_sizes(num_samples: int, seq_len: int, config) -> None:
    max_len = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
    if num_samples < 1:
        raise PassError(f"--calib-samples is {num_samples}; give at least 1")
    if seq_len < 2:
        raise PassError(f"--calib-seq-len is {seq_len}; give at least 2 (a token and its successor)")
    if max_len is not None and seq_len > max_len:
        raise PassError(f"--calib-seq-len {seq_len} exceeds the model's {max_len} positions; lower it")


def read_calib_bytes(path: Path) -> bytes:
    """The --calib file's bytes, refused once past the input cap (compiler/bounded_input.py)."""
    try:
        return read_input(path, f"calibration file '{path}'", PassError)
    except OSError as e:
        raise PassError(f"calibration file '{path}' cannot be read ({e.strerror}); "
                        f"pass an existing text file to --calib") from None


def sequences_from_file(tokenizer, path: Path, num_samples: int, seq_len: int) -> list[torch.LongTensor]:
    """The file's tokens cut into consecutive `seq_len` chunks; the first `num_samples` of them."""
    try:
        text = read_calib_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise PassError(f"calibration file '{path}' is not UTF-8 text; "
                        f"pass a plain text file to --calib") from None
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < seq_len:
        raise PassError(f"calibration file '{path}' has {len(ids)} tokens, fewer than one sequence of "
                        f"--calib-seq-len {seq_len}; give a longer file or a smaller --calib-seq-len")
    chunks = min(num_samples, len(ids) // seq_len)
    return [torch.tensor(ids[i * seq_len:(i + 1) * seq_len], dtype=torch.long) for i in range(chunks)]


def generated_sequences(module: torch.nn.Module, tokenizer, num_samples: int, seq_len: int,
                        seed: int) -> list[torch.LongTensor]:
    """Each sequence is a prompt and the model's continuation, sampled at TEMPERATURE in one
    left-padded batch; end-of-sequence is suppressed so every row reaches `seq_len` tokens."""
    prompts = [PROMPTS[(seed + i) % len(PROMPTS)] for i in range(num_samples)]
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"][:seq_len - 1] for p in prompts]
    shortest = min(len(ids) for ids in encoded)
    positions = getattr(getattr(module.config, "text_config", module.config), "max_position_embeddings", None)
    if positions is not None and max(len(ids) for ids in encoded) + seq_len - shortest > positions:
        # a row's positions count from its first real token, so the longest prompt plus the batch's
        # continuation would run past a learned position table (GPT-2): cut every prompt to the shortest
        encoded = [ids[:shortest] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    pad = pad_token_id(tokenizer, module.config)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], dtype=torch.long)
    new_tokens = seq_len - shortest
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        out = sampler(module).generate(input_ids=input_ids, attention_mask=mask, do_sample=True,
                              temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=pad)
    return [out[row, width - len(ids):width - len(ids) + seq_len].clone() for row, ids in enumerate(encoded)]


def sampler(module: torch.nn.Module) -> torch.nn.Module:
    """The model the calibration text is sampled from: a SAMPLE_DTYPE copy of a small float32 transformers
    model where the CPU has bf16 arithmetic, else itself (an ONNX source's graph keeps float32 constants
    outside its parameters, which a cast copy would multiply with bf16 ones)."""
    from transformers import PreTrainedModel  # deferred, as in generation_key
    params = list(module.parameters())
    small_fp32 = bool(params) and all(p.dtype == torch.float32 and not p.is_meta for p in params) and \
        sum(p.nbytes for p in params) <= SAMPLE_COPY_BYTES
    if not (isinstance(module, PreTrainedModel) and small_fp32 and fast_bf16()):
        return module
    copied = copy.deepcopy(module).to(SAMPLE_DTYPE)
    # oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which a CPU with bf16 arithmetic has
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        for parent in list(copied.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, PackedLinear(child))
    return copied


class PackedLinear(torch.nn.Module):
    """A bf16 nn.Linear on its weight reordered once into oneDNN's blocked layout: torch's own linear
    reorders it on every call, which at the sampler's 8 rows cost half of each product (SmolLM2's
    576 x 1536: 82 -> 45 us a call, the same bits)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), SAMPLE_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def pad_token_id(tokenizer, config) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


__all__ = ["calibration_sequences", "calibration_source", "PROMPTS"]
