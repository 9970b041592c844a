"""The OpenAI-compatible HTTP server (`llmc serve`): `build_app` makes the FastAPI app around an
engine; `serve` loads an artifact and runs it under uvicorn. `llmc.load` never imports this package."""

from llmc.runtime.server.app import build_app
from llmc.runtime.server.launch import serve

__all__ = ["build_app", "serve"]
