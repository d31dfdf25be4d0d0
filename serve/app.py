"""The OpenAI-compatible HTTP app (FastAPI): requests in, engine calls, responses out.

It holds no scheduling logic: the engine says what fits (`RequestLimits.max_tokens_for`: the context
and the KV cache) and admits a request's prompts with one synchronous `AsyncEngine.add_requests` (the
waiting limit too), so whatever the engine refuses is a 4xx before any byte is sent; their outputs
become OpenAI JSON or server-sent events. The routes are module-level functions over one
`ServerState`, which `create_app` makes and hangs on the app. Every error is OpenAI's error object with the right status
(400 invalid parameter, naming it; 401 bad key; 404 unknown model; 413 body too large; 429
queue full; 503 loading or draining); one bad request never touches the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Iterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kiln
from kiln.errors import ContextLengthError, KilnError, ParamError, QueueFull
from kiln.runtime.config import EngineConfig
from kiln.runtime.lora import LoRAError, LoRARequest, no_slots
from kiln.runtime.threads import describe_threads

from . import responses
from .metrics import EngineGauges, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .responses_api import ResponseFormat, ResponsesRequest
from .tool_calls import FORMATS, detect, json_calls, structural_tag


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """`kiln serve`'s settings: the artifact, its engine's (runtime/config.py), and the server's own."""
    artifact: str
    engine: EngineConfig = EngineConfig()
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    reasoning_parser: str | None = None    # serve/reasoning.py: thinking into reasoning_content
    tool_call_parser: str | None = None    # serve/tool_calls.py FORMATS (None: the chat template's)
    lora_modules: tuple[tuple[str, str], ...] = ()   # (name, PEFT adapter folder): a request's `model` picks one
    allow_runtime_lora_updating: bool = False        # POST /v1/load_lora_adapter and /v1/unload_lora_adapter

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.artifact).name

    @classmethod
    def of(cls, artifact: str, **settings) -> ServerConfig:
        """A config from flat settings (a Ray Serve config file's arguments, or a test's): the server's
        fields by name, the rest the engine's; a name neither has is refused."""
        own = {f.name for f in dataclasses.fields(cls)} - {"artifact", "engine"}
        engine = EngineConfig().replace(**{k: v for k, v in settings.items() if k not in own})
        return cls(artifact=str(artifact), engine=engine, **{k: v for k, v in settings.items() if k in own})


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
    """ASGI middleware: counts the /v1/ requests in flight in state.active (a streamed response
    counts until its last byte is sent), so a drain knows when they have finished."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.state.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.active -= 1


@dataclass
class ServerState:
    """What the routes share: the config, the model once loaded, and the server's phase."""
    config: ServerConfig
    metrics: ServerMetrics
    llm: kiln.LLM | None = None
    engine: kiln.AsyncEngine | None = None
    draining: bool = False
    load_error: str | None = None
    active: int = 0                  # /v1/ requests in flight (InFlight)
    # config -> (the model, its engine, a line saying what was loaded); the default runs one engine here,
    # kiln.serve.cluster's runs the engines in Ray Serve replicas
    opener: Callable[[ServerConfig], tuple] | None = None
    adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)   # served name -> adapter
    adapter_ids: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))

    def load(self) -> None:
        self.llm, self.engine, description = (self.opener or open_engine)(self.config)
        for name, path in self.config.lora_modules:          # read and checked now: a bad one stops the start
            self.add_adapter(name, path)
        adapters = f"; LoRA adapters: {', '.join(self.adapters)}" if self.adapters else ""
        print(f"kiln serve: {self.config.model_name} ready; {description}{adapters}", file=sys.stderr, flush=True)

    def add_adapter(self, name: str, path: str) -> None:
        """Register an adapter under `name` (read from disk and checked against the model's slots)."""
        if name in self.adapters or name == self.config.model_name:
            raise LoRAError(f"the name {name!r} is taken: adapter names must differ from each other and the model's")
        slots = self.engine.engine.lora_slots
        if slots is None:
            raise no_slots(name)
        lora = LoRARequest(name, next(self.adapter_ids), str(path))
        slots.check(lora)
        self.adapters[name] = lora

    def gauges(self) -> EngineGauges | None:
        """What /metrics reports of the engine (or the replicas' engines, summed)."""
        if self.engine is None:
            return None
        remote = getattr(self.engine, "gauges", None)
        return remote() if remote is not None else EngineGauges.of(self.engine.engine)

    def ready(self) -> tuple[kiln.LLM, kiln.AsyncEngine]:
        """The model and its engine, or a 503 while the server loads, failed to load, or drains."""
        if self.draining:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        if self.llm is None:
            raise APIError(503, "the model is loading" if not self.load_error else
                           f"the model failed to load: {self.load_error}", kind="service_unavailable")
        return self.llm, self.engine


def open_engine(config: ServerConfig) -> tuple:
    """The model and its async engine in this process, and what they are."""
    engine = config.engine.replace(overlap=False)          # not yet run under the server on a GPU
    llm = kiln.LLM(config.artifact, engine)
    spec = llm.speculative
    speculating = "" if spec is None else (f"; speculative decoding: {spec.method}"
                                           f"{f' ({spec.draft})' if spec.draft else ''}, "
                                           f"up to {spec.num_tokens} tokens")
    tiles = "" if llm.model.tiles is None else f"; {llm.model.tiles.describe()}"
    return (llm, kiln.AsyncEngine(llm.engine, max_waiting=engine.max_waiting),
            f"{llm.describe_kv()}; {describe_threads(llm.threads)}{speculating}{tiles}")


def create_app(config: ServerConfig, load_now: bool = False, opener: Callable[[ServerConfig], tuple] | None = None
               ) -> FastAPI:
    state = ServerState(config, ServerMetrics(lambda: state.gauges(), config.model_name), opener=opener)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.llm is None:
            async def load_in_background():
                try:
                    await asyncio.to_thread(state.load)
                except Exception as e:        # /health reports it and the server stops (serve/server.py)
                    state.load_error = str(e)
            task = asyncio.get_running_loop().create_task(load_in_background())
        yield
        state.draining = True
        if state.llm is None:
            task.cancel()

    if load_now:
        state.load()
    app = FastAPI(title="kiln", version=kiln.__version__, lifespan=lifespan)
    app.state.kiln = state
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(InFlight, state=state)
    app.middleware("http")(check_api_key)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(router)
    return app


def server_state(request: Request) -> ServerState:
    return request.app.state.kiln


Server = Annotated[ServerState, Depends(server_state)]
router = APIRouter()


# -- errors: every one is OpenAI's error object -----------------------------------------------------
async def api_error(request, e: APIError):
    return error_response(e.status, e.message, e.param, e.kind)


async def http_error(request, e: StarletteHTTPException):    # unparsable body, unknown route, wrong method
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), kind=kind)


async def invalid_request(request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":        # its loc is a character offset, not a parameter
        at = [p for p in first.get("loc", ()) if isinstance(p, int)]
        return error_response(400, f"the body is not valid JSON: {message}" + (f" at character {at[0]}" if at else ""))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return error_response(400, f"{param or 'body'}: {message}", param)


async def unexpected_error(request, e: Exception):      # never a bare 500 page; the server keeps serving
    print(f"kiln serve: internal error on {request.url.path}:", file=sys.stderr)
    traceback.print_exception(e, file=sys.stderr)           # the log says where
    return error_response(500, f"internal error: {type(e).__name__}", kind="server_error")


async def queue_full(request, e: QueueFull):     # raised while a response is awaited (replicas behind Ray)
    return error_response(429, str(e), kind="rate_limit_error")


ERROR_HANDLERS = {APIError: api_error, StarletteHTTPException: http_error, RequestValidationError: invalid_request,
                  QueueFull: queue_full, Exception: unexpected_error}


async def check_api_key(request: Request, call_next):
    api_key = request.app.state.kiln.config.api_key
    if api_key and request.url.path.startswith("/v1/"):
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            return error_response(401, "missing or wrong API key", kind="authentication_error")
    return await call_next(request)


# -- the server's own routes --------------------------------------------------------------------------
@router.get("/health")
async def health(s: Server):
    if s.load_error:
        return JSONResponse({"status": "error", "message": s.load_error}, status_code=503)
    if s.draining or s.llm is None:
        return JSONResponse({"status": "draining" if s.draining else "loading"}, status_code=503)
    return {"status": "ok"}


@router.get("/version")
async def version():
    return {"version": kiln.__version__}


@router.get("/metrics")
async def prometheus(s: Server):
    refresh = getattr(s.engine, "refresh_gauges", None)      # replicas behind Ray: fetch their gauges first
    if refresh is not None:
        await refresh()
    return PlainTextResponse(s.metrics.render(), media_type="text/plain; version=0.0.4")


# -- the OpenAI API -------------------------------------------------------------------------------------
def model_card(s: ServerState, adapter: LoRARequest | None = None) -> dict:
    """The model's card, or an adapter's (its parent the model, its root the adapter's folder, as vLLM's)."""
    card = {"id": s.config.model_name, "object": "model", "created": 0, "owned_by": "kiln",
            "max_model_len": s.llm.limits.max_context}
    if adapter is not None:
        card.update(id=adapter.lora_name, root=adapter.lora_path, parent=s.config.model_name)
    return card


@router.get("/v1/models")
async def models(s: Server):
    s.ready()
    return {"object": "list", "data": [model_card(s), *(model_card(s, a) for a in list(s.adapters.values()))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, s: Server):
    s.ready()
    return model_card(s, check_model(s, model_id))


def check_model(s: ServerState, name: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the model itself); a 404 for any other name."""
    if name in (None, s.config.model_name):
        return None
    if name in s.adapters:
        return s.adapters[name]
    names = ", ".join(repr(n) for n in (s.config.model_name, *s.adapters))
    raise APIError(404, f"model {name!r} does not exist (this server has {names})", "model", "not_found_error")


def _lora_updating(s: ServerState) -> None:
    s.ready()
    if not s.config.allow_runtime_lora_updating:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start kiln serve with "
                            "--allow-runtime-lora-updating", kind="not_found_error")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, s: Server):
    _lora_updating(s)
    try:
        await asyncio.to_thread(s.add_adapter, body.lora_name, body.lora_path)     # reads the files
    except LoRAError as e:
        raise APIError(400, str(e), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, s: Server):
    _lora_updating(s)
    lora = s.adapters.pop(body.lora_name, None)
    if lora is None:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", "lora_name", "not_found_error")
    s.engine.engine.lora_slots.unload(lora.lora_int_id)      # running requests on it finish on their slot
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def sampling(body, llm, ids: list[int], max_tokens: int | None, default_max: int | None, logprobs: int | None,
             prompt_logprobs: int | None = None, prompt_param: str = "prompt"):
    """The request's SamplingParams for one prompt; max_tokens defaults to what the context and the
    KV cache leave (at most `default_max`): the engine says what fits."""
    try:
        max_tokens = llm.limits.max_tokens_for(len(ids), max_tokens, default_max, prompt_param)
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ContextLengthError as e:
        raise APIError(400, str(e), e.param, "context_length_exceeded") from None
    except ParamError as e:
        raise APIError(400, str(e), e.param) from None


def submit(engine, body, ids: list[list[int]], params: list, texts: list[str | None], prefix: str,
           prompt_param: str = "prompt", lora: LoRARequest | None = None):
    """Admit every prompt of the request in one synchronous step, before any byte is sent (on `lora`,
    the adapter its `model` named). Returns the response id and the stream of the engine requests
    (one per prompt)."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        return request_id, engine.add_requests([dict(prompt_ids=i, params=p, request_id=f"{request_id}-{k}", prompt=t,
                                                     priority=body.priority, **({"lora_request": lora} if lora else {}))
                                                for k, (i, p, t) in enumerate(zip(ids, params, texts))],
                                               streaming=bool(body.stream))
    except QueueFull as e:
        raise APIError(429, str(e), kind="rate_limit_error") from None
    except ParamError as e:
        raise APIError(400, str(e), prompt_param if e.param == "prompt" else e.param) from None
    except KilnError as e:
        raise APIError(400, str(e)) from None


async def respond(s: ServerState, request_id, stream, body, fmt):
    """Stream the outputs as server-sent events, or wait for the whole response."""
    tracker = s.metrics.tracker()
    created, model_name = int(time.time()), body.model or s.config.model_name
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
                        for chunk in fmt.chunks(out, request_id, created, model_name):
                            yield f"data: {json.dumps(chunk)}\n\n"
            except Exception as e:        # the stream already began: end it with an error event
                error = {"message": str(e) if isinstance(e, KilnError) else f"internal error: {type(e).__name__}",
                         "type": "server_error", "param": None, "code": getattr(e, "status", 500)}
                yield f"data: {json.dumps({'error': error})}\n\n"
            else:
                if include_usage:
                    yield f"data: {json.dumps(fmt.usage_chunk(in_prompt_order(), request_id, created, model_name))}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    async with contextlib.aclosing(drain()) as outs:
        async for _ in outs:
            pass
    return fmt.response(in_prompt_order(), request_id, created, model_name)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, s: Server):
    llm, engine = s.ready()
    lora = check_model(s, body.model)
    texts = [p if isinstance(p, str) else None for p in body.prompts]
    ids = [llm.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
    scoring = body.logprobs if body.echo else None      # echo + logprobs: the prompt's logprobs too
    params = [sampling(body, llm, i, body.max_tokens, 16, body.logprobs, scoring) for i in ids]
    request_id, stream = submit(engine, body, ids, params, texts, "cmpl", lora=lora)
    return await respond(s, request_id, stream, body,
                         responses.Completion(llm.tokenizer, body, ids, texts, stream.request_ids))


def render_chat(tok, messages: list[dict], param: str, add_generation_prompt: bool = True, **variables):
    """The chat template's text for `messages`; a 400 naming `param` when it cannot render them."""
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
    except KilnError as e:
        raise APIError(400, str(e), param) from None
    except Exception as e:          # the template itself failed on these messages (raise_exception, ...)
        raise APIError(400, f"the chat template cannot render these messages: {e}", param) from None


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, s: Server):
    llm, engine = s.ready()
    lora = check_model(s, body.model)
    tok = llm.tokenizer
    messages = [m.for_template() for m in body.messages]
    variables = {**({"tools": body.tools} if body.tools else {}), **(body.chat_template_kwargs or {})}
    text = render_chat(tok, messages, "messages", body.add_generation_prompt, **variables)
    ids = tok.encode(text, add_special_tokens=False)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling(body, llm, ids, body.max_completion_tokens or body.max_tokens, None, logprobs,
                      prompt_param="messages")
    params, tool_format = with_tools(s.config, tok, body, body.tools, params)
    request_id, stream = submit(engine, body, [ids], [params], [text], "chatcmpl", prompt_param="messages",
                                lora=lora)
    return await respond(s, request_id, stream, body, responses.Chat(
        tok, body, [ids], [text], stream.request_ids, reasoning_parser=s.config.reasoning_parser,
        tool_format=tool_format))


def with_tools(config: ServerConfig, tok, body, tools: list[dict] | None, params):
    """(params, the tool-call format) for a request whose tools are in force, else (params, None):
    the format's markers kept in the text, and for a required or named tool_choice the grammar of
    its calls. The format is --tool-call-parser's, else the one the chat template writes; with
    neither, a required or named tool_choice gets JSON calls (tool_calls.json_calls, as vLLM does)
    and "auto", which would need to find calls in free text, a 400."""
    if not body.tools_in_force():
        return params, None
    forced = body.tool_choice not in (None, "auto")          # "required" or a named function: only calls
    found = FORMATS[config.tool_call_parser] if config.tool_call_parser else detect(tok.chat_template)
    if found is None and not forced:
        raise APIError(400, "this model's chat template shows no tool-call format kiln knows; start the server "
                            f"with --tool-call-parser ({', '.join(FORMATS)}), or send tool_choice 'required' "
                            "or a named function", "tools")
    if found is None:
        found, grammar = json_calls(tools, body.forced_tool(), body.parallel_tool_calls)
        return dataclasses.replace(params, structured=grammar), found
    params = dataclasses.replace(params, skip_special_tokens=params.skip_special_tokens and not found.special)
    if forced:
        params = dataclasses.replace(params, structured=structural_tag(found, tools, body.forced_tool(),
                                                                       body.parallel_tool_calls))
    return params, found


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, s: Server):
    llm, engine = s.ready()
    lora = check_model(s, body.model)
    tools = body.chat_tools()
    text = render_chat(llm.tokenizer, body.messages(), "input", **({"tools": tools} if tools else {}))
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    params = sampling(body, llm, ids, body.max_output_tokens, None, None, prompt_param="input")
    params, tool_format = with_tools(s.config, llm.tokenizer, body, tools, params)
    request_id, stream = submit(engine, body, [ids], [params], [text], "resp", prompt_param="input", lora=lora)
    return await respond(s, request_id, stream, body, ResponseFormat(body, ids, tool_format))
