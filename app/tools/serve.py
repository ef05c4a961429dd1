"""`pretrain serve`: an OpenAI-compatible completions server for a checkpoint (FastAPI + uvicorn).

    GET  /health           {"status": "ok", "model", "checkpoint", "step", "context"}
    GET  /v1/models        the one model served
    POST /v1/completions   prompt, max_tokens, temperature, top_p, top_k, stop, seed, echo, stream (SSE)
    GET  /metrics          Prometheus: requests by status, tokens, latency and time-to-first-token histograms

Bad requests get a 4xx with OpenAI's error shape, {"error": {"message", "type", "param", "code"}}: 400 for
an invalid field (wrong type, out of range, unknown name), 404 for another model name, 413 for a body over
--max-body-bytes, 503 when --max-queue requests are already waiting. Requests run one at a time on one
model (app/tools/generation.py), so concurrent clients are safe and are served in arrival order.
"""

# No `from __future__ import annotations`: FastAPI reads the request model from the live annotation.
import argparse
import asyncio
import json
import secrets
import socket
import sys
import time
from typing import Any

from app.errors import UserError

EXTRA_HINT = "pip install 'pretrain[serve]' (make setup installs it)"


def _require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"pretrain serve needs the serve extra ({e.name} is missing): {EXTRA_HINT}") from None


class RequestError(Exception):
    """A bad request: OpenAI's error fields and the HTTP status."""

    def __init__(self, param: str, message: str, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse_data(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def request_model():
    """The body of POST /v1/completions. Strict types (no "5" for 5), unknown fields rejected so a typo
    like `max_token` is an error rather than a silent default; OpenAI fields that this server does not
    implement are accepted only at their neutral values."""
    from pydantic import BaseModel, ConfigDict

    class CompletionRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

        prompt: str | list[str]
        model: str | None = None
        max_tokens: int = 16
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0  # not in OpenAI's API (the openai client sends it with extra_body)
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: dict[str, bool] | None = None
        seed: int | None = None
        echo: bool = False
        n: int = 1
        best_of: int | None = None
        logprobs: int | None = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logit_bias: dict[str, float] | None = None
        suffix: str | None = None
        user: str | None = None

    return CompletionRequest


def check_request(req: Any, served: str, context: int, prompt_ids: list[int]) -> list[str]:
    """Range checks with one clear message each (types were checked by the model); the stop strings."""
    if req.model not in (None, served):
        msg = f"model '{req.model}' is not served here; this server serves '{served}'"
        raise RequestError("model", msg, 404, "model_not_found")
    if not prompt_ids:
        raise RequestError("prompt", "prompt is empty; send the text to continue")
    if req.max_tokens < 1:
        raise RequestError("max_tokens", f"max_tokens must be >= 1, got {req.max_tokens}")
    if len(prompt_ids) + req.max_tokens > context:
        raise RequestError(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's context "
            f"of {context} tokens; shorten the prompt or lower max_tokens",
        )
    if not 0 <= req.temperature <= 2:
        raise RequestError("temperature", f"temperature must be in [0, 2], got {req.temperature}")
    if not 0 < req.top_p <= 1:
        raise RequestError("top_p", f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise RequestError("top_k", f"top_k must be >= 0 (0 = all tokens), got {req.top_k}")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError("stop", "stop takes up to 4 non-empty strings")
    unsupported = {
        "n": req.n != 1,
        "best_of": req.best_of not in (None, 1),
        "logprobs": req.logprobs is not None,
        "presence_penalty": req.presence_penalty != 0,
        "frequency_penalty": req.frequency_penalty != 0,
        "logit_bias": bool(req.logit_bias),
        "suffix": req.suffix is not None,
    }
    for param, used in unsupported.items():
        if used:
            raise RequestError(param, f"{param} is not supported by this server; leave it at its default")
    return stops


# ---------------------------------------------------------------- the app


def create_app(engine, tok, model_name: str, info: dict, max_body_bytes: int):
    """The FastAPI app around a running Engine. `info`: checkpoint path, step and context length."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from app.tools.generation import Busy, Job

    CompletionRequest = request_model()
    metrics = engine.metrics
    context = int(info["context"])
    created = int(time.time())
    app = FastAPI(title="pretrain serve", version="1", docs_url="/docs", redoc_url=None)

    def fail(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
        if status >= 400:
            metrics.requests.labels(status=str(status)).inc()
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None  # the request field (deeper parts name union members)
        if err.get("type") == "json_invalid":
            param, msg = None, "the request body is not valid JSON"
        elif err.get("type") == "extra_forbidden":
            msg = f"unknown field '{param}'; see the OpenAI completions API for field names"
        elif err.get("type") == "missing":
            msg = f"'{param}' is required"
        else:
            got = json.dumps(err.get("input"))[:80] if "input" in err else "?"
            msg = f"{param or 'body'}: {err.get('msg', 'invalid')} (got {got})"
        return fail(400, msg, param, err.get("type"))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return fail(exc.status_code, str(exc.detail))

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        over = f"over the limit of {max_body_bytes} bytes"
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return fail(413, f"request body of {length} bytes is {over}", code="body_too_large")
        if length is None and request.method == "POST":  # chunked: count what arrives
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_body_bytes:
                    return fail(413, f"request body is {over}", code="body_too_large")
            request._body = body  # starlette reads the cached body later
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, **info}

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "pretrain"}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):  # type: ignore[valid-type]
        t0 = time.monotonic()
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            return fail(400, "send exactly one prompt per request", "prompt", "invalid_value")
        prompt = prompts[0]
        ids = tok.encode(prompt) if prompt else []
        try:
            stops = check_request(req, model_name, context, ids)
        except RequestError as e:
            return fail(e.status, e.message, e.param, e.code)
        job = Job(
            ids=ids,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            stops=stops,
            seed=secrets.randbits(63) if req.seed is None else req.seed,
            loop=asyncio.get_running_loop(),
        )
        try:
            engine.submit(job)
        except Busy as e:
            return fail(503, str(e), code="queue_full", kind="server_busy", headers={"Retry-After": "1"})
        metrics.prompt_tokens.inc(len(ids))
        rid, now = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def usage() -> dict:
            n = job.completion_tokens
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        def done() -> None:
            metrics.completion_tokens.inc(job.completion_tokens)
            metrics.latency.observe(time.monotonic() - t0)
            if job.first_token:
                metrics.first_token.observe(job.first_token - t0)
            metrics.requests.labels(status="200").inc()

        def chunk(text: str, finish: str | None) -> dict:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [choice]}  # fmt: skip

        if not req.stream:
            parts = [prompt] if req.echo else []
            try:
                while (event := await job.events.get())[0] == "text":
                    parts.append(event[1])
            except asyncio.CancelledError:
                job.cancelled.set()
                raise
            if event[0] == "error":
                return fail(500, event[1], kind="server_error")
            done()
            return {**chunk("".join(parts), event[1]), "usage": usage()}

        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def sse():
            try:
                if req.echo:
                    yield sse_data(chunk(prompt, None))
                while (event := await job.events.get())[0] == "text":
                    yield sse_data(chunk(event[1], None))
                if event[0] == "error":
                    yield sse_data(error_body(event[1], "server_error"))
                    return
                done()
                yield sse_data(chunk("", event[1]))
                if include_usage:
                    yield sse_data({**chunk("", None), "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): the worker stops at its next token
                job.cancelled.set()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.tools.sample import add_checkpoint_arguments

    add_checkpoint_arguments(
        p,
        "best",
        "for a run dir: the checkpoint with the lowest val loss (default; latest when none has one) "
        "or the newest",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument(
        "--model-name", default="", help="the id clients pass as `model` (default: the run dir's name)"
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available (bf16)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for the model; more get HTTP 503 (default 64)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        metavar="N",
        help="largest request body accepted; larger gets HTTP 413 (default 1 MiB)",
    )
    p.add_argument(
        "--log-level",
        choices=("warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning)",
    )


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port is a one-line error, not a uvicorn traceback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror}); pass an IP address") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.listen(128)
    return sock


def run(args: argparse.Namespace) -> int:
    _require_extra()
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be a TCP port (0-65535), got {args.port}")
    if args.max_queue < 1:
        raise UserError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_body_bytes < 1024:
        raise UserError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    import torch
    import uvicorn

    from app.tools.generation import Engine, ServeMetrics
    from app.tools.sample import load_for_inference, pick_device

    device = pick_device(args.device)
    sock = bind(args.host, args.port)
    engine = None
    try:
        model, tok, ckpt = load_for_inference(args.checkpoint, device, args.which)
        if device == "cuda":  # GPU path (not exercised in CI): bf16 weights; RoPE and norms compute in fp32
            model = model.to(torch.bfloat16)
        name = args.model_name or ckpt.path.parent.parent.name or "pretrain"
        info = {"checkpoint": str(ckpt.path), "step": ckpt.step, "context": model.cfg.seq_len}
        engine = Engine(model, tok, ServeMetrics(), max_queue=args.max_queue)
        app = create_app(engine, tok, name, info, args.max_body_bytes)
        host, port = sock.getsockname()[:2]
        print(f"serving {ckpt.path} (step {ckpt.step}) as '{name}' on http://{host}:{port}/v1", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if engine is not None:
            engine.close()
        sock.close()
    return 0


if __name__ == "__main__":
    from app.command import main_for

    sys.exit(main_for("pretrain serve", __doc__.splitlines()[0], add_arguments, run))
