"""`pretrain serve` with API keys, for real: the server on 127.0.0.1 started with two keys in
$PRETRAIN_API_KEY, the real `openai` client with the right key (completions, chat, streaming), a missing
and a wrong key (401 in OpenAI's shape, AuthenticationError in the client), /health open, /metrics behind
the key, the refusals counted by reason, and neither key in any line the server wrote or any metric."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request

import pytest

from tests.test_serve import PROMPT, start_server, stop_server

openai = pytest.importorskip("openai", reason="the serve tests need the serve extra (make setup)")

# Random per session: a key can only turn up in a log or a metric by being copied there.
KEYS = [f"sk-{secrets.token_urlsafe(24)}", f"sk-{secrets.token_urlsafe(24)}"]
WRONG = f"sk-{secrets.token_urlsafe(24)}"


@pytest.fixture(scope="module")
def run_dir():
    from tests.inference_helpers import trained_run

    return trained_run()


ENV = {
    "PRETRAIN_API_KEY": f" {KEYS[0]}, {KEYS[1]} "
}  # as a Secret may hold them: spaces are not part of a key


@pytest.fixture(scope="module")
def keyed(run_dir):
    """(URL, process) of a server with the two keys."""
    url, proc = start_server("--checkpoint", str(run_dir), "--model-name", "tiny", env=ENV)
    yield url, proc
    stop_server(proc)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def get(url: str, path: str, key: str | None = None) -> tuple[int, dict, str]:
    """(status, headers (lower-case names), body) of a GET, with `Authorization: Bearer key` when a key
    is given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def scrape(url: str) -> dict[str, float]:
    status, _, text = get(url, "/metrics", KEYS[1])
    assert status == 200
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_the_right_key_completes_chats_and_streams(keyed):
    url, _ = keyed
    for key in KEYS:  # either key of the comma-separated list
        c = client(url, key)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
        chat = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Who is there?"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
        chunks = list(
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        )
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == out.choices[0].text
        deltas = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Speak."}], max_tokens=6, stream=True
        )
        assert [ch.choices[0].finish_reason for ch in deltas if ch.choices][-1] in ("stop", "length")


def test_a_missing_or_wrong_key_gets_401_in_openais_shape(keyed):
    url, _ = keyed
    before = scrape(url)
    no_header = {"Authorization": openai.Omit()}  # the client's way to send no key at all
    for key in (None, WRONG, KEYS[0][:-1], KEYS[0] + "x", f"{KEYS[0]},{KEYS[1]}"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, key or KEYS[0]).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=4, extra_headers=None if key else no_header
            )
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        body = e.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
        assert "\n" not in body["message"] and (not key or key not in body["message"]), "never echoed"
        assert e.value.response.headers["www-authenticate"] == "Bearer"
    for path, key in (("/v1/models", None), ("/v1/models", WRONG), ("/docs", None), ("/metrics", None)):
        status, _, text = get(url, path, key)
        assert status == 401, path
        assert json.loads(text)["error"]["code"] == "invalid_api_key"
    # another scheme, or a bare key, is no Bearer key
    for header in (f"Basic {KEYS[0]}", KEYS[0], f"Bearer  {WRONG}"):
        req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": header})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 401
    after = scrape(url)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    # missing: the client without a key, the two raw GETs without one, /metrics, Basic, a bare key
    assert delta('pretrain_serve_rejected_total{reason="missing_api_key"}') == 6
    assert delta('pretrain_serve_rejected_total{reason="invalid_api_key"}') == 6
    assert (
        delta('pretrain_serve_requests_total{status="401"}') == 11
    )  # the scrape (/metrics) is no API request
    assert delta('pretrain_serve_requests_total{status="200"}') == 0  # nothing got through


def test_health_is_open_and_metrics_need_the_key(keyed):
    url, _ = keyed
    status, _, text = get(url, "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"
    assert get(url, "/metrics")[0] == 401 and get(url, "/metrics", WRONG)[0] == 401
    status, headers, text = get(url, "/metrics", KEYS[0])
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert "pretrain_serve_requests_total" in text


def test_no_key_in_any_log_line_or_metric(run_dir):
    """A server at its most talkative log level answers a right, a wrong and a missing key; then
    everything it wrote (stdout and stderr) and its metrics are searched for the keys."""
    url, proc = start_server(
        "--checkpoint", str(run_dir), "--model-name", "tiny", "--log-level", "debug", env=ENV
    )
    try:
        client(url, KEYS[0]).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        for key in (WRONG, KEYS[1][:-1]):
            with pytest.raises(openai.AuthenticationError):
                client(url, key).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert get(url, "/v1/models")[0] == 401
        metrics = get(url, "/metrics", KEYS[1])[2]
    finally:
        stop_server(proc)
    log = proc.output
    assert "API key required on every path but /health (2 key(s) accepted)" in log
    assert (
        '"POST /v1/completions HTTP/1.1" 401' in log and '"GET /metrics HTTP/1.1" 200' in log
    )  # every request
    for secret in (*KEYS, WRONG):
        assert secret[3:15] not in log and secret[3:15] not in metrics, "not the key, nor a part of it"


def test_bad_keys_are_refused_in_one_line_before_anything_loads(run_dir, capsys, monkeypatch):
    from app.cli import main as cli_main

    def fails(*args: str) -> str:
        assert cli_main(["serve", "--checkpoint", str(run_dir), "--port", "0", *args]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    monkeypatch.setenv("PRETRAIN_API_KEY", " , ")
    assert "PRETRAIN_API_KEY is set but holds no key" in fails()  # an empty Secret does not turn the key off
    assert "--api-key is set but holds no key" in fails("--api-key", "")
    err = fails("--api-key", "sk-good,sk-bad key")
    assert "--api-key: key 2 of 2 has a space" in err and "sk-bad" not in err and "sk-good" not in err
    monkeypatch.setenv("PRETRAIN_API_KEY", "sk-é")
    err = fails()
    assert "outside printable ASCII" in err and "sk-" not in err


def test_the_flag_takes_precedence_over_the_environment(run_dir):
    url, proc = start_server(
        "--checkpoint", str(run_dir), "--api-key", KEYS[1], env={"PRETRAIN_API_KEY": KEYS[0]}
    )
    try:
        assert get(url, "/v1/models", KEYS[1])[0] == 200
        assert get(url, "/v1/models", KEYS[0])[0] == 401
    finally:
        stop_server(proc)
    out = proc.output
    assert "(1 key(s) accepted)" in out and KEYS[1] not in out


def test_the_key_check_is_bearer_and_exact(monkeypatch):
    from app.tools.serve_api import api_keys, refused

    monkeypatch.delenv("PRETRAIN_API_KEY", raising=False)
    assert api_keys(None) == ()  # neither the flag nor the environment: no key needed
    keys = api_keys("k-one,k-two")
    assert all(len(k) == 32 and b"k-one" not in k for k in keys), "only digests are kept"

    def scope(header: bytes | None) -> dict:
        return {"headers": [(b"authorization", header)] if header is not None else []}

    assert refused(scope(b"Bearer k-one"), keys) is None and refused(scope(b"bearer k-two"), keys) is None
    for header in (None, b"Bearer ", b"Token k-one", b"k-one"):
        assert refused(scope(header), keys) == "missing_api_key", header
    for wrong in (b"k-on", b"k-one2", b"K-ONE", b"k-one,k-two", b"\xff\xfe"):
        assert refused(scope(b"Bearer " + wrong), keys) == "invalid_api_key", wrong


def test_a_websocket_needs_a_key_too():
    """No websocket route exists, but the gate does not wave websockets through: without a key the
    connection is closed before the app sees it (the server answers 403); with one, and for the
    lifespan, the app runs."""
    import asyncio
    import hashlib

    from app.tools.serve_api import gate

    seen: list[str] = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["type"])

    gated = gate(app, None, None, keys=(hashlib.sha256(KEYS[0].encode()).digest(),))
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    def call(scope_type: str, headers: list) -> None:
        scope = {"type": scope_type, "path": "/v1/ws", "headers": headers}
        asyncio.run(gated(scope, receive, send))

    call("websocket", [])
    call("websocket", [(b"authorization", f"Bearer {WRONG}".encode())])
    assert sent == [{"type": "websocket.close", "code": 1008}] * 2 and seen == []
    call("websocket", [(b"authorization", f"Bearer {KEYS[0]}".encode())])
    call("lifespan", [])
    assert seen == ["websocket", "lifespan"]
