"""`pretrain serve`: an OpenAI-compatible server for a checkpoint (FastAPI + uvicorn).

    GET  /health                 {"status": "ok", "model", "checkpoint", "step", "context"}
    GET  /v1/models[/{id}]       the one model served
    POST /v1/completions         prompt (text or token ids), max_tokens, temperature, top_p, top_k, stop,
                                 seed, echo, logprobs (top-k per token), stream (SSE)
    POST /v1/chat/completions    messages through the chat template (serve_api.chat_prompt), stream (SSE)
    GET  /metrics                Prometheus: requests by status, tokens, latency and time-to-first-token

Bad requests get a 4xx in OpenAI's error shape (app/tools/serve_api.py); 503 when --max-queue requests
are already waiting, or once SIGTERM has arrived: the requests in flight then have --grace-seconds to
finish, after which they end with finish_reason "cancelled" (streams still send `[DONE]`). Requests in
flight are decoded together (app/tools/generation.py).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' parameter types at runtime.
import argparse
import asyncio
import secrets
import socket
import sys
import time

from app.errors import UserError
from app.tools.serve_api import (
    MAX_LOGPROBS,
    PLAIN_STOP,
    Gate,
    RequestError,
    chat_prompt,
    check_sampling,
    draining_server,
    error_body,
    logprobs_body,
    parse,
    prompt_ids,
    request_models,
    sse_data,
)

EXTRA_HINT = "pip install 'pretrain[serve]' (make setup installs it)"


def _require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"pretrain serve needs the serve extra ({e.name} is missing): {EXTRA_HINT}") from None


def create_app(
    engine, tok, model_name: str, info: dict, max_body_bytes: int, chat_template: str | None = None
):
    """The FastAPI app around a running Engine. `info`: checkpoint path, step and context length."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from app.tools.generation import Job

    CompletionRequest, ChatRequest = request_models()
    metrics = engine.metrics
    context = int(info["context"])
    created = int(time.time())
    app = FastAPI(title="pretrain serve", version="1", docs_url="/docs", redoc_url=None)
    app.state.draining, app.state.in_flight = False, 0
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "pretrain"}

    def fail(status: int, message: str, param=None, code=None, kind=None, headers=None):
        body = error_body(message, kind or "invalid_request_error", param, code)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return fail(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestError)
    async def bad_request(_request: Request, e: RequestError) -> JSONResponse:
        if e.status == 503:  # the queue is full: come back soon
            return fail(503, e.message, e.param, e.code, "server_busy", {"Retry-After": "1"})
        return fail(e.status, e.message, e.param, e.code, "server_error" if e.status >= 500 else None)

    @app.exception_handler(Exception)  # the last resort: still JSON in OpenAI's shape
    async def crash(_request: Request, e: Exception) -> JSONResponse:
        return fail(500, f"internal error ({type(e).__name__}); see the server's log", kind="server_error")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, **info}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise RequestError("model", f"model '{model_id}' is not served here; this server serves '{model_name}'", 404, "model_not_found")  # fmt: skip
        return card

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def read(request: Request, model: type):
        """The body, up to --max-body-bytes (also when sent chunked), parsed as `model`."""
        length, over = request.headers.get("content-length"), f"over the limit of {max_body_bytes} bytes"
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            raise RequestError(None, f"request body of {length} bytes is {over}", 413, "body_too_large")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise RequestError(None, f"request body is {over}", 413, "body_too_large")
        return parse(body, model)

    def submit(req, prompts: list[list[int]], max_tokens: int, stops: list[str], logprobs=None, echo=False):
        seed = secrets.randbits(63) if req.seed is None else req.seed % 2**63
        jobs = [
            Job(ids=ids, max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                stops=stops, seed=seed, loop=asyncio.get_running_loop(), logprobs=logprobs,
                prompt_logprobs=echo and logprobs is not None)
            for ids in prompts
        ]  # fmt: skip
        engine.submit(jobs)
        metrics.prompt_tokens.inc(sum(map(len, prompts)))
        return jobs

    def account(jobs: list, t0: float) -> dict:
        """Metrics of a request that ended; its usage object."""
        used = sum(job.completion_tokens for job in jobs)
        metrics.completion_tokens.inc(used)
        metrics.latency.observe(time.monotonic() - t0)
        if firsts := [job.first_token for job in jobs if job.first_token]:
            metrics.first_token.observe(min(firsts) - t0)
        prompt = sum(len(job.ids) for job in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": used, "total_tokens": prompt + used}

    async def collect(job) -> tuple[str, list, str]:
        """(text, logprob entries: the prompt's then the completion's, finish reason) of a job."""
        parts, entries = [], []
        while (event := await job.events.get())[0] in ("prompt", "text"):
            if event[0] == "prompt":
                entries += event[1]
            else:
                parts.append(event[1])
                entries += [event[2]] if event[2] else []
        if event[0] == "error":
            raise RequestError(None, event[1], 500, "generation_failed")
        return "".join(parts), entries, event[1]

    async def answer(request: Request, req, jobs: list, chat: bool, echoed: list[str], t0: float):
        """The response: OpenAI's completion or chat completion object, or its server-sent events."""
        rid, now = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
        kind = ("chat.completion.chunk" if req.stream else "chat.completion") if chat else "text_completion"

        def envelope(choices: list, **extra) -> dict:
            return {
                "id": rid,
                "object": kind,
                "created": now,
                "model": model_name,
                "choices": choices,
                **extra,
            }

        def choice(text, finish, index=0, logprobs=None) -> dict:
            if not chat:
                return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
            said = {"delta": {} if text is None else {"content": text}} if req.stream else {"message": {"role": "assistant", "content": text}}  # fmt: skip
            return {"index": index, **said, "logprobs": None, "finish_reason": finish}

        if not req.stream:
            results = [await collect(job) for job in jobs]
            choices = [
                choice(pre + text, reason, i, None if chat or req.logprobs is None else logprobs_body(entries, 0))
                for i, (pre, (text, entries, reason)) in enumerate(zip(echoed, results, strict=True))
            ]  # fmt: skip
            return envelope(choices, usage=account(jobs, t0))

        (job,) = jobs

        async def sse():
            offset = 0
            try:
                if chat:
                    yield sse_data(envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))  # fmt: skip
                elif echoed[0] and not job.prompt_logprobs:
                    yield sse_data(envelope([choice(echoed[0], None)]))
                while (event := await job.events.get())[0] in ("prompt", "text"):
                    entries = event[1] if event[0] == "prompt" else [event[2]] if event[2] else []
                    text = echoed[0] if event[0] == "prompt" else event[1]
                    logprobs = None if chat or req.logprobs is None else logprobs_body(entries, offset)
                    offset += sum(len(e[0]) for e in entries)
                    yield sse_data(envelope([choice(text, None, 0, logprobs)]))
                if event[0] == "error":
                    request.scope["pretrain.status"] = 500
                    yield sse_data(error_body(event[1], "server_error"))
                    return
                usage = account(jobs, t0)
                yield sse_data(envelope([choice(None if chat else "", event[1])]))
                if (req.stream_options or {}).get("include_usage"):
                    yield sse_data(envelope([], usage=usage))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): the worker stops at its next token
                job.cancelled.set()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.monotonic()
        req = await read(request, CompletionRequest)
        prompts = prompt_ids(req.prompt, tok)
        if req.stream and len(prompts) > 1:
            raise RequestError("prompt", "send one prompt per streamed request")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens < (0 if req.echo else 1):
            raise RequestError("max_tokens", f"max_tokens must be >= 1 (0 only with echo), got {max_tokens}")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise RequestError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
        for ids in prompts:
            stops = check_sampling(req, model_name, context, len(ids), max_tokens)
        jobs = submit(req, prompts, max_tokens, stops, req.logprobs, req.echo)
        echoed = [tok.decode(ids) if req.echo else "" for ids in prompts]
        return await answer(request, req, jobs, False, echoed, t0)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        req = await read(request, ChatRequest)
        text = chat_prompt(req.messages, chat_template)
        ids = tok.encode(text)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = max(1, context - len(ids)) if wanted is None else wanted  # default: the rest
        if max_tokens < 1:
            raise RequestError("max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
        stops = check_sampling(req, model_name, context, len(ids), max_tokens)
        if req.logprobs:
            raise RequestError("logprobs", "chat logprobs are not supported; /v1/completions has them")
        jobs = submit(req, [ids], max_tokens, stops if chat_template else [*stops, PLAIN_STOP])
        return await answer(request, req, jobs, True, [""], t0)

    return app


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.tools.sample import add_checkpoint_arguments

    best = "for a run dir: the checkpoint with the lowest val loss (default; latest when none has one) or the newest"
    add_checkpoint_arguments(p, "best", best)
    add = p.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)")
    add("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    add("--model-name", default="", help="the id clients pass as `model` (default: the run dir's name)")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available (bf16)")
    add("--max-queue", type=int, default=64, metavar="N", help="requests that may wait; more get 503 (64)")
    add(
        "--max-batch", type=int, default=16, metavar="N", help="requests decoded together (1 = one at a time)"
    )
    add("--grace-seconds", type=float, default=20.0, metavar="S", help="SIGTERM: time left to requests (20)")
    add("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="larger bodies get 413 (1 MiB)")
    add("--log-level", choices=("warning", "info", "debug"), default="warning", help="uvicorn's (warning)")


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
    for flag, value in (("--max-queue", args.max_queue), ("--max-batch", args.max_batch)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if not args.grace_seconds >= 0:
        raise UserError(f"--grace-seconds must be >= 0, got {args.grace_seconds}")
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
        engine = Engine(model, tok, ServeMetrics(), max_queue=args.max_queue, max_batch=args.max_batch)
        template = ckpt.path / "chat_template.jinja"  # HF's file name, beside tokenizer.json
        chat_template = template.read_text() if template.is_file() else None
        app = create_app(engine, tok, name, info, args.max_body_bytes, chat_template)
        host, port = sock.getsockname()[:2]
        print(f"serving {ckpt.path} (step {ckpt.step}) as '{name}' on http://{host}:{port}/v1", flush=True)
        gated = Gate(app, engine.metrics, app.state)
        config = uvicorn.Config(gated, log_level=args.log_level, timeout_graceful_shutdown=5)
        draining_server(uvicorn.Server, gated, engine, args.grace_seconds)(config).run(sockets=[sock])
    finally:
        if engine is not None:
            engine.close()
        sock.close()
    return 0


if __name__ == "__main__":
    from app.command import main_for

    sys.exit(main_for("pretrain serve", __doc__.splitlines()[0], add_arguments, run))
