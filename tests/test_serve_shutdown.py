"""SIGTERM to a real `pretrain serve` with a request in flight: new requests get 503, the request in
flight is answered to its end (`[DONE]` and a finish reason), within --grace-seconds or cut there, and
the process exits by the signal."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.test_serve import PROMPT, raw, start_server

pytest.importorskip("openai", reason="the serve tests need the serve extra (make setup)")


@pytest.fixture(scope="module")
def run_dir():
    from tests.inference_helpers import trained_run

    return trained_run()


def in_flight(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return float(re.search(r"^pretrain_serve_requests_in_flight (\S+)$", text, re.M).group(1))


def sigterm_mid_request(run_dir, *args: str) -> list[dict]:
    """Start a streamed request whose body is still arriving (so it is surely in flight), SIGTERM the
    server, check that new requests get 503, then send the rest: the streamed events, [DONE] last."""
    url, proc = start_server("--checkpoint", str(run_dir), *args)
    host, port = url.removeprefix("http://").split(":")
    # Greedy, so the answer is the model's and not the luck of a draw: a sampled one may end on the
    # end-of-text token before max_tokens, and "stop" would then stand where "length" is asserted.
    body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(head + body[:10])
            while in_flight(url) < 1:  # the server has the request (its body is still on the way)
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            while (answer := raw(url, json.dumps({"prompt": "a", "max_tokens": 2})))[0] == 200:
                time.sleep(0.05)  # until the signal is handled
            code, err = answer
            assert code == 503 and err["error"]["code"] == "shutting_down", answer
            with pytest.raises(urllib.error.HTTPError) as health:
                urllib.request.urlopen(f"{url}/health", timeout=10)
            assert health.value.code == 503  # a readiness probe takes the pod out of the Service
            s.sendall(body[10:])
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert proc.wait(timeout=60) in (0, -15)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = re.findall(rb"data: (.*?)\n\n", data.partition(b"\r\n\r\n")[2].replace(b"\r\n", b"\n"))
    assert events and events[-1] == b"[DONE]", data[-300:]
    return [json.loads(e) for e in events[:-1]]


def finish_reasons(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


def test_sigterm_lets_the_request_in_flight_finish(run_dir):
    events = sigterm_mid_request(run_dir)
    assert finish_reasons(events) == ["length"]
    assert len([e for e in events if e["choices"][0]["text"]]) > 3  # the whole answer, streamed


def test_past_the_grace_period_the_request_ends_cancelled_with_done(run_dir):
    events = sigterm_mid_request(run_dir, "--grace-seconds", "0")
    assert finish_reasons(events) == ["cancelled"]
