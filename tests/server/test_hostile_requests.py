"""Requests a careless or hostile client sends: each is answered with a 4xx in OpenAI's error
envelope (never FastAPI's `{"detail": ...}`, never a 5xx), a body over --max-request-bytes is
refused before it is read, /health stays fast meanwhile, and memory comes back afterwards."""

import json
import select
import socket
import threading
import time

import httpx
import psutil
import pytest
from conftest import API_KEY, InProcessServer, start_serve, stop_serve

import llmc

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def served(compiled):
    served = start_serve(compiled, "--metrics-need-key")
    yield served
    stop_serve(served)


def post_raw(served, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", content=body, headers={**AUTH, **(headers or {})}, timeout=60)


def assert_envelope(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def completion(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, **fields}).encode()


@pytest.mark.parametrize("body, words", [
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "UnicodeDecodeError"),          # invalid UTF-8
    (b'{"model": "tiny", "prompt": "a", "seed": ' + b"9" * 5000 + b"}", "digits"),  # int(5000 digits) refused
    (b'{"model": "tiny", "prompt": ', "not valid JSON"),                           # truncated
    (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),                           # nested past the decoder
    (b"", "body"),                                                                 # empty
    (b"[1, 2, 3]", "body"),                                                        # not an object
    (b'{"model": "tiny", "prompt": "\\ud800"}', "surrogate"),                      # lone surrogate
    (b'{"model": "tiny", "prompt": "hi", "priority": 1e999}', "priority"),        # an infinite float
    (completion(n=1000), "--max-n"),
    (completion(best_of=3), "best_of"),
    (completion(n=17, best_of=17), "--max-n"),
    (completion(prompt=[[1, 2], [3]]), "one prompt per request"),
    (completion(prompt=[10**30]), "outside the vocabulary"),
    (completion(prompt=[]), "no tokens"),
    (completion(prompt=[-1]), "outside the vocabulary"),
    (completion(min_tokens=600, max_tokens=None), "min_tokens"),
    (completion(seed=2**64), "seed"),
    (completion(logprobs=21), "logprobs"),
    (completion(stop=["x"] * 3 + [5]), "stop"),
])
def test_a_malformed_completion_is_a_400_in_the_envelope(served, body, words):
    error = assert_envelope(post_raw(served, "/v1/completions", body), 400)
    assert words in error["message"]


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "\ud800"}], "surrogate"),
    ([], "messages"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "text": "x"}]}], "type"),
])
def test_a_malformed_chat_is_a_400_in_the_envelope(served, messages, words):
    body = json.dumps({"model": "tiny", "messages": messages}).encode()
    error = assert_envelope(post_raw(served, "/v1/chat/completions", body), 400)
    assert words in error["message"]


@pytest.mark.parametrize("method, path, status", [("POST", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                                  ("DELETE", "/health", 405)])
def test_unknown_routes_and_methods_answer_in_the_envelope(served, method, path, status):
    error = assert_envelope(httpx.request(method, f"{served.url}{path}", headers=AUTH), status)
    assert path in error["message"]


def test_a_body_that_is_not_json_by_content_type_is_a_400(served):
    assert_envelope(post_raw(served, "/v1/completions", completion(), {"Content-Type": "text/plain"}), 400)


def test_max_tokens_past_the_context_is_clamped_to_what_it_leaves(served):
    reply = post_raw(served, "/v1/completions", completion(max_tokens=10**9, prompt=[5] * 500,
                                                            ignore_eos=True))
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 512 - 500
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_without_tokenising(served):
    started = time.monotonic()
    error = assert_envelope(post_raw(served, "/v1/completions", completion(prompt="word " * (7 * MiB // 5))), 400)
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert time.monotonic() - started < 10   # tokenising it took 40 s before


def test_metrics_need_the_key_with_metrics_need_key(served):
    assert_envelope(httpx.get(f"{served.url}/metrics"), 401)
    assert httpx.get(f"{served.url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{served.url}/health").status_code == 200


def _send_big_body(url: str, size: int, chunked: bool, answers: list) -> None:
    """POST `size` bytes slowly enough that /health is asked meanwhile; the server's first line goes
    into `answers` (it may answer and close before the body is all sent)."""
    host, port = url.removeprefix("http://").split(":")
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\n{length}\r\n\r\n".encode())
        piece = b'{"model": "tiny", "prompt": "' + b"x" * (MiB - 29)
        try:
            for _ in range(size // MiB):
                if select.select([sock], [], [], 0)[0]:   # answered already: stop sending, read it
                    break
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                time.sleep(0.02)
            answers.append(sock.recv(1 << 16).split(b"\r\n")[0])
        except OSError as e:   # reset: the server closed with some of the body unread
            answers.append(_already_received(sock) or repr(e).encode())


def _already_received(sock) -> bytes | None:
    """The first line the server sent before the send failed (its answer may have arrived between the
    last select and the send that found the connection closed), or None."""
    sock.settimeout(1)
    try:
        data = sock.recv(1 << 16)
    except OSError:
        return None
    return data.split(b"\r\n")[0] if data else None


@pytest.mark.parametrize("chunked", [False, True])
def test_health_stays_fast_and_memory_flat_while_a_20_mb_body_is_refused(served, chunked):
    process = psutil.Process(served.proc.pid)
    rss_before = process.memory_info().rss
    answers: list[bytes] = []
    sender = threading.Thread(target=_send_big_body, args=(served.url, 20 * MiB, chunked, answers))
    sender.start()
    latencies = []
    with httpx.Client(timeout=5) as client:
        while sender.is_alive() or len(latencies) < 10:   # a Content-Length over the cap is refused at once
            started = time.perf_counter()
            assert client.get(f"{served.url}/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    sender.join()
    assert answers and answers[0].split()[1] == b"413", answers
    assert latencies and max(latencies) < 0.1, latencies
    assert process.memory_info().rss < 1.1 * rss_before


def rss_settles_below(process, limit: float, timeout: float = 5) -> bool:
    """Whether the server's RSS drops under `limit` within `timeout` (it trims its heap once the
    response is sent)."""
    deadline = time.monotonic() + timeout
    while process.memory_info().rss >= limit:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_memory_comes_back_after_a_large_request_under_the_cap(served):
    process = psutil.Process(served.proc.pid)
    post_raw(served, "/v1/completions", completion(prompt="warm " * 1000))
    rss_before = process.memory_info().rss
    for prompt in ["x" * (7 * MiB), [5] * (7 * MiB // 3)]:   # text, and token ids (the costliest JSON)
        assert_envelope(post_raw(served, "/v1/completions", completion(prompt=prompt)), 400)
        assert rss_settles_below(process, 1.1 * rss_before), (process.memory_info().rss, rss_before)


@pytest.mark.parametrize("template, error", [("{{ messages.__class__.__mro__ }}", "SecurityError"),
                                             ("{{ range(10**9) | list }}", "OverflowError"),
                                             ("{{ raise_exception('roles must alternate') }}", "roles must alternate")])
def test_a_chat_template_that_fails_on_a_conversation_is_a_400(compiled, template, error):
    llm = llmc.load(compiled, kv_memory="16MiB", threads=1)
    llm.tokenizer.chat_template = template
    with InProcessServer(llm) as served:
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
        found = assert_envelope(post_raw(served, "/v1/chat/completions", body), 400)
        assert found["code"] == "chat_template_error" and error in found["message"]
