"""`pretrain serve`: an OpenAI-compatible server for a checkpoint (FastAPI + uvicorn).

GET /health, GET /v1/models[/{id}], POST /v1/completions and /v1/chat/completions (server-sent events when
streamed), GET /metrics (Prometheus); docs/serving.md lists their fields. With --api-key (or
$PRETRAIN_API_KEY) every path but /health needs `Authorization: Bearer <key>`, else 401. Bad requests get
a 4xx in OpenAI's error shape (app/tools/serve_api.py); 503 when --max-queue requests are already
waiting, or once SIGTERM has arrived: the requests in flight then have --grace-seconds to finish, after
which they end with finish_reason "cancelled" (streams still send `[DONE]`). Requests in flight are
decoded together (app/tools/generation.py).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' parameter types at runtime.
import argparse
import asyncio
import ipaddress
import secrets
import socket
import sys
import time

from app.errors import UserError
from app.tools import serve_api as api


def create_app(engine, tok, model_name: str, info: dict, max_body_bytes: int, chat_template: str | None):
    """The FastAPI app around a running Engine. `info`: checkpoint path, step and context length."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from app.tools.generation import Job

    CompletionRequest, ChatRequest = api.request_models()
    metrics = engine.metrics
    context = int(info["context"])
    app = FastAPI(title="pretrain serve", version="1", docs_url="/docs", redoc_url=None)
    app.state.draining, app.state.in_flight = False, 0
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pretrain"}

    def fail(status: int, message: str, param=None, code=None, kind=None, headers=None):
        body = api.error_body(message, kind or "invalid_request_error", param, code)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return fail(exc.status_code, str(exc.detail))

    @app.exception_handler(api.RequestError)
    async def bad_request(_request: Request, e: api.RequestError) -> JSONResponse:
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
        api.check_model(model_id, model_name)
        return card

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def read(request: Request, model: type):
        """The body, up to --max-body-bytes (also when sent chunked), parsed as `model`."""
        length, over = request.headers.get("content-length"), f"over the limit of {max_body_bytes} bytes"
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            raise api.RequestError(None, f"request body of {length} bytes is {over}", 413, "body_too_large")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise api.RequestError(None, f"request body is {over}", 413, "body_too_large")
        return api.parse(body, model)

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
        """(text, logprob entries, finish reason) of a job."""
        parts, entries = [], []
        while (event := await job.events.get())[0] == "text":
            parts.append(event[1])
            entries += event[2]
        if event[0] == "error":
            raise api.RequestError(None, event[1], 500, "generation_failed")
        return "".join(parts), entries, event[1]

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        """OpenAI's completion or chat completion object, or its server-sent events."""
        t0, chat = time.monotonic(), request.url.path.endswith("/chat/completions")
        req = await read(request, ChatRequest if chat else CompletionRequest)
        if chat:
            prompts = [tok.encode(api.chat_prompt(req.messages, chat_template))]
        else:
            prompts = api.prompt_ids(req.prompt, tok)
        max_tokens, stops = api.check_request(req, model_name, context, prompts)
        if chat and not chat_template:
            stops.append(api.PLAIN_STOP)
        logprobs = None if chat else req.logprobs  # check_request refused chat logprobs
        seed = secrets.randbits(63) if req.seed is None else req.seed % 2**63
        settings = dict(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        loop, echo = asyncio.get_running_loop(), not chat and req.echo
        jobs = [
            Job(ids=ids, stops=stops, seed=seed, loop=loop, logprobs=logprobs, echo=echo, **settings)
            for ids in prompts
        ]
        engine.submit(jobs)
        metrics.prompt_tokens.inc(sum(map(len, prompts)))

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        kind = ("chat.completion.chunk" if req.stream else "chat.completion") if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": model_name}

        def envelope(choices: list, **extra) -> dict:
            return {**head, "choices": choices, **extra}

        def choice(text, finish, index=0, entries=None, offset=0) -> dict:
            if not chat:
                lp = None if logprobs is None or entries is None else api.logprobs_body(entries, offset)
                return {"text": text, "index": index, "logprobs": lp, "finish_reason": finish}
            said = (
                {"delta": {} if text is None else {"content": text}}
                if req.stream
                else {"message": {"role": "assistant", "content": text}}
            )
            return {"index": index, **said, "logprobs": None, "finish_reason": finish}

        if not req.stream:
            results = [await collect(job) for job in jobs]
            choices = [choice(text, reason, i, entries) for i, (text, entries, reason) in enumerate(results)]
            return envelope(choices, usage=account(jobs, t0))

        (job,) = jobs

        async def sse():
            offset = 0
            try:
                if chat:
                    yield api.sse_data(
                        envelope([{**choice("", None), "delta": {"role": "assistant", "content": ""}}])
                    )
                while (event := await job.events.get())[0] == "text":
                    yield api.sse_data(envelope([choice(event[1], None, 0, event[2], offset)]))
                    offset += sum(len(e[0]) for e in event[2])
                if event[0] == "error":
                    request.scope["pretrain.status"] = 500
                    yield api.sse_data(api.error_body(event[1], "server_error"))
                    return
                usage = account(jobs, t0)
                yield api.sse_data(envelope([choice(None if chat else "", event[1])]))
                if (req.stream_options or {}).get("include_usage"):
                    yield api.sse_data(envelope([], usage=usage))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): the worker stops at its next token
                job.cancelled.set()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.tools.sample import add_checkpoint_arguments

    add_checkpoint_arguments(p, "best")
    add = p.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)")
    add("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    add(
        "--api-key",
        metavar="KEY[,KEY...]",
        help=f"keys a client must send as 'Authorization: Bearer KEY' on every path but /health (401 otherwise);"
        f" default ${api.KEY_ENV}, which keeps them out of `ps` and shell history; neither: no key",
    )
    add("--model-name", default="", help="the id clients pass as `model` (default: the run dir's name)")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available (bf16)")
    add("--max-queue", type=int, default=64, metavar="N", help="requests that may wait; more get 503 (64)")
    add("--max-batch", type=int, default=16, metavar="N", help="requests decoded together (16)")
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
    from app.tools.sample import load_for_inference, pick_device, require_extra

    require_extra("serve", "fastapi", "uvicorn")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be a TCP port (0-65535), got {args.port}")
    minimums = {"--max-queue": 1, "--max-batch": 1, "--grace-seconds": 0, "--max-body-bytes": 1024}
    for flag, low in minimums.items():
        if not (value := getattr(args, flag[2:].replace("-", "_"))) >= low:  # NaN too
            raise UserError(f"{flag} must be >= {low}, got {value}")
    keys = api.api_keys(args.api_key)
    import torch
    import uvicorn

    from app.tools.generation import Engine, ServeMetrics

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
        if keys:
            print(f"API key required on every path but /health ({len(keys)} key(s) accepted)", flush=True)
        elif not ipaddress.ip_address(host).is_loopback:
            why = f"no API key (--api-key or ${api.KEY_ENV}): anyone who reaches {host}:{port} may use the model"
            print(f"warning: {why}", file=sys.stderr, flush=True)
        gated = api.gate(app, engine.metrics, app.state, keys)
        config = uvicorn.Config(gated, log_level=args.log_level, timeout_graceful_shutdown=5)
        api.draining_server(uvicorn.Server, app.state, engine, args.grace_seconds)(config).run(sockets=[sock])
    finally:
        if engine is not None:
            engine.close()
        sock.close()
    return 0


if __name__ == "__main__":
    from app.command import main_for

    sys.exit(main_for("pretrain serve", __doc__.splitlines()[0], add_arguments, run))
