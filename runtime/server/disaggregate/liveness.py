"""Whether each engine still serves, as the router sees it: an engine started here that exits, or any
engine that sends nothing for LLMC_COLLECTIVE_TIMEOUT seconds (default 60; every engine sends at least a
heartbeat twice a second, from a thread of its own, so a long step does not count) is gone. A hung
engine that this router started is killed, which closes its connections for its peers too."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

from llmc.runtime.parallel.group import collective_timeout

TICK_S = 0.25
# A tick this late means this process itself was stopped (SIGSTOP, a suspended VM): no engine is blamed
# for the silence, each gets a fresh deadline.
STALL_S = 2.0


class EngineWatch:
    """One thread: calls `on_gone(rank, what happened)` once for each engine that exits or stops
    answering (`heard(rank)` on every message from it)."""

    def __init__(self, ranks: list[int], processes: dict[int, subprocess.Popen],
                 on_gone: Callable[[int, str], None]):
        self.processes, self.on_gone = processes, on_gone
        self.timeout = collective_timeout()
        self._heard = {r: time.monotonic() for r in ranks}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="llmc-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True

    def heard(self, rank: int) -> None:
        if rank in self._heard:
            self._heard[rank] = time.monotonic()

    def forget(self, rank: int) -> None:
        """The engine is known to be gone (its connection failed)."""
        self._heard.pop(rank, None)

    def exited(self, rank: int, why: str = "") -> str:
        """What to say of an engine whose connection failed (`why`): its exit code once reaped."""
        proc = self.processes.get(rank)
        for _ in range(20):   # a process that died may take a moment to be reaped
            if proc is None or proc.poll() is not None:
                break
            time.sleep(0.05)
        code = None if proc is None else proc.poll()
        return "exited" + (f" with code {code}" if code is not None else "") + (f" ({why})" if why else "")

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stopped:
            time.sleep(TICK_S)
            now = time.monotonic()
            if now - last > STALL_S:
                self._heard = dict.fromkeys(self._heard, now)
            last = now
            for rank in list(self._heard):
                self._check(rank, now)

    def _check(self, rank: int, now: float) -> None:
        proc = self.processes.get(rank)
        if proc is not None and proc.poll() is not None:
            self._gone(rank, f"exited with code {proc.returncode}")
        elif now - self._heard[rank] > self.timeout:
            self._gone(rank, f"sent nothing for {self.timeout:g} s (hung; LLMC_COLLECTIVE_TIMEOUT)")
            if proc is not None:
                proc.kill()   # its connections close: its peers stop waiting on it

    def _gone(self, rank: int, what: str) -> None:
        self.forget(rank)
        self.on_gone(rank, what)
