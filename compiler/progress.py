"""Progress on long compile work, the way pip and Hugging Face tools show it: a line on stderr for
each stage that runs longer than a moment (so a compile that is piped or logged still says what
it is doing, while a command refused at once still prints its one error line), and a bar over the
stage's items (layers, nodes, bytes) on a terminal only. `quiet` silences both."""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from tqdm import tqdm


def on_terminal() -> bool:
    return sys.stderr.isatty()


def bar(total: int | None, desc: str, unit: str = "it", quiet: bool = False, **kwargs) -> tqdm:
    """A tqdm bar on stderr, shown only on a terminal and not when quiet; it leaves no line
    behind (the stage's own line and the summary say what happened)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True,
                disable=quiet or not on_terminal(), **kwargs)


# a stage still running this long gets its line; one that ends (or fails) sooner prints nothing
STAGE_LINE_DELAY = 1.0
DELAY_ENV = "LLMC_STAGE_DELAY"   # seconds, for scripts and tests that want every stage's line


class Stages:
    """Announces the stage now running: `llmc: <message>` once it has run STAGE_LINE_DELAY
    seconds (from a timer thread), nothing if it ended first or when quiet."""

    def __init__(self, echo: Callable[[str], None], quiet: bool, delay: float | None = None):
        self.echo, self.quiet = echo, quiet
        self.delay = delay if delay is not None else float(os.environ.get(DELAY_ENV) or STAGE_LINE_DELAY)
        self._timer: threading.Timer | None = None

    def start(self, message: str) -> None:
        self.end()
        if self.quiet:
            return
        self._timer = threading.Timer(self.delay, self.echo, [f"llmc: {message}"])
        self._timer.daemon = True
        self._timer.start()

    def end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc) -> None:
        self.end()


def echo_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["on_terminal", "bar", "Stages", "echo_stderr", "STAGE_LINE_DELAY", "DELAY_ENV"]
