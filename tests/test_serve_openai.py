"""`pretrain serve` with the clients users have: the `openai` package's chat (plain and streaming) and
models.retrieve, lm-eval's loglikelihood parsing of echo + logprobs, and every kind of bad request
answered with a 4xx in OpenAI's error shape (never a 500), with 5xx and hang-ups counted."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import time
import urllib.request

import pytest
import torch

from tests.test_serve import PROMPT, raw, start_server, stop_server

openai = pytest.importorskip("openai", reason="the serve tests need the serve extra (make setup)")


@pytest.fixture(scope="module")
def model_and_tok(run_dir):
    from app.tools.sample import load_for_inference

    model, tok, info = load_for_inference(str(run_dir), which="best")
    return model, tok, info


@pytest.fixture(scope="module")
def run_dir():
    from tests.inference_helpers import trained_run

    return trained_run()


@pytest.fixture(scope="module")
def templated(run_dir, model_and_tok, tmp_path_factory):
    """The best checkpoint, copied with a chat_template.jinja beside its tokenizer; one that fails to
    render when the last message is "boom" (a server-side error: a 500, counted)."""
    _, _, info = model_and_tok
    ckpt = tmp_path_factory.mktemp("templated") / "run" / "checkpoints" / info.path.name
    shutil.copytree(info.path, ckpt)
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if messages[-1].content == 'boom' %}{{ no_such_function() }}{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    url, proc = start_server("--checkpoint", str(ckpt), "--model-name", "tiny")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def served(run_dir):
    url, proc = start_server("--checkpoint", str(run_dir), "--model-name", "tiny")
    yield url, proc
    stop_server(proc)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def requests_with(status: str, metrics: dict[str, float]) -> float:
    return metrics.get(f'pretrain_serve_requests_total{{status="{status}"}}', 0.0)


# ---------------------------------------------------------------- chat and models


def test_chat_is_a_completion_of_the_plain_template(client):
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who is there?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    prompt = "System: Speak verse.\n\nUser: Who is there?\n\nAssistant:"
    plain = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop="\nUser:"
    )
    assert chat.object == "chat.completion" and chat.model == "tiny"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].finish_reason == plain.choices[0].finish_reason
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streaming_chat_adds_up_to_the_plain_answer(client):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 24, "seed": 4}
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == plain.choices[0].message.content
    )
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_tokenizer_chat_template_is_used_and_a_server_error_is_a_counted_json_500(templated):
    client = openai.OpenAI(base_url=f"{templated}/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hail"}], max_tokens=10, temperature=0
    )
    plain = client.completions.create(
        model="tiny", prompt="<user>Hail\n<assistant>", max_tokens=10, temperature=0
    )
    assert chat.choices[0].message.content == plain.choices[0].text  # no "\nUser:" stop with a template
    before = scrape(templated)
    code, err = raw(
        templated, json.dumps({"messages": [{"role": "user", "content": "boom"}]}), "/v1/chat/completions"
    )
    assert code == 500 and err["error"]["type"] == "server_error"
    assert requests_with("500", scrape(templated)) - requests_with("500", before) == 1


# ---------------------------------------------------------------- logprobs and echo (lm-eval's loglikelihood)


def test_echo_logprobs_are_the_models_own(client, model_and_tok):
    model, tok, _ = model_and_tok
    ids = tok.encode(PROMPT)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    lp = out.choices[0].logprobs
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.choices[0].text == PROMPT and lp.tokens == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        top = torch.topk(want[i - 1], 3)
        assert len(lp.top_logprobs[i]) in (3, 4)  # the top 3, and the token itself when not among them
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(top.values[0]), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and out.usage.completion_tokens == 0


def test_lm_eval_local_completions_reads_our_loglikelihoods(server, model_and_tok):
    """lm-eval's own request (token ids, echo, logprobs=1, max_tokens=1) and its own parser."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tok, _ = model_and_tok
    ids = tok.encode("ROMEO:\nWhat light through yonder window breaks")
    ctx = 4
    body = {
        "model": "tiny",
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    code, out = raw(server, json.dumps(body))
    assert code == 200
    [(loglik, greedy)] = LocalCompletionsAPI.parse_logprobs(out, tokens=[ids], ctxlens=[ctx])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert loglik == pytest.approx(sum(float(lp[i - 1, ids[i]]) for i in range(ctx, len(ids))), abs=1e-3)
    assert greedy == all(int(lp[i - 1].argmax()) == ids[i] for i in range(ctx, len(ids)))


def test_generated_logprobs_also_when_streaming(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**kw)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == plain.usage.completion_tokens and "".join(lp.tokens) == plain.choices[0].text
    assert all(
        v == max(top.values()) for v, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )  # greedy
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


# ---------------------------------------------------------------- bad requests: 4xx, never 500


def post_bytes(url: str, path: str, body: bytes, content_type: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "path, body, content_type, param",
    [
        ("/v1/completions", b"prompt=x", "application/x-www-form-urlencoded", None),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "application/json", "prompt"),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\udfff"]}', "application/json", "stop"),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', "application/json", None),  # not UTF-8
        ("/v1/completions", b"[1, 2]", "application/json", None),
        ("/v1/completions", b"[" * 100000, "application/json", None),
        ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "application/json", "temperature"),
        ("/v1/completions", b'{"prompt": [1, 99999999]}', "application/json", "prompt"),  # not a token id
        ("/v1/completions", b'{"prompt": [[1, 2], [3]], "stream": true}', "application/json", "prompt"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', "application/json", "max_tokens"),
        ("/v1/completions", b'{"prompt": "a", "logprobs": 21}', "application/json", "logprobs"),
        ("/v1/completions", b'{"prompt": "a", "logprobs": -1}', "application/json", "logprobs"),
        ("/v1/completions", b'{"prompt": "a", "echo": "yes"}', "application/json", "echo"),
        ("/v1/chat/completions", b"messages=x", "application/x-www-form-urlencoded", None),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "application/json",
            "messages",
        ),
        ("/v1/chat/completions", b'{"messages": "hi"}', "application/json", "messages"),
        ("/v1/chat/completions", b'{"messages": []}', "application/json", "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "king", "content": "hi"}]}',
            "application/json",
            "messages",
        ),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', "application/json", "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}',
            "application/json",
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 99}',
            "application/json",
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true}',
            "application/json",
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "top_p": 2}',
            "application/json",
            "top_p",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "temprature": 1}',
            "application/json",
            "temprature",
        ),
    ],
)
def test_bad_requests_are_4xx_json_never_500(server, path, body, content_type, param):
    before = scrape(server)
    code, err = post_bytes(server, path, body, content_type)
    assert code == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
    assert 10 < len(err["error"]["message"]) < 300 and "\n" not in err["error"]["message"]
    after = scrape(server)
    assert requests_with("400", after) - requests_with("400", before) == 1
    assert requests_with("500", after) == requests_with("500", before)


def test_odd_but_valid_values_are_served(server):
    for body in (
        '{"prompt": "a", "max_tokens": 2, "seed": 340282366920938463463374607431768211456}',
        '{"prompt": "a", "max_tokens": 2, "seed": -5, "top_k": 1000000}',
        '{"prompt": [[5, 6], [7]], "max_tokens": 2}',
    ):
        code, out = raw(server, body)
        assert code == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]


def test_a_client_that_hangs_up_mid_stream_is_counted_499(served):
    """The request and the hang-up reach the server together (sent while it is SIGSTOPped): its
    stream cannot finish, whatever the machine's speed."""
    server, proc = served
    before = scrape(server)
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 40, "stream": True}).encode()
    proc.send_signal(signal.SIGSTOP)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
    finally:
        proc.send_signal(signal.SIGCONT)
    for _ in range(300):  # the server counts it once its stream has ended
        if requests_with("499", scrape(server)) > requests_with("499", before):
            break
        time.sleep(0.1)
    after = scrape(server)
    assert requests_with("499", after) - requests_with("499", before) == 1
    assert requests_with("200", after) == requests_with("200", before)
