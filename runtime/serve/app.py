"""The OpenAI-compatible HTTP API of `s2moe serve` (FastAPI): /v1/completions,
/v1/chat/completions, /v1/models and /health.

Requests are validated strictly (unknown fields, NaN, n > 1 are 400s with an OpenAI error body) and
handed to one worker thread in arrival order, so one decode runs at a time. Streaming responses are
server-sent events: text as it becomes final, then a last chunk with finish_reason, `usage` and the
run's `s2moe` stats, then `[DONE]`. A client that goes away cancels its job: a queued job never
starts, a running one stops at its next token.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..decoding.sampling import SamplingParams
from ..errors import S2MoEError
from .chat import ChatTemplate
from .worker import Job, Outcome, Worker


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = True  # usage is always sent; accepted for compatibility


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)
    user: Optional[str] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[str]]


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: Optional[str] = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def create_app(worker: Worker, template: ChatTemplate, defaults: dict):
    """``defaults``: the model's sampling defaults (generation_config.json or the GGUF's)."""
    app = FastAPI(title="s2moe", docs_url=None, redoc_url=None)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2moe-decode")  # arrival order
    state = {"queued": 0, "started": time.time()}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        msg = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            msg = f"unknown field {where!r}"
        elif first.get("type") == "json_invalid":
            msg, where = "the body is not valid JSON", None
        return JSONResponse(error_body(f"{where}: {msg}" if where else msg, param=where or None), status_code=400)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": worker.name, "busy": worker.busy, "queued": state["queued"],
                **worker.counts, "last": worker.last}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": worker.name, "object": "model", "created": int(state["started"]),
                                            "owned_by": "s2moe"}]}

    def make_job(req: _Common, prompt: str, max_tokens: int | None) -> Job:
        ids = worker.tok.encode(prompt).ids
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        room = worker.context - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context holds {worker.context} "
                                "(s2moe serve --ctx-size)", "prompt")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > 4:
            raise ApiError(400, "stop: at most 4 sequences", "stop")
        pick = lambda v, key, off: v if v is not None else defaults.get(key, off)  # noqa: E731
        try:
            params = SamplingParams(float(pick(req.temperature, "temperature", 0.0)), int(pick(req.top_k, "top_k", 0)),
                                    float(pick(req.top_p, "top_p", 1.0)), req.min_p or 0.0,
                                    req.seed if req.seed is not None and req.seed >= 0 else None)
        except S2MoEError as exc:
            raise ApiError(400, str(exc)) from None
        return Job(ids, min(max_tokens or room, room), params, stop)

    async def run(request: Request, job: Job, shape) -> object:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job.on_text = lambda text: loop.call_soon_threadsafe(queue.put_nowait, text)
        state["queued"] += 1
        future = loop.run_in_executor(pool, worker.run, job)
        future.add_done_callback(lambda f: (state.__setitem__("queued", state["queued"] - 1),
                                            queue.put_nowait(None)))
        if not shape.stream:
            while not future.done():  # poll for a client that went away
                done, _ = await asyncio.wait([future], timeout=0.1)
                if not done and await request.is_disconnected():
                    job.cancelled.set()
            return JSONResponse(shape.final(_result(future), job))

        async def events():
            try:
                yield _sse(shape.first())
                while True:
                    text = await queue.get()
                    if text is None:
                        break
                    yield _sse(shape.chunk(text))
                try:
                    yield _sse(shape.final(_result(future), job, chunk=True))
                except ApiError as exc:  # headers are sent: the error goes as an event
                    yield _sse(error_body(exc.message, exc.kind, exc.param))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or the stream ended): a running job stops at its next token
                job.cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt if isinstance(req.prompt, str) else (req.prompt[0] if len(req.prompt) == 1 else None)
        if prompt is None:
            raise ApiError(400, "prompt: one prompt per request (a string or a one-element list)", "prompt")
        job = make_job(req, prompt, req.max_tokens or 16)  # OpenAI's default for completions
        return await run(request, job, _Shape("text_completion", worker.name, req.stream, chat=False))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            prompt = template.render([m.model_dump(exclude_none=True) for m in req.messages])
        except Exception as exc:  # a template's raise_exception, or a render error
            raise ApiError(400, f"messages: the chat template refused them ({exc})", "messages") from None
        job = make_job(req, prompt, req.max_completion_tokens or req.max_tokens)
        return await run(request, job, _Shape("chat.completion", worker.name, req.stream, chat=True))

    app.state.worker, app.state.pool = worker, pool
    return app


def _result(future) -> Outcome:
    try:
        return future.result()
    except S2MoEError as exc:
        raise ApiError(500, f"generation failed: {exc}", kind="server_error") from None
    except Exception as exc:
        raise ApiError(500, f"generation failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                       kind="server_error") from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Shape:
    """The OpenAI response objects for one request: completion or chat, whole or chunked."""

    def __init__(self, kind: str, model: str, stream: bool, chat: bool):
        self.kind, self.model, self.stream, self.chat = kind, model, stream, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = self.kind + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, chunk: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if chunk:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}

    def first(self) -> dict:
        if not self.chat:
            return {**self._head(True), "choices": [self._choice("", None, True)]}
        return {**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "finish_reason": None}]}

    def chunk(self, text: str) -> dict:
        return {**self._head(True), "choices": [self._choice(text, None, True)]}

    def final(self, out: Outcome, job: Job, chunk: bool = False) -> dict:
        finish = "stop" if out.finish_reason == "stop" else "length"
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(out.tokens),
                 "total_tokens": len(job.ids) + len(out.tokens)}
        choice = self._choice(None if chunk else out.text, finish, chunk)
        return {**self._head(chunk), "choices": [choice], "usage": usage, "s2moe": out.stats}
