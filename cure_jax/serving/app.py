"""The OpenAI-compatible HTTP API over the scheduler: /v1/completions, /v1/chat/completions
(streamed over SSE or whole), /v1/models, /health and /metrics.

A request is checked whole before it is queued (requests.parse, Engine.check): whatever fails
answers OpenAI's error body with a 4xx. A client that leaves has its request cancelled; its
slot is free before the next chunk. Each outcome is counted once (metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from cure_jax.serving.engine import Engine, Request
from cure_jax.serving.metrics import Metrics
from cure_jax.serving.requests import ApiError, Job, Served, bad, parse
from cure_jax.serving.scheduler import Scheduler, Ticket
from cure_jax.serving.text import Output


def create_app(engine: Engine, served: Served, max_waiting: int, drain_s: float = 30.0):
  """The app; its lifespan starts the engine's thread and, on shutdown (SIGTERM), stops
  admitting and lets running requests finish for up to drain_s before cancelling them."""
  metrics = Metrics(served.model)
  scheduler = Scheduler(engine, metrics, max_waiting)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    scheduler.start()
    yield
    await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, drain_s)

  app = FastAPI(lifespan=lifespan)
  app.state.scheduler, app.state.metrics = scheduler, metrics

  @app.exception_handler(ApiError)
  async def api_error(request, err: ApiError):
    metrics.reject(err.status)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

  @app.get("/health")
  async def health():
    free = len(engine.free_slots())
    body = {"status": "stopping" if scheduler.stopping else "ok", "slots": engine.slots,
            "free_slots": free, "waiting": len(scheduler.waiting)}
    return JSONResponse(body, status_code=503 if scheduler.stopping else 200)

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": served.model, "object": "model", "created": 0,
                                        "owned_by": "cure_jax", "max_model_len": engine.max_len}]}

  @app.post("/v1/completions")
  async def completions(request: HttpRequest):
    return await _serve(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: HttpRequest):
    return await _serve(request, chat=True)

  async def _serve(request: HttpRequest, chat: bool):
    try:
      body = json.loads(await request.body())
    except ValueError as e:
      raise bad(None, f"the request body is not valid JSON ({e})", "invalid_json") from None
    job = parse(body, served, chat)
    try:
      engine.check(len(job.prompt), job.max_tokens)
    except ValueError as e:
      raise bad("max_tokens", str(e)) from None
    ticket = scheduler.submit(Request(tuple(job.prompt), job.max_tokens, job.seed,
                                      job.sampling))
    output = Output(served.tokenizer, job.stop, engine.spec.stop_ids, job.max_tokens)
    reply = _Reply(served.model, job, output, ticket)
    if job.stream:
      return StreamingResponse(_stream(reply), media_type="text/event-stream")
    return await _whole(request, reply)

  async def _pieces(reply: "_Reply"):
    """(text, ids) as the request's tokens arrive; ends when it ends or a stop string cuts it
    (then its slot is freed: the engine needs not go on)."""
    while (ids := await reply.ticket.events.get()) is not None:
      text, ids = reply.output.add(ids)
      yield text, ids
      if reply.output.stopped:
        scheduler.cancel(reply.ticket)
        return
    yield reply.output.flush(), []

  async def _stream(reply: "_Reply"):
    try:
      first = True
      async for text, ids in _pieces(reply):
        if text or ids or first:
          yield _sse(reply.chunk(text, ids, None, role=first))
          first = False
      if reply.aborted():
        yield _sse(reply.chunk("", [], "abort"))
        return
      yield _sse(reply.chunk("", [], reply.output.finish_reason()))
      if reply.job.include_usage:
        yield _sse(dict(reply.chunk("", [], None), choices=[], usage=reply.usage()))
      yield "data: [DONE]\n\n"
      reply.done = True
    finally:
      _count(reply)

  async def _whole(request: HttpRequest, reply: "_Reply"):
    async def collect():
      async for _ in _pieces(reply):
        pass

    task = asyncio.ensure_future(collect())
    try:
      while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
          task.cancel()
          return Response(status_code=499)
      if reply.aborted():   # the server is stopping (counted as cancelled, not rejected)
        err = ApiError(503, "the server stopped before this request finished; retry",
                       code="shutting_down", kind="server_unavailable")
        return JSONResponse(err.body(), status_code=503, headers={"Retry-After": "1"})
      reply.done = True
      return reply.whole()
    finally:
      _count(reply)

  def _count(reply: "_Reply") -> None:
    """The request's one outcome: completed, or cancelled (its slot freed)."""
    if reply.done:
      metrics.success.labels(served.model, reply.output.finish_reason()).inc()
    else:
      scheduler.cancel(reply.ticket)
      metrics.cancelled.labels(served.model).inc()

  return app


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


class _Reply:
  """One request's response bodies, OpenAI's shapes (plus token_ids and speculation usage)."""

  def __init__(self, model: str, job: Job, output: Output, ticket: Ticket):
    self.model, self.job, self.output, self.ticket = model, job, output, ticket
    self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.done = False

  def aborted(self) -> bool:
    return self.ticket.cancelled and not self.output.stopped

  def usage(self) -> dict:
    n, t = len(self.output.ids), self.ticket
    return {"prompt_tokens": len(self.job.prompt), "completion_tokens": n,
            "total_tokens": len(self.job.prompt) + n, "iterations": t.iterations,
            "mean_accepted_length": t.emitted / t.iterations if t.iterations else 0.0}

  def chunk(self, text: str, ids: list[int], finish, role: bool = False) -> dict:
    if self.job.chat:
      delta = {"content": text, **({"role": "assistant"} if role else {})}
      choice = {"index": 0, "delta": delta, "token_ids": ids, "finish_reason": finish}
      kind = "chat.completion.chunk"
    else:
      choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": None,
                "finish_reason": finish}
      kind = "text_completion"
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
            "choices": [choice]}

  def whole(self) -> dict:
    out = self.output
    if self.job.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                "token_ids": out.ids, "finish_reason": out.finish_reason()}
      kind = "chat.completion"
    else:
      choice = {"index": 0, "text": out.text, "token_ids": out.ids, "logprobs": None,
                "finish_reason": out.finish_reason()}
      kind = "text_completion"
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
            "choices": [choice], "usage": self.usage()}
