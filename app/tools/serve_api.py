"""The HTTP side of `pretrain serve` around its endpoints: OpenAI's request bodies (parsing, checks, the
chat template, logprobs' shape), the API keys, the request gate (keys, status counts, in-flight requests)
and the drain.

Everything a client can send wrong ends here as a RequestError (a 4xx in OpenAI's error shape), before
any of it reaches the model: a body that is not JSON (a form post), a lone UTF-16 surrogate, a wrong
type ("5" is not coerced), an unknown field (a typo is not ignored), a value out of range.
"""

# No `from __future__ import annotations`: pydantic reads the field types from the live annotations.
import hashlib
import hmac
import json
import os
import threading
import time
from itertools import accumulate
from typing import Any

from app.errors import UserError

MAX_LOGPROBS = 20
# The plain chat template for a tokenizer without its own (a base model knows no chat format).
ROLE_NAMES = dict(system="System", developer="System", user="User", assistant="Assistant", tool="Tool")
PLAIN_STOP = "\nUser:"  # the model's attempt to write the user's next turn ends the reply


class RequestError(Exception):
    """A bad request: OpenAI's error fields and the HTTP status."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse_data(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def request_models() -> tuple[type, type]:
    """(CompletionRequest, ChatRequest): strict types and ranges, unknown fields rejected; OpenAI fields
    this server does not implement are accepted at their neutral values only (check_request)."""
    from pydantic import BaseModel, ConfigDict, Field

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

        model: str | None = None
        max_tokens: int | None = None
        temperature: float = Field(1.0, ge=0, le=2)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=0)  # 0 = all tokens; not in OpenAI's API (the openai client's extra_body)
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: dict[str, bool] | None = None
        seed: int | None = None
        n: int = 1
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logit_bias: dict[str, float] | None = None
        user: str | None = None

    class CompletionRequest(Sampling):
        prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids (lm-eval sends ids)
        echo: bool = False
        logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
        best_of: int | None = None
        suffix: str | None = None

    class ChatRequest(Sampling):
        messages: list[dict[str, Any]]
        max_completion_tokens: int | None = None
        logprobs: bool = False
        top_logprobs: int | None = None

    return CompletionRequest, ChatRequest


def parse(raw: bytes, model: type) -> Any:
    """The request body as `model`, or a RequestError that names the field."""
    from pydantic import ValidationError

    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8 (a form post), or nested absurdly deep
        raise RequestError(
            None,
            "the body is not valid JSON; send a JSON object (Content-Type: application/json)",
            code="json_invalid",
        ) from None
    if not isinstance(body, dict):
        raise RequestError(None, "the body must be a JSON object", code="invalid_type")
    for key, value in body.items():
        try:
            json.dumps([key, value], ensure_ascii=False).encode()
        except UnicodeEncodeError:
            name = json.dumps(key)[1:-1]
            msg = f"'{name}' contains a lone UTF-16 surrogate (such as \\ud800 without its pair); send valid Unicode"
            raise RequestError(name, msg, code="invalid_unicode") from None
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = loc[0] if loc else None  # the request field (deeper parts name union members)
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field '{param}'; see OpenAI's API reference for the field names"
        elif err.get("type") == "missing":
            msg = f"'{param}' is required"
        else:
            got = json.dumps(err.get("input"))[:80] if "input" in err else "?"
            msg = f"{param or 'body'}: {err.get('msg', 'invalid')} (got {got})"
        raise RequestError(param, msg, code=err.get("type", "invalid_value")) from None


def check_model(asked: str | None, served: str) -> None:
    if asked not in (None, served):
        msg = f"model '{asked}' is not served here; this server serves '{served}'"
        raise RequestError("model", msg, 404, "model_not_found")


def check_request(req: Any, served: str, context: int, prompts: list[list[int]]) -> tuple[int, list[str]]:
    """The checks that need more than one field (types and ranges were checked by the model):
    (max_tokens, stop strings). Completions default to 16 tokens, chats to the rest of the context."""
    chat = hasattr(req, "messages")
    check_model(req.model, served)
    if chat and req.logprobs:
        raise RequestError("logprobs", "chat logprobs are not supported; /v1/completions has them")
    if not chat and req.stream and len(prompts) > 1:
        raise RequestError("prompt", "send one prompt per streamed request")
    if not prompts or not all(prompts):
        raise RequestError("prompt", "prompt is empty; send the text to continue")
    longest = max(map(len, prompts))
    default = max(1, context - longest) if chat else 16  # a chat's: the rest of the context
    asked = (getattr(req, "max_completion_tokens", None), req.max_tokens, default)  # chat's newer name first
    max_tokens = next(n for n in asked if n is not None)
    if max_tokens < (0 if getattr(req, "echo", False) else 1):
        echo = "" if chat else " (0 only with echo)"
        raise RequestError("max_tokens", f"max_tokens must be >= 1{echo}, got {max_tokens}")
    if longest + max_tokens > context:
        msg = f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's context"
        raise RequestError("max_tokens", f"{msg} of {context} tokens; shorten the prompt or lower max_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError("stop", "stop takes up to 4 non-empty strings")
    neutral = dict(n=1, best_of=1, presence_penalty=0, frequency_penalty=0, logit_bias={}, suffix=None)
    for param, value in neutral.items():
        if getattr(req, param, None) not in (None, value):
            raise RequestError(param, f"{param} is not supported by this server; leave it at its default")
    return max_tokens, stops


def prompt_ids(prompt: Any, tok: Any) -> list[list[int]]:
    """The prompts of a completion request as token ids: one text, texts, one id list or id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    ids = [tok.encode(p) if isinstance(p, str) and p else p for p in prompt]
    if any(not 0 <= t < tok.vocab_size for p in ids for t in p):
        raise RequestError("prompt", f"token ids must be in [0, {tok.vocab_size}) (the model's vocabulary)")
    return ids


def chat_prompt(messages: list[dict], template: str | None) -> str:
    """The prompt for a chat: the tokenizer's Jinja template (HF's variables) when it has one, else the
    plain one: "System: ...", "User: ...", "Assistant: ..." turns a blank line apart, then "Assistant:"."""
    turns = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(p for p in parts if isinstance(p, str))
        if m.get("role") not in ROLE_NAMES or not isinstance(content, str):
            roles = ", ".join(ROLE_NAMES)
            raise RequestError("messages", f"messages[{i}] needs a role ({roles}) and a text content")
        turns.append({"role": m["role"], "content": content})
    if not turns:
        raise RequestError("messages", "messages is empty; send at least one message")
    if template:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
        return jinja.render(messages=turns, add_generation_prompt=True, bos_token="", eos_token="")
    return "".join(f"{ROLE_NAMES[t['role']]}: {t['content']}\n\n" for t in turns) + "Assistant:"


def logprobs_body(entries: list, offset: int) -> dict:
    """OpenAI's completions logprobs object; text_offset counts characters of the token texts."""
    body = {k: [e[i] for e in entries] for i, k in enumerate(("tokens", "token_logprobs", "top_logprobs"))}
    return {**body, "text_offset": list(accumulate((len(e[0]) for e in entries), initial=offset))[:-1]}


# ---------------------------------------------------------------- API keys

KEY_ENV = "PRETRAIN_API_KEY"
OPEN_PATHS = ("/health",)  # for probes: everything else, /metrics included, needs a key when keys are set
UNAUTHORIZED = {
    "missing_api_key": "no API key: send 'Authorization: Bearer <key>' (the openai client's api_key)",
    "invalid_api_key": "invalid API key: it is not one of the keys this server was started with",
}


def api_keys(flag: str | None) -> tuple[bytes, ...]:
    """The SHA-256 digests of the keys clients must send: --api-key, else $PRETRAIN_API_KEY, several
    comma-separated; () when neither is set (no key needed). Only digests are kept, so the keys
    themselves are in no object a log or a traceback could print; no message here quotes one."""
    source, text = ("--api-key", flag) if flag is not None else (KEY_ENV, os.environ.get(KEY_ENV))
    if text is None:
        return ()
    keys = [key.strip() for key in text.split(",") if key.strip()]
    if not keys:  # an empty Secret must not turn the key off
        raise UserError(f"{source} is set but holds no key; give one or more keys, comma-separated")
    for i, key in enumerate(keys, 1):
        if not all("!" <= c <= "~" for c in key):  # what a Bearer token can carry
            raise UserError(
                f"{source}: key {i} of {len(keys)} has a space or a character outside printable ASCII"
            )
    return tuple(hashlib.sha256(key.encode()).digest() for key in keys)


def refused(scope: dict, keys: tuple[bytes, ...]) -> str | None:
    """Why a request may not pass (missing_api_key, invalid_api_key), or None. Compares digests in
    constant time, against every key whatever matched before."""
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return "missing_api_key"
    digest = hashlib.sha256(token).digest()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(digest, key)
    return None if matched else "invalid_api_key"


def gate(app, metrics, state, keys: tuple[bytes, ...] = ()):
    """Pure ASGI, around the app: with `keys`, answers 401 in OpenAI's shape to a request on any path but
    /health without one of them (counted by reason); counts every API answer by its status (499 when the
    client hung up before the end, 500 for a crash) and the requests in flight; once draining, answers 503."""
    from fastapi.responses import JSONResponse
    from starlette.requests import ClientDisconnect

    async def gated(scope, receive, send) -> None:
        # No websocket route exists; one added later needs a key like every other path (a close before
        # the accept is the server's 403). Lifespan passes.
        if scope["type"] == "websocket" and keys and refused(scope, keys):
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await app(scope, receive, send)
        if keys and scope["path"] not in OPEN_PATHS and (reason := refused(scope, keys)):
            metrics.rejected.labels(reason=reason).inc()
            if scope["path"] != "/metrics":  # scrapes are not API requests
                metrics.requests.labels(status="401").inc()
            body = error_body(UNAUTHORIZED[reason], "invalid_request_error", None, "invalid_api_key")
            return await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope["path"] == "/metrics":
            return await app(scope, receive, send)
        status, finished, counted = 500, False, scope["path"] != "/health"  # probes are not API requests

        async def watch(message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        state.in_flight += 1
        metrics.in_flight.inc()
        try:
            if state.draining:
                if counted:
                    metrics.rejected.labels(reason="shutting_down").inc()
                msg = "the server is shutting down; retry on another replica"
                body = error_body(msg, "server_busy", None, "shutting_down")
                await JSONResponse(body, 503, headers={"Retry-After": "1"})(scope, receive, watch)
            else:
                await app(scope, receive, watch)
        except ClientDisconnect:
            finished = False
        except Exception:
            status, finished = 500, True
            raise
        finally:
            state.in_flight -= 1
            metrics.in_flight.dec()
            if counted:
                status = scope.get("pretrain.status", status)  # an error inside a stream already sent
                metrics.requests.labels(status=str(status if finished else 499)).inc()

    return gated


def draining_server(base: type, state, engine, grace: float) -> type:
    """uvicorn's Server, but the first SIGTERM/SIGINT drains: new requests get 503 while those in
    flight have `grace` seconds to finish; then what is left is cancelled and uvicorn stops. A second
    signal stops at once."""

    class DrainingServer(base):
        def handle_exit(self, sig, frame) -> None:
            if state.draining:
                return super().handle_exit(sig, frame)
            state.draining = True
            threading.Thread(target=self.drain, args=(sig, frame), daemon=True).start()

        def drain(self, sig, frame) -> None:
            for limit, then in ((grace, engine.cancel_all), (5.0, lambda: None)):
                deadline = time.monotonic() + limit
                while state.in_flight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                then()
            super().handle_exit(sig, frame)

    return DrainingServer
