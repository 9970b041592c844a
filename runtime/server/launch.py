"""`llmc serve` / `llmc.serve`: load an artifact and serve it under uvicorn until stopped. The first
SIGTERM drains: no new requests (503), queued ones refused, running ones finish for up to
`shutdown_timeout` seconds and the rest end with finish_reason "abort" and stop_reason
"server shutdown"; then the process exits 0. A second signal exits as uvicorn does."""

from __future__ import annotations

import math
import signal
import socket

import uvicorn

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.server.app import build_app, model_name
from llmc.runtime.server.disaggregate import start_engines
from llmc.runtime.server.limits import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES
from llmc.runtime.server.result_cache import make_result_cache


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, core, shutdown_timeout: float):
        super().__init__(config)
        self.core, self.shutdown_timeout = core, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.core.draining:
            self.core.drain(self.shutdown_timeout, self._drained)
            return
        super().handle_exit(sig, frame)

    def _drained(self) -> None:
        self.should_exit = True   # uvicorn's main loop reads it every tick


def serve(path, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None, max_queue: int = 256,
          ttft_slo_ms: float | None = None, served_model_name: str | None = None, shutdown_timeout: float = 30.0,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_n: int = DEFAULT_MAX_N,
          metrics_need_key: bool = False, log_level: str = "info", result_cache: int | str | None = None,
          result_cache_ttl: float | None = None, semantic_cache_threshold: float | None = None,
          semantic_cache_entries: int = 10_000, disaggregate: str | None = None, **engine_options) -> None:
    """Serve the artifact at `path` on http://host:port (OpenAI API under /v1) until SIGTERM or Ctrl-C.
    `result_cache`: bytes of determined results kept ('256MiB'; off by default), each for
    `result_cache_ttl` seconds (None: until evicted). `semantic_cache_threshold`: answer requests sent with
    `"semantic_cache": true` from the results of earlier ones close in meaning (cosine; off by default).
    `disaggregate`: 'prefill:P,decode:D' runs prefill and decode in engine processes of their own
    (server/disaggregate/). `engine_options` are `llmc.load`'s (kv_memory, threads, max_num_seqs, device, ...)."""
    _check_options(max_queue, ttft_slo_ms, shutdown_timeout)
    _check_limits(max_request_bytes, max_n, metrics_need_key, api_key)
    make_result_cache(result_cache, result_cache_ttl)   # its errors before the model loads
    sock = listening_socket(host, port)   # before the model loads: a taken port fails at once
    engines = None
    try:
        if disaggregate is not None:
            engines = start_engines(path, disaggregate, served_model_name or model_name(path), max_queue,
                                    engine_options, {"--semantic-cache-threshold": semantic_cache_threshold},
                                    ttft_slo_ms=ttft_slo_ms)
        app = build_app(engines.model if engines else llmc.load(path, **engine_options), served_model_name,
                        api_key, max_queue, ttft_slo_ms, core=engines and engines.core,
                        max_request_bytes=max_request_bytes, max_n=max_n, metrics_need_key=metrics_need_key,
                        result_cache=result_cache, result_cache_ttl=result_cache_ttl,
                        semantic_cache_threshold=semantic_cache_threshold,
                        semantic_cache_entries=semantic_cache_entries)
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=math.ceil(shutdown_timeout))
        DrainingServer(config, app.state.core, shutdown_timeout).run(sockets=[sock])
    finally:
        if engines is not None:
            engines.close()
        sock.close()


def listening_socket(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise RuntimeLlmcError(f"--host {host!r} does not resolve ({e.strerror}); give an address such as "
                               "127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise RuntimeLlmcError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or stop "
                               "what holds it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _check_options(max_queue, ttft_slo_ms, shutdown_timeout) -> None:
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
        raise RuntimeLlmcError(f"max_queue={max_queue!r} must be an integer >= 1")
    if ttft_slo_ms is not None and not (isinstance(ttft_slo_ms, (int, float)) and 0 < ttft_slo_ms < math.inf):
        raise RuntimeLlmcError(f"ttft_slo_ms={ttft_slo_ms!r} must be a positive number of milliseconds or None")
    if not (isinstance(shutdown_timeout, (int, float)) and 0 <= shutdown_timeout < math.inf):
        raise RuntimeLlmcError(f"shutdown_timeout={shutdown_timeout!r} must be a number of seconds >= 0")


def _check_limits(max_request_bytes, max_n, metrics_need_key, api_key) -> None:
    for name, value in (("max_request_bytes", max_request_bytes), ("max_n", max_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RuntimeLlmcError(f"{name}={value!r} must be an integer >= 1")
    if metrics_need_key and api_key is None:
        raise RuntimeLlmcError("--metrics-need-key needs --api-key (or $LLMC_API_KEY): there is no key to ask for")
