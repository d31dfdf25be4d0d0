"""The OpenAI-compatible HTTP app (FastAPI): requests in, engine calls, responses out.

It holds no scheduling logic: a request's prompts are admitted with one synchronous
`AsyncEngine.add_requests` (so whatever the engine refuses is a 4xx before any byte is sent),
and their outputs become OpenAI JSON or server-sent events. Every error is OpenAI's error object with the right status
(400 invalid parameter, naming it; 401 bad key; 404 unknown model; 413 body too large; 429
queue full; 503 loading or draining); one bad request never touches the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kiln
from kiln.errors import KilnError, ParamError
from kiln.runtime.threads import describe_threads

from . import responses
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class ServerConfig:
    artifact: str
    served_model_name: str | None = None
    api_key: str | None = None
    kv_memory: str = "auto"
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    prefix_caching: bool = True
    max_waiting: int = 512                 # requests queued beyond this get a 429
    max_body_bytes: int = 4 << 20
    threads: int | None = None             # CPU threads for the kernels (None: kiln.runtime.threads decides)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.artifact).name


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await error_response(413, f"request body over {self.limit} bytes")(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise APIError(413, f"request body over {self.limit} bytes")
            return message
        try:
            await self.app(scope, limited, send)
        except APIError as e:
            await error_response(e.status, e.message)(scope, receive, send)


class InFlight:
    """ASGI middleware: counts the /v1/ requests in flight in state["active"] (a streamed response
    counts until its last byte is sent), so a drain knows when they have finished."""

    def __init__(self, app, state: dict):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.state["active"] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state["active"] -= 1


def create_app(config: ServerConfig, load_now: bool = False) -> FastAPI:
    state = {"llm": None, "engine": None, "draining": False, "load_error": None, "active": 0}
    metrics = ServerMetrics(lambda: state["llm"].engine if state["llm"] else None, config.model_name)

    def load():
        llm = kiln.LLM(config.artifact, kv_memory=config.kv_memory, max_num_seqs=config.max_num_seqs,
                       max_batched_tokens=config.max_batched_tokens, prefix_caching=config.prefix_caching,
                       threads=config.threads)
        state["llm"], state["engine"] = llm, kiln.AsyncEngine(llm.engine)
        print(f"kiln serve: {config.model_name} ready; {llm.describe_kv()}; "
              f"{describe_threads(llm.threads)}", file=sys.stderr, flush=True)
        return llm

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state["llm"] is None:
            async def load_in_background():
                try:
                    await asyncio.to_thread(load)
                except Exception as e:        # /health reports it and the server stops (serve/server.py)
                    state["load_error"] = str(e)
            task = asyncio.get_running_loop().create_task(load_in_background())
        yield
        state["draining"] = True
        if state["llm"] is None:
            task.cancel()

    if load_now:
        load()
    app = FastAPI(title="kiln", version=kiln.__version__, lifespan=lifespan)
    app.state.kiln = state
    app.state.config = config
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(InFlight, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):    # unparsable body, unknown route, wrong method
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind=kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":        # its loc is a character offset, not a parameter
            at = [p for p in first.get("loc", ()) if isinstance(p, int)]
            return error_response(400, f"the body is not valid JSON: {message}"
                                       + (f" at character {at[0]}" if at else ""))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {message}", param)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):      # never a bare 500 page; the server keeps serving
        return error_response(500, f"internal error: {type(e).__name__}", kind="server_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
                return error_response(401, "missing or wrong API key", kind="authentication_error")
        return await call_next(request)

    def ready():
        if state["draining"]:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        if state["llm"] is None:
            raise APIError(503, "the model is loading" if not state["load_error"] else
                           f"the model failed to load: {state['load_error']}", kind="service_unavailable")
        return state["llm"], state["engine"]

    @app.get("/health")
    async def health():
        if state["load_error"]:
            return JSONResponse({"status": "error", "message": state["load_error"]}, status_code=503)
        if state["draining"] or state["llm"] is None:
            return JSONResponse({"status": "draining" if state["draining"] else "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": kiln.__version__}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(llm) -> dict:
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "kiln",
                "max_model_len": llm.model.max_context}

    @app.get("/v1/models")
    async def models():
        llm, _ = ready()
        return {"object": "list", "data": [model_card(llm)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        llm, _ = ready()
        if model_id != config.model_name:
            raise APIError(404, f"model {model_id!r} does not exist (this server has {config.model_name!r})",
                           "model", "not_found_error")
        return model_card(llm)

    def check_model(body):
        if body.model not in (None, config.model_name):
            raise APIError(404, f"model {body.model!r} does not exist (this server has {config.model_name!r})",
                           "model", "not_found_error")

    def sampling(body, llm, ids: list[int], max_tokens: int | None, default_max: int | None, logprobs: int | None,
                 prompt_logprobs: int | None = None, prompt_param: str = "prompt"):
        """The request's SamplingParams for one prompt; max_tokens defaults to what the context and
        the KV cache leave (at most `default_max`)."""
        context = llm.model.max_context
        if len(ids) >= context:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {context}", prompt_param,
                           "context_length_exceeded")
        pool = llm.engine.pool
        room = min(context, pool.num_pages * pool.page_size) - len(ids)   # what the context and KV cache allow
        if max_tokens is None:
            if room < 1:
                raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in this server's KV cache",
                               prompt_param, "context_length_exceeded")
            max_tokens = min(room, default_max or room)
        elif max_tokens > room:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens asks {max_tokens} more; at most "
                           f"{max(room, 0)} fit (context {context} tokens, KV cache {pool.num_pages * pool.page_size})",
                           "max_tokens", "context_length_exceeded")
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from None

    def submit(engine, body, ids: list[list[int]], params: list, texts: list[str | None], prefix: str,
               prompt_param: str = "prompt"):
        """Admit every prompt of the request in one synchronous step, before any byte is sent.
        Returns the response id and the stream of the engine requests (one per prompt)."""
        if len(engine.engine.scheduler.waiting) + engine.num_pending + len(ids) > config.max_waiting:
            raise APIError(429, "too many requests are waiting; retry later", kind="rate_limit_error")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return request_id, engine.add_requests([dict(prompt_ids=i, params=p, request_id=f"{request_id}-{k}", prompt=t,
                                             priority=body.priority)
                                        for k, (i, p, t) in enumerate(zip(ids, params, texts))])
        except ParamError as e:
            raise APIError(400, str(e), prompt_param if e.param == "prompt" else e.param) from None
        except KilnError as e:
            raise APIError(400, str(e)) from None

    async def respond(request_id, stream, body, fmt):
        """Stream the outputs as server-sent events, or wait for the whole response."""
        tracker = metrics.tracker()
        created = int(time.time())
        finals: dict[str, object] = {}

        def in_prompt_order():
            return [finals[r] for r in stream.request_ids]

        async def drain():
            """Every output, tracked; counts what a closed or failed stream leaves unfinished as aborted."""
            try:
                async for out in stream:
                    tracker.observe(out)
                    if out.finished:
                        finals[out.request_id] = out
                    yield out
            finally:
                unfinished = len(stream.request_ids) - len(finals)
                if unfinished:
                    tracker.aborted(unfinished * body.n)
                await stream.aclose()

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events():
                try:
                    async with contextlib.aclosing(drain()) as outs:
                        async for out in outs:
                            for chunk in fmt.chunks(out, request_id, created, config.model_name):
                                yield f"data: {json.dumps(chunk)}\n\n"
                except Exception as e:        # the stream already began: end it with an error event
                    error = {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                             "param": None, "code": 500}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                else:
                    if include_usage:
                        yield f"data: {json.dumps(fmt.usage_chunk(in_prompt_order(), request_id, created, config.model_name))}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        async with contextlib.aclosing(drain()) as outs:
            async for _ in outs:
                pass
        return fmt.response(in_prompt_order(), request_id, created, config.model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        llm, engine = ready()
        check_model(body)
        texts = [p if isinstance(p, str) else None for p in body.prompts]
        ids = [llm.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
        scoring = body.logprobs if body.echo else None      # echo + logprobs: the prompt's logprobs too
        params = [sampling(body, llm, i, body.max_tokens, 16, body.logprobs, scoring) for i in ids]
        request_id, stream = submit(engine, body, ids, params, texts, "cmpl")
        return await respond(request_id, stream, body, responses.Completion(llm.tokenizer, body, ids, texts, stream.request_ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        llm, engine = ready()
        check_model(body)
        tok = llm.tokenizer
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except KilnError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:          # the template itself failed on these messages (raise_exception, ...)
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        ids = tok.encode(text, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, llm, ids, body.max_completion_tokens or body.max_tokens, None, logprobs,
                          prompt_param="messages")
        request_id, stream = submit(engine, body, [ids], [params], [text], "chatcmpl", prompt_param="messages")
        return await respond(request_id, stream, body, responses.Chat(tok, body, [ids], [text], stream.request_ids))

    return app
