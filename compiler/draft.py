"""Draft models for speculative decoding (`llmc compile M --draft-of TARGET_ART`): the same
weights made cheap, by cutting the least influential layers (prune_layers, block influence) and
quantising to int4, under the target's own tokenizer so the two score the same token ids.

By default a draft keeps half its model's layers. A draft pays off when it is much cheaper than
its target and still agrees with it often. Int4 weights already make each kept layer about 4x
(vs bf16) to 8x (vs fp32) cheaper to read at decode, so cutting deeper buys little more speed,
while agreement falls quickly as more layers go without retraining: ShortGPT (Men et al. 2024)
keeps most accuracy with about a quarter of the layers removed by block influence and degrades
beyond, and self-speculative decoding (Zhang et al. 2023, "Draft & Verify") drafts by skipping a
searched subset of layers, not most of them. bench/draft.sh measures a third against a half."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from transformers import AutoTokenizer

from llmc.compiler.artifact import TOKENIZER_DIR, read_manifest, sha256_file
from llmc.compiler.recipes import parse_prune
from llmc.compiler.tokenizer_files import vocab_difference
from llmc.errors import ArtifactError, ModelLoadError, PassError

DEFAULT_QUANT = "int4-rtn"
DEFAULT_KEEP_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class DraftTarget:
    """The artifact a draft is made for: where it is, and what the draft's manifest records."""
    path: Path
    model: dict                 # the target manifest's "model" section
    manifest_sha256: str

    def record(self) -> dict:
        """The draft manifest's `draft_of`: which model and which exact artifact it serves."""
        return {"model": self.model["name"], "manifest_sha256": self.manifest_sha256,
                "num_layers": self.model["num_layers"], "vocab_size": self.model["vocab_size"]}


def read_draft_target(draft_of: str | None, draft_layers: int | None) -> DraftTarget | None:
    """The --draft-of artifact, checked before any model is loaded; None without one."""
    if draft_of is None:
        if draft_layers is not None:
            raise PassError(f"--draft-layers {draft_layers} needs --draft-of TARGET_ARTIFACT")
        return None
    if draft_layers is not None and draft_layers < 1:
        raise PassError(f"--draft-layers {draft_layers} must be at least 1")
    path = Path(draft_of)
    if not path.is_dir():
        raise ArtifactError(f"--draft-of '{path}' is not an artifact directory; compile the target first "
                            f"with `llmc compile MODEL -o DIR`")
    manifest = read_manifest(path)
    return DraftTarget(path, manifest["model"], sha256_file(path / "manifest.json"))


def check_same_tokenizer(loaded, target: DraftTarget) -> None:
    """Refuse a draft whose tokenizer or vocabulary differs from the target's: speculative
    decoding compares the two models' probabilities token id by token id."""
    theirs = AutoTokenizer.from_pretrained(target.path / TOKENIZER_DIR, local_files_only=True).get_vocab()
    ours = loaded.tokenizer.get_vocab()
    if ours != theirs:
        raise ModelLoadError(f"--draft-of: the tokenizer of draft source {loaded.source!r} differs from "
                             f"the one of target artifact '{target.path}' ({target.model['name']}): "
                             f"{vocab_difference(ours, theirs, 'draft', 'target')}; a draft must share its "
                             f"target's tokenizer, "
                             f"so compile it from the target's model or a sibling with the same vocabulary")
    rows = getattr(getattr(loaded.config, "text_config", loaded.config), "vocab_size", None)
    if rows != target.model["vocab_size"]:
        raise ModelLoadError(f"--draft-of: draft source {loaded.source!r} scores {rows} token ids but target "
                             f"artifact '{target.path}' ({target.model['name']}) scores {target.model['vocab_size']}; "
                             f"a draft's logits must cover the target's vocabulary")


def draft_options(options, loaded, target: DraftTarget):
    """`options` (CompileOptions) with the draft's layer pruning and quantisation added."""
    check_same_tokenizer(loaded, target)
    layers = getattr(loaded.config, "text_config", loaded.config).num_hidden_layers
    keep = options.draft_layers or max(1, math.ceil(layers * DEFAULT_KEEP_FRACTION))
    if keep > layers:
        raise PassError(f"--draft-layers {keep} exceeds the {layers} layers of {loaded.source!r}; give fewer")
    if options.prune and "layers" in parse_prune(options.prune):
        raise PassError("--draft-of prunes layers itself (--draft-layers); drop layers: from --prune")
    prune = ",".join(p for p in (f"layers:{layers - keep}" if keep < layers else "", options.prune) if p)
    return dataclasses.replace(options, prune=prune or None, quant=options.quant or DEFAULT_QUANT)


__all__ = ["DraftTarget", "read_draft_target", "check_same_tokenizer", "draft_options", "DEFAULT_QUANT"]
