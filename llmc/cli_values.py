"""Values the run-time commands (run, chat, bench, eval) take from the command line: numbers
that must be finite and in range, and prompt text that must be UTF-8 and within the input size
cap. A bad one is refused
before any model loads, in one line naming the option (or source) and what it accepts."""

from __future__ import annotations

import io
import math
import sys

import click

from llmc.compiler.bounded_input import INPUT_BYTES_ENV, input_limit, read_stream
from llmc.errors import LlmcError

# torch.Generator.manual_seed takes at most an unsigned 64-bit seed.
SEED = click.IntRange(0, 2**64 - 1)
POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)


class FiniteFloat(click.FloatRange):
    """A float in a range that also refuses nan and ±inf (click's FloatRange lets nan through)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give one in the range {self._describe_range()}",
                      param, ctx)
        return number


def checked_text(text: str, source: str) -> str:
    """`text` unless it holds bytes that were not UTF-8 (click and Python's own argv and stdin
    decoding turn each into a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = _escaped_byte(text[e.start])
        raise LlmcError(f"{source} is not valid UTF-8 text ({byte} at character {e.start}); "
                        "pass UTF-8 text") from None
    return text


def prompt_lines(data: bytes, source: str) -> list[str]:
    """One prompt per non-blank line of `data` (a prompts file or stdin), which must be UTF-8
    text: a NUL byte or an invalid sequence means a binary file was given."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise LlmcError(f"{source} holds a NUL byte at offset {nul}: it looks binary; pass a UTF-8 "
                        "text file with one prompt per line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise LlmcError(f"{source} is not valid UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, "
                        f"line {line}); pass a UTF-8 text file with one prompt per line") from None
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]


def read_prompts(stream, source: str) -> bytes:
    """The bytes of a prompts file, --prompt-file or stdin, refused once past the input cap
    (compiler/bounded_input.py: 64 MiB, LLMC_MAX_INPUT_BYTES), checked while reading."""
    return read_stream(stream, source, input_limit(), INPUT_BYTES_ENV)


def stdin_prompts() -> list[str]:
    """The prompts piped on stdin, read as bytes where stdin has them (a replaced text stdin is
    encoded back, its lone surrogates kept, so that they are refused)."""
    binary = getattr(sys.stdin, "buffer", None)
    if binary is not None:
        return prompt_lines(read_prompts(binary, "stdin"), "stdin")
    text = sys.stdin.read(input_limit() + 1)   # characters: at most 4 bytes each, so still bounded
    return prompt_lines(read_prompts(io.BytesIO(text.encode("utf-8", "surrogatepass")), "stdin"), "stdin")


def chat_line(prompt: str) -> str:
    """The next user line of `llmc chat` (EOFError at the end of input). From a terminal through
    click (the terminal bounds a line); from a pipe or file read as bytes, at most the input cap a
    line (a pipe of /dev/zero has no newline), blank lines skipped as click skips them."""
    binary = getattr(sys.stdin, "buffer", None)
    if binary is None or sys.stdin.isatty():
        return click.prompt(prompt, prompt_suffix=" ")
    limit = input_limit()
    while True:
        click.echo(f"{prompt} ", nl=False)
        line = binary.readline(limit + 1)
        if not line:
            raise EOFError
        if len(line) > limit and not line.endswith(b"\n"):
            raise LlmcError(f"a line read from stdin is larger than {limit} bytes; pass shorter lines, or set "
                            f"{INPUT_BYTES_ENV} (bytes) to raise the limit")
        text = line.rstrip(b"\r\n").decode("utf-8", "surrogateescape")
        if text.strip():
            return text


def _escaped_byte(char: str) -> str:
    code = ord(char)
    return f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
