"""Text workloads for `llmc bench --workload`: "grounded" prompts whose answers quote them (copy a
function out again, quote a docstring, copy a passage: the code-editing and extraction shapes
prompt lookup is for), and "open" prompts whose answers are free continuations
of a story. Built from text already on the machine, with no download: the Python standard
library's own source and samples/eval.txt."""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path

import numpy as np

from llmc.errors import RuntimeLlmcError

TEXT_WORKLOADS = ("grounded", "open")
EVAL_TEXT = Path(__file__).resolve().parents[1] / "samples" / "eval.txt"
# pure-Python standard library modules with many mid-sized, documented functions
SOURCE_MODULES = ("textwrap", "shlex", "difflib", "fractions", "calendar", "statistics", "argparse",
                  "configparser", "gettext", "imaplib", "smtplib", "tarfile", "zipfile", "pathlib")


def text_prompts(kind: str, num_requests: int, seed: int) -> list[str]:
    """`num_requests` prompts of workload `kind`, drawn reproducibly by `seed`."""
    if kind not in TEXT_WORKLOADS:
        raise RuntimeLlmcError(f"bench: unknown workload {kind!r}; use random, {', '.join(TEXT_WORKLOADS)}")
    # grounded: passages and code in turn (the code prompts far outnumber the passages)
    pools = [passage_prompts(), code_prompts()] if kind == "grounded" else [open_prompts()]
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(len(pool)) for pool in pools]
    return [pools[i % len(pools)][orders[i % len(pools)][i // len(pools) % len(orders[i % len(pools)])]]
            for i in range(num_requests)]


def grounded_prompts() -> list[str]:
    return passage_prompts() + code_prompts()


def passage_prompts() -> list[str]:
    return [f"{passage}\n\nThe passage above, copied out again exactly:\n{passage[:40]}"
            for passage in _eval_passages(min_chars=500)]


def code_prompts() -> list[str]:
    prompts = []
    # each answer is started for the model with the quote's first words, as a user would prime it
    for name, source, docstring in stdlib_functions():
        prompts.append(f"{source}\n\n# The function above, copied out again exactly:\n{source[:40]}")
        if docstring:
            prompts.append(f"{source}\n\nQuestion: what does the docstring of {name} say, word for word?\n"
                           f"Answer: \"{docstring[:40]}")
    return prompts


def open_prompts() -> list[str]:
    return [f"{passage[:300]}\n\nWrite what happens next in the story.\n" for passage in _eval_passages(200)]


def stdlib_functions(min_chars: int = 600, max_chars: int = 2400) -> list[tuple[str, str, str | None]]:
    """(name, source, docstring) of the standard library's functions of a prompt-sized length."""
    found = []
    for module in SOURCE_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        text = Path(spec.origin).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                source = textwrap.dedent(ast.get_source_segment(text, node) or "")
                if min_chars <= len(source) <= max_chars:
                    found.append((node.name, source, ast.get_docstring(node)))
    if not found:
        raise RuntimeLlmcError("bench: the grounded workload found no standard library source to quote; "
                               "this Python ships without .py sources")
    return found


def _eval_passages(min_chars: int) -> list[str]:
    paragraphs = [p.strip() for p in EVAL_TEXT.read_text(encoding="utf-8").split("\n\n")]
    return [p for p in paragraphs if len(p) >= min_chars]
