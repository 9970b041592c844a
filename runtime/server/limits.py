"""What keeps one request from stalling the server: a cap on the request body, checked before any
of it is read (Content-Length) and while it streams in (chunked bodies); a lower bound on a text
prompt's tokens from its bytes, so a prompt that cannot fit the context is refused without
tokenising megabytes; and the C heap trimmed after a large body, so its memory goes back to the OS."""

from __future__ import annotations

import asyncio
import ctypes
import json

from starlette.responses import JSONResponse

from llmc.runtime.server.protocol import ApiError

DEFAULT_MAX_REQUEST_BYTES = 8 << 20   # a prompt that fits a 128k-token context is rarely over 1 MB of text
DEFAULT_MAX_N = 16                    # choices (n, best_of) one request may ask for
TRIM_AFTER_BYTES = 1 << 20            # bodies at least this large trim the heap once answered

# Pre-tokenizers and BPE settings under which one token may stand for more text than its own
# string (removed whitespace, fused unknown runs): no bound from bytes holds for those.
_DROPPING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413 in OpenAI's envelope. A declared
    Content-Length over the cap is refused before a byte is read; otherwise the body is read here,
    counting, and handed on whole, so a chunked body cannot get past the cap either."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, receive, send, f"{declared} bytes (its Content-Length)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client left: let the app see it
                return await self.app(scope, _replay([], message, receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, f"over {self.max_bytes} bytes (read so far)")
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        await self.app(scope, _replay([body], None, receive), send)
        if size >= TRIM_AFTER_BYTES:
            del body
            await asyncio.to_thread(return_freed_heap)   # it walks the heap: not on the event loop

    async def _refuse(self, scope, receive, send, size: str) -> None:
        error = ApiError(413, f"the request body is {size}, over this server's limit of {self.max_bytes} bytes "
                              "(--max-request-bytes); send a shorter prompt", code="request_too_large")
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:   # h11 refuses such a header before the app; any other server: read and count
                return None
    return None


def _replay(bodies: list[bytes], last, receive):
    """A `receive` that gives the body read already, then whatever the connection says next
    (a disconnect, which streaming handlers wait for)."""
    pending = [{"type": "http.request", "body": b, "more_body": False} for b in bodies]
    if last is not None:
        pending.append(last)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed


def return_freed_heap() -> bool:
    """Give the C heap's free memory back to the OS (glibc's malloc_trim). The runtime keeps freed
    memory in the heap for the next step's activations (host_memory.keep_freed_memory), so a large
    request's body, text and token lists would otherwise stay resident after it is answered."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):   # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


class PromptBound:
    """Refuses a text prompt whose bytes alone prove it longer than the context. Every token a BPE
    tokenizer emits stands for one vocabulary string, matched against the normalised text, so a text
    of B bytes (UTF-8, after the normaliser) has at least B / L tokens, where L is the longest
    vocabulary string in UTF-8 bytes (an over-count for byte-level "Ġ" and SentencePiece "▁", which
    only loosens the bound). Where that does not hold (pre-tokenizers that drop whitespace, fused
    unknown runs, non-BPE models) there is no bound, and the prompt is tokenised (off the event loop,
    under the body cap)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.max_token_bytes = _max_token_bytes(tokenizer, backend)
        self.normalizer = backend.normalizer if backend is not None else None

    def check(self, text: str, room: int, context: int, field: str) -> None:
        """Raise a 400 when `text` must take more than `room` tokens of a `context`-token model."""
        longest = self.max_token_bytes
        if longest is None or len(text) * 4 <= longest * room:   # 4: the most UTF-8 bytes of one character
            return
        normalized = self.normalizer.normalize_str(text) if self.normalizer is not None else text
        size = len(normalized.encode("utf-8", "surrogatepass"))
        least = -(-size // longest)
        if least > room:
            raise ApiError(400, f"{field}: the prompt is {size} bytes, so at least {least} tokens (no token of "
                                f"this model's vocabulary covers more than {longest} bytes), longer than the "
                                f"model's context of {context} tokens; shorten the prompt",
                           param=field, code="context_length_exceeded")


def _max_token_bytes(tokenizer, backend) -> int | None:
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:   # a backend that cannot describe itself: no bound
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or _types(spec.get("pre_tokenizer")) & _DROPPING_PRE_TOKENIZERS:
        return None
    if model.get("fuse_unk") and model.get("unk_token") is not None and not model.get("byte_fallback"):
        return None
    if any(_removes(p) for p in _pieces(spec.get("pre_tokenizer"))):
        return None
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=None)


def _pieces(node) -> list[dict]:
    """A tokenizer.json component and the components of its Sequences."""
    if not isinstance(node, dict):
        return []
    inner = node.get("pretokenizers") or node.get("normalizers") or []
    return [node] + [p for child in inner for p in _pieces(child)]


def _types(node) -> set[str]:
    return {p.get("type") for p in _pieces(node)}


def _removes(piece: dict) -> bool:
    return piece.get("type") == "Split" and piece.get("behavior") == "Removed"
