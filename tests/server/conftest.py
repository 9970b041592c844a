"""Fixtures of the server tests: `llmc serve` started as a real process on a free port (tiny-llama,
from the session's artifact), queried by the `openai` client; and the same app under uvicorn in a
thread of this process, for tests that must reach into the engine (its KV blocks, a failing step)."""

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
KV_MEMORY = "16MiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"llmc serve exited with {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} was not healthy within {timeout} s")


class Served:
    """A running server: its base URL, an OpenAI client, and its metrics."""

    def __init__(self, url: str, model: str, proc: subprocess.Popen | None = None):
        self.url, self.model, self.proc = url, model, proc
        self.client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def metrics(self) -> dict[tuple, float]:
        """Every sample: {(name, sorted label items): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels) -> float:
        labels = {"model_name": self.model, **labels}
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_metric(self, name: str, value: float, timeout: float = 30, **labels) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name, **labels) != value:
            assert time.monotonic() < deadline, f"{name} stayed {self.metric(name, **labels)}, not {value}"
            time.sleep(0.05)


def start_serve(artifact, *options, name: str = "tiny") -> Served:
    """`llmc serve ARTIFACT --port <free> ...options` as a subprocess serving `name`, once healthy."""
    port = free_port()
    cmd = [sys.executable, "-c", "from llmc.cli import main; main()", "serve", str(artifact), "--port", str(port),
           "--api-key", API_KEY, "--kv-memory", KV_MEMORY, "--served-model-name", name, *map(str, options)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LLMC_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        proc.kill()
        raise
    return Served(url, name, proc)


def stop_serve(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.kill()
        served.proc.wait(timeout=30)
    served.proc.stderr.close()


class InProcessServer:
    """`build_app(llm, ...)` under uvicorn in a thread of the test process."""

    def __init__(self, llm, **app_options):
        import uvicorn

        from llmc.runtime.server import build_app

        self.app = build_app(llm, "tiny", API_KEY, **app_options)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        url = f"http://127.0.0.1:{self.port}"
        wait_healthy(url)
        return Served(url, "tiny")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def offline(compiled):
    """The artifact loaded in this process, for reference outputs."""
    import llmc
    return llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)
