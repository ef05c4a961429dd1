"""`pretrain serve` for real: the server on 127.0.0.1, the real `openai` client (plain and streaming),
raw bad requests, concurrent clients, Prometheus metrics, and the CLI's one-line errors."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import signal
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app.trainer.model.generate import generate, generate_stream
from tests.conftest import cli_env
from tests.inference_helpers import best_is_not_latest_run, trained_run
from tests.procs import Proc

openai = pytest.importorskip("openai", reason="the serve tests need the serve extra (make setup)")

PROMPT = "ROMEO:\nWhat light"


@pytest.fixture(scope="module")
def run_dir() -> Path:
    return trained_run()


def start_server(*args: str, env: dict[str, str] | None = None) -> tuple[str, Proc]:
    """`pretrain serve ... --port 0` in the background (`env` added to its environment): (base URL, process)
    once /health answers. Its output (stdout and stderr) is in proc.output."""
    proc = Proc([sys.executable, "-m", "app.cli", "serve", "--port", "0", *args], env=cli_env(**(env or {})))
    # "serving ... on http://127.0.0.1:PORT/v1" once the socket is bound
    url = proc.wait_for_line(r"on (http://127\.0\.0\.1:\d+)/v1", timeout=300).group(1)

    def healthy() -> bool:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return True
        except OSError:
            return False

    proc.wait_until(healthy, "/health answers", timeout=60, poll=0.1)
    return url, proc


def stop_server(proc: Proc) -> None:
    proc.signal(signal.SIGTERM)
    # SIGTERM: uvicorn shuts down gracefully, then re-raises the signal (exit by SIGTERM, not a crash)
    assert proc.wait(timeout=30) in (0, -15)


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(run_dir):
    url, proc = start_server("--checkpoint", str(run_dir), "--model-name", "tiny", "--max-body-bytes", "4096")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(run_dir):
    """Greedy text straight from the checkpoint the server chose (the best: lowest val loss)."""
    import torch

    from app.tools.sample import load_for_inference

    model, tok, info = load_for_inference(str(run_dir), which="best")

    def greedy(prompt: str, n: int) -> str:
        ids = tok.encode(prompt)
        out = generate(model, torch.tensor([ids]), n, temperature=0)[0, len(ids) :].tolist()
        if tok.eot_id in out:
            out = out[: out.index(tok.eot_id)]
        return tok.decode(out)

    return greedy, info


def raw(url: str, body: bytes | str, path: str = "/v1/completions", headers: dict | None = None):
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_and_models(server, client, reference):
    _, info = reference
    got = health(server)
    assert got["status"] == "ok" and got["model"] == "tiny" and got["context"] == 64
    assert got["checkpoint"] == str(info.path) and got["step"] == info.step
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completion_is_the_models_greedy_continuation(client, reference):
    greedy, _ = reference
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == greedy(PROMPT, 24)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_streaming_deltas_add_up_to_the_plain_response(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "temperature": 0.9, "top_k": 0, "seed": 5}
    plain = client.completions.create(
        **{k: v for k, v in kw.items() if k != "top_k"}, extra_body={"top_k": 20}
    )
    chunks = list(
        client.completions.create(
            **{k: v for k, v in kw.items() if k != "top_k"},
            extra_body={"top_k": 20},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3  # really streamed, not one blob
    assert text == plain.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_seed_makes_sampling_reproducible(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "temperature": 1.0, "top_p": 0.9}
    a = client.completions.create(seed=11, **kw).choices[0].text
    assert a == client.completions.create(seed=11, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (12, 13, 14)}
    assert others - {a}  # other seeds give other text


def test_stop_strings_cut_the_text_also_when_streaming(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 3}
    full = client.completions.create(**kw).choices[0].text
    stop = next(w for w in re.findall(r"[a-z]{2,}", full) if full.index(w) > 3)  # a word past the start
    cut = full[: full.index(stop)]
    out = client.completions.create(stop=[stop, "zzzz"], **kw)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut  # no part of the stop string leaked
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_own_answer(client, reference):
    greedy, _ = reference
    prompts = [
        f"{name}:\n" for name in ("ROMEO", "JULIET", "HAMLET", "KING", "LEAR", "NURSE", "FOOL", "MACBETH")
    ]

    def ask(p: str) -> str:
        return client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [greedy(p, 16) for p in prompts]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ('{"prompt": ""}', 400, "prompt"),
        ('{"prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
        ('{"prompt": "a", "max_tokens": -3}', 400, "max_tokens"),
        ('{"prompt": "a", "max_tokens": 64}', 400, "max_tokens"),  # prompt + 64 > the context of 64
        ('{"prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),  # wrong type, not coerced
        ('{"prompt": "a", "temperature": "hot"}', 400, "temperature"),
        ('{"prompt": "a", "temperature": 3}', 400, "temperature"),
        ('{"prompt": "a", "top_p": 0}', 400, "top_p"),
        ('{"prompt": "a", "stream": "yes"}', 400, "stream"),
        ('{"prompt": 5}', 400, "prompt"),
        ('{"prompt": "a", "max_token": 5}', 400, "max_token"),  # unknown field: a typo is not ignored
        ('{"prompt": "a", "n": 2}', 400, "n"),
        ('{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
        ('{"prompt": ["a", "b"], "stream": true}', 400, "prompt"),  # several prompts: not streamed
        ('{"max_tokens": 5}', 400, "prompt"),
        ("{not json", 400, None),
        ('{"prompt": "a", "model": "gpt-4"}', 404, "model"),
    ],
)
def test_bad_requests_get_a_clear_4xx(server, body, status, param):
    code, err = raw(server, body)
    assert code == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param
    assert 10 < len(err["error"]["message"]) < 300 and "\n" not in err["error"]["message"]


def test_oversized_bodies_and_unknown_routes(server):
    big = json.dumps({"prompt": "a" * 5000})
    code, err = raw(server, big)
    assert code == 413 and err["error"]["code"] == "body_too_large"

    def chunked():
        yield big.encode()

    req = urllib.request.Request(
        f"{server}/v1/completions", data=chunked(), headers={"Content-Type": "application/json"}
    )  # a generator body is sent chunked (no Content-Length)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413

    # greedy: sampled at the default temperature, the model may end the document after one token
    small = iter([b'{"prompt": "ROMEO:", ', b'"max_tokens": 3, "temperature": 0}'])
    req = urllib.request.Request(
        f"{server}/v1/completions", data=small, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:  # a small chunked body is still read whole
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
    code, err = raw(server, "{}", path="/v1/chat")
    assert code == 404 and err["error"]["message"]


def test_a_client_that_hangs_up_mid_stream_does_not_hurt_the_next(server, client):
    req = urllib.request.Request(
        f"{server}/v1/completions",
        data=json.dumps({"prompt": PROMPT, "max_tokens": 40, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    resp = urllib.request.urlopen(req, timeout=30)
    assert resp.readline().startswith(b"data: ")
    resp.close()  # hang up
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5


def test_prometheus_metrics_count_requests_and_tokens(server, client):
    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"{server}/metrics").read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    before = scrape()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, temperature=0)
    raw(server, '{"prompt": ""}')
    after = scrape()

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert delta('pretrain_serve_requests_total{status="200"}') == 1
    assert delta('pretrain_serve_requests_total{status="400"}') == 1
    assert delta("pretrain_serve_completion_tokens_total") == 7
    assert delta("pretrain_serve_request_seconds_count") == 1
    assert delta("pretrain_serve_time_to_first_token_seconds_count") == 1


def test_cli_errors_are_one_line(run_dir, tmp_path, capsys, monkeypatch):
    from app.cli import main as cli_main

    def fails(*args: str) -> str:
        assert cli_main(["serve", *args]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert "pick another --port" in fails("--checkpoint", str(run_dir), "--port", str(s.getsockname()[1]))
    assert "does not exist" in fails("--checkpoint", str(tmp_path / "nope"), "--port", "0")
    assert "--port" in fails("--checkpoint", str(run_dir), "--port", "70000")
    assert "--max-queue" in fails("--checkpoint", str(run_dir), "--max-queue", "0")
    assert "invalid choice" in fails("--checkpoint", str(run_dir), "--which", "worst")
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the serve extra were not installed
    assert "serve extra" in fails("--checkpoint", str(run_dir))


# ---------------------------------------------------------------- best vs latest, and a full queue


def sampled_of(spec: str, prompt: str, n: int, seed: int) -> str:
    """What the server answers at temperature 1 with this seed, straight from one checkpoint's model (the
    engine seeds a torch.Generator and samples with generate_stream)."""
    import torch

    from app.tools.sample import load_for_inference

    model, tok, _ = load_for_inference(spec)
    g = torch.Generator().manual_seed(seed)
    out = [
        int(t[0, 0])
        for t in generate_stream(model, torch.tensor([tok.encode(prompt)]), n, 1.0, None, generator=g)
    ]
    return tok.decode(out[: out.index(tok.eot_id)] if tok.eot_id in out else out)


@pytest.fixture(scope="module")
def worse_run() -> Path:
    run = best_is_not_latest_run()
    vals = {
        p.name: json.loads((p / "meta.json").read_text())["val_loss"] for p in (run / "checkpoints").iterdir()
    }
    assert vals["step_000120"] < vals["step_000060"] < vals["step_000124"]  # the best is not the latest
    return run


@pytest.fixture(scope="module")
def busy_server(worse_run):
    """The run whose latest checkpoint is worse than its best, served one request at a time with room for
    one waiting request: while a request decodes, the queue stays full, so a burst's 503s do not depend on
    how the decoding thread and the server's event loop are scheduled."""
    url, proc = start_server("--checkpoint", str(worse_run), "--max-queue", "1", "--max-batch", "1")
    yield url, proc
    stop_server(proc)


def test_a_run_dir_serves_its_best_checkpoint_not_the_latest(busy_server, worse_run):
    url, _ = busy_server
    best, latest = worse_run / "checkpoints" / "step_000120", worse_run / "checkpoints" / "step_000124"
    got = health(url)
    assert got["checkpoint"] == str(best) and got["step"] == 120
    assert got["model"] == worse_run.name  # the default model name: the run dir's name
    want, other = sampled_of(str(best), PROMPT, 24, seed=7), sampled_of(str(latest), PROMPT, 24, seed=7)
    assert want != other  # the two checkpoints answer differently, so the text tells which one is served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=worse_run.name, prompt=PROMPT, max_tokens=24, temperature=1, seed=7)
    assert out.choices[0].text == want


@pytest.mark.slow  # two more servers (~8 s on 2 cores)
def test_which_latest_and_a_step_dir_serve_those_checkpoints(worse_run):
    ckpts = worse_run / "checkpoints"
    servers = [
        start_server("--checkpoint", str(worse_run), "--which", "latest"),
        start_server("--checkpoint", str(ckpts / "step_000060")),  # neither the best nor the latest
    ]
    try:
        (latest, _), (step60, _) = servers
        assert health(latest)["checkpoint"] == str(ckpts / "step_000124") and health(latest)["step"] == 124
        assert health(step60)["checkpoint"] == str(ckpts / "step_000060") and health(step60)["step"] == 60
        for url, step in ((latest, 124), (step60, 60)):
            body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 1, "seed": 7})
            want = sampled_of(str(ckpts / f"step_{step:06d}"), PROMPT, 24, seed=7)
            assert raw(url, body)[1]["choices"][0]["text"] == want
    finally:
        for _, proc in servers:
            stop_server(proc)


def burst(url: str, n: int, proc: Proc) -> list[tuple[int, dict, dict]]:
    """n completion requests that reach the server at the same moment: sent while it is stopped
    (SIGSTOP: the kernel queues the connections and their bytes), then released together."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 48, "temperature": 0}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    socks = []
    proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(head + body)
            socks.append(s)
    finally:
        proc.send_signal(signal.SIGCONT)
    out = []
    for s in socks:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        header, _, payload = data.partition(b"\r\n\r\n")
        lines = header.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        out.append((int(lines[0].split()[1]), headers, json.loads(payload)))
    return out


def test_a_full_queue_answers_503_with_retry_after(busy_server):
    """--max-queue 1: of 6 requests arriving together, one runs, one waits, the rest are turned away
    with 503 (OpenAI's error shape, Retry-After), counted in the metrics; the server goes on serving."""
    url, proc = busy_server

    def count_503() -> float:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        m = re.search(r'^pretrain_serve_requests_total\{status="503"\} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    before = count_503()
    replies = burst(url, 6, proc)
    busy = [r for r in replies if r[0] == 503]
    done = [r for r in replies if r[0] == 200]
    assert len(busy) + len(done) == 6 and len(busy) >= 3 and len(done) >= 1, [r[0] for r in replies]
    for _, headers, err in busy:
        assert headers["retry-after"] == "1"
        assert err["error"]["type"] == "server_busy" and err["error"]["code"] == "queue_full"
        assert "retry later" in err["error"]["message"]
    texts = {r[2]["choices"][0]["text"] for r in done}
    assert len(texts) == 1 and all(r[2]["usage"]["completion_tokens"] == 48 for r in done)
    assert count_503() - before == len(busy)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    again = client.completions.create(model=None, prompt="ROMEO:", max_tokens=48, temperature=0)
    assert again.choices[0].text in texts  # a 503 leaves nothing behind: the next request is served


def test_the_serving_dashboard_and_alerts_read_what_a_live_server_serves(server, client):
    """Every pretrain_serve_* series of helm/dashboards/pretrain-serve.json and of the alert rules is on a
    running server's /metrics once it has answered a good and a bad request."""
    from tests.prom_helpers import alert_rules, dashboard_targets, metric_names

    client.completions.create(model="tiny", prompt="To be", max_tokens=2)
    raw(server, "not json")
    text = urllib.request.urlopen(f"{server}/metrics").read().decode()
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    used = {m for name, _, e in dashboard_targets() if name == "pretrain-serve.json" for m in metric_names(e)}
    used |= {m for r in alert_rules() for m in metric_names(r["expr"]) if m.startswith("pretrain_serve_")}
    assert used and not used - served, f"not served by pretrain serve: {sorted(used - served)}"
