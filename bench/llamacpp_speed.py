"""llama.cpp (llama-cpp-python) on a GGUF, measured as `llmc bench -n 1` measures an artifact: load seconds,
batch-1 greedy decode (128 random prompt tokens, 128 out: the 127 steps after the first token, which the
prompt's logits give), prefill of 512 tokens, and the process's RSS; one JSON object on stdout. Run by
bench/scale.sh in its own process, so its RSS is llama.cpp's alone. Usage:
    python bench/llamacpp_speed.py MODEL.gguf --threads N [--repeat 3]"""

from __future__ import annotations

import argparse
import json
import resource
import time

import gguf
import numpy as np
import psutil

CONTEXT = 1024   # holds the 512-token prefill and the 256-token decode


def load(path: str, threads: int):
    import llama_cpp

    return llama_cpp.Llama(path, n_ctx=CONTEXT, n_batch=512, n_ubatch=512, n_threads=threads,
                           n_threads_batch=threads, verbose=False)


def greedy(llm) -> int:
    """The last evaluated position's argmax (llama-cpp-python keeps no logits unless logits_all)."""
    import llama_cpp

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(logits.argmax())


def decode(llm, prompt: list[int], output_len: int) -> dict:
    """One request from an empty cache: seconds for the prompt, and for the steps after its token."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    token = greedy(llm)
    t1 = time.perf_counter()
    for _ in range(output_len - 1):
        llm.eval([token])
        token = greedy(llm)
    t2 = time.perf_counter()
    return {"prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "decode_steps": output_len - 1,
            "total_seconds": t2 - t0}


def median_run(runs: list[dict], key: str) -> dict:
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def kv_bytes_per_token(path: str) -> int:
    """llama.cpp's f16 K and V for one token, from the GGUF's metadata."""
    reader = gguf.GGUFReader(path)

    def field(name):
        f = reader.fields[f"llama.{name}"]
        return int(f.parts[f.data[0]][0])
    head_dim = field("embedding_length") // field("attention.head_count")
    return field("block_count") * field("attention.head_count_kv") * head_dim * 2 * 2


def weight_bytes(path: str) -> int:
    return int(sum(t.n_bytes for t in gguf.GGUFReader(path).tensors))


def measure(path: str, threads: int, repeat: int, input_len: int, output_len: int, prefill_len: int) -> dict:
    t = time.perf_counter()
    llm = load(path, threads)
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    decode(llm, rng.integers(0, vocab, 16).tolist(), 8)   # warm-up, as llmc bench's
    prompt = rng.integers(0, vocab, input_len).tolist()
    long_prompt = rng.integers(0, vocab, prefill_len).tolist()
    decodes, prefills = [], []
    for _ in range(repeat):   # alternating, so a busy spell hits both alike
        decodes.append(decode(llm, prompt, output_len))
        prefills.append(decode(llm, long_prompt, 1))
    d, p = median_run(decodes, "decode_seconds"), median_run(prefills, "prefill_seconds")
    return {"threads": threads, "load_s": load_s, "context": CONTEXT,
            "decode_tokens_per_s": d["decode_steps"] / d["decode_seconds"],
            "output_tokens_per_s": output_len / d["total_seconds"],
            "prefill_tokens_per_s": prefill_len / p["prefill_seconds"],
            "decode_runs_tokens_per_s": [r["decode_steps"] / r["decode_seconds"] for r in decodes],
            "prefill_runs_tokens_per_s": [prefill_len / r["prefill_seconds"] for r in prefills],
            "decode_context_mean": input_len + output_len / 2,
            "weight_bytes": weight_bytes(path), "kv_bytes_per_token": kv_bytes_per_token(path),
            "rss_bytes": psutil.Process().memory_info().rss,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "llama_cpp_version": __import__("llama_cpp").__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    a = p.parse_args()
    print(json.dumps(measure(a.model, a.threads, a.repeat, a.input_len, a.output_len, a.prefill_len)))


if __name__ == "__main__":
    main()
