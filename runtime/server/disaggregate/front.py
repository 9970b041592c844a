"""What the OpenAI server's front (app.py) needs of the model when the engines hold the weights in
processes of their own: the tokenizer, the context length and the grammars, read from the artifact."""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.artifact import TOKENIZER_DIR, read_manifest
from llmc.compiler.tokenizer_files import load_tokenizer
from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.structured_output import GrammarCompiler


class RoutedModel:
    """The model as the router's front sees it: everything but its weights."""

    prompt_ids = Engine.prompt_ids   # reads only the tokenizer, the vocabulary and the context

    def __init__(self, path):
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest.get("parallel"):
            raise RuntimeLlmcError(f"artifact '{path}' is sharded (--tp/--pp) and --disaggregate runs each engine "
                                   f"on one whole artifact: compile it again without --tp/--pp, or serve this one "
                                   f"without --disaggregate")
        self.manifest, self.model = manifest, manifest["model"]
        self.tokenizer = load_tokenizer(self.path / TOKENIZER_DIR, self.model["vocab_size"], f"artifact '{path}'")
        self.max_model_len = self.model["max_position_embeddings"]
        eos = self.model["eos_token_ids"] or [self.tokenizer.eos_token_id]
        self.grammars = GrammarCompiler(self.tokenizer, self.model["vocab_size"], eos)
