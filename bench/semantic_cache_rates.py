"""Hit and false-hit rates of the server's semantic cache on samples/paraphrases.json: the first
question of every pair is cached; each 'same' pair's second question should hit its first, each
'different' pair's second question should hit nothing. Usage:
    python bench/semantic_cache_rates.py ARTIFACT [THRESHOLD ...]"""

import json
import sys
from pathlib import Path

import llmc
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.server.result_cache import CachedResult
from llmc.runtime.server.semantic_cache import PromptEmbedder, SemanticCache

PAIRS = json.loads((Path(__file__).parent.parent / "samples" / "paraphrases.json").read_text())


def rates(embed, threshold: float) -> dict:
    cache = SemanticCache(embed.dim, threshold)
    originals = list(dict.fromkeys(a for a, _ in PAIRS["same"] + PAIRS["different"]))
    for question in originals:
        cache.put(b"", embed(question), CachedResult(RequestOutput(question, question, []), []))
    found = {kind: [cache.get(b"", embed(b)) for _, b in PAIRS[kind]] for kind in ("same", "different")}
    right = sum(f is not None and f[0].output.prompt == a for f, (a, _) in zip(found["same"], PAIRS["same"]))
    wrong = sum(f is not None and f[0].output.prompt != a for f, (a, _) in zip(found["same"], PAIRS["same"]))
    crossed = sum(f is not None for f in found["different"])
    wrong += crossed
    queries = len(PAIRS["same"]) + len(PAIRS["different"])
    return {"threshold": threshold, "hit_rate": right / len(PAIRS["same"]), "false_hit_rate": wrong / queries,
            "false_hits": wrong, "of_which_different_pairs": crossed, "queries": queries}


def similarities(embed, kind: str) -> list[float]:
    return [float(embed(a) @ embed(b)) for a, b in PAIRS[kind]]


def main() -> None:
    llm = llmc.load(sys.argv[1], kv_memory="64MiB", threads=1)
    embed = PromptEmbedder(llm.engine.runner.executor, llm.engine.tokenizer)
    for kind in ("same", "different"):
        shown = sorted(similarities(embed, kind))
        print(f"{kind}: cosine min {shown[0]:.3f} median {shown[len(shown) // 2]:.3f} max {shown[-1]:.3f}")
    for threshold in map(float, sys.argv[2:] or ["0.8", "0.9"]):
        print(json.dumps(rates(embed, threshold)))


if __name__ == "__main__":
    main()
