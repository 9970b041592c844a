"""What the native 4-bit GEMVs' activation rounding costs in accuracy, against llama.cpp's on the same GGUF:
KL(exact || x), top-1 agreement with exact and perplexity over windows of a text, where "exact" runs the
artifact's GEMVs on fp32 activations (each weight dequantised exactly as stored, fp32 arithmetic), and x is
the artifact on int16 activation codes (per block of 64), on int8 ones (per block of 32, llama.cpp's Q8
rounding) and, where llama-cpp-python is installed and a GGUF is given, llama.cpp itself fed the same token
ids. The artifact runs batch-invariant, so every row goes through the GEMVs a decode step would use. Usage:
    python bench/activation_rounding.py ART.llmc [--gguf MODEL.gguf] [--text FILE] [--windows 2] [--json]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llmc.codegen.native import cpu_native
from llmc.compiler.artifact import load_tokenizer, read_artifact
from llmc.compiler.scoring import row_agreement, row_kl, token_nll
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kernel_check import verified_plan

WINDOW = 512
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "samples" / "eval.txt"


def llmc_logits(path: str, ids: list[torch.Tensor], activations: str) -> list[torch.Tensor]:
    art = read_artifact(path)
    executor = PlanExecutor(verified_plan(art), art.weights, "cpu", data=art.data, batch_invariant=True,
                            q4_activations=activations)
    out = []
    for window in ids:
        positions = torch.arange(len(window))
        values = executor.run_values({"input_ids": window, "positions": positions, "logits_indices": positions})
        out.append(values["logits"].float())
    return out


def llamacpp_logits(gguf: str, ids: list[torch.Tensor], threads: int) -> list[torch.Tensor]:
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_ctx=WINDOW, n_batch=WINDOW, n_ubatch=WINDOW, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    out = []
    for window in ids:
        llm.reset()
        llm.eval(window.tolist())
        out.append(torch.from_numpy(llm.scores[:len(window)].copy()).float())
    return out


def figures(exact: list[torch.Tensor], got: list[torch.Tensor], ids: list[torch.Tensor]) -> dict:
    kl = torch.cat([row_kl(e[:-1], g[:-1]) for e, g in zip(exact, got)])
    top1 = torch.cat([row_agreement(e[:-1], g[:-1]) for e, g in zip(exact, got)])
    nll = torch.cat([token_nll(g[:-1], w[1:]) for g, w in zip(got, ids)])
    return {"kl": kl.mean().item(), "top1": top1.float().mean().item(), "ppl": nll.mean().exp().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--gguf", help="the GGUF the artifact was compiled from: llama.cpp's figures beside")
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--windows", type=int, default=2, help="windows of 512 tokens, one after another")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = load_tokenizer(read_artifact(args.artifact))(Path(args.text).read_text(), add_special_tokens=False)
    flat = torch.tensor(tokens["input_ids"][:WINDOW * args.windows])
    ids = list(flat.split(WINDOW))
    with cpu_native.fp32_activations():
        exact = llmc_logits(args.artifact, ids, "int16")
    result = {"tokens": len(flat), "exact_ppl": figures(exact, exact, ids)["ppl"],
              "int16": figures(exact, llmc_logits(args.artifact, ids, "int16"), ids),
              "int8": figures(exact, llmc_logits(args.artifact, ids, "int8"), ids)}
    if args.gguf:
        result["llama.cpp"] = figures(exact, llamacpp_logits(args.gguf, ids, args.threads), ids)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['tokens']} tokens of {args.text}; exact (fp32 activations) perplexity {result['exact_ppl']:.4f}")
    for name in ("int16", "int8", "llama.cpp"):
        if name in result:
            r = result[name]
            print(f"  {name:10s} KL {r['kl']:.6f}  top-1 {r['top1']:.4f}  ppl {r['ppl']:.4f}")


if __name__ == "__main__":
    main()
