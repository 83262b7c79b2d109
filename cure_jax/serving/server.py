"""From a decoding config to a listening server: the models, the engine (every program
compiled before the first request), the app, and uvicorn, which prints one line when ready."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import uvicorn

from cure_jax.runtime import pipeline
from cure_jax.serving.app import create_app
from cure_jax.serving.engine import Engine
from cure_jax.serving.requests import Served

DEFAULT_MAX_LEN = 1024   # the cache of every slot when config.max_len is 0
CHUNK_S = 0.2            # seconds a chunk may take (Engine's chunk_s)


def load(config):
  """(target, drafter, tokenizer) of experiments.decode's config, checked."""
  pipeline.check_config(config)
  pipeline.enable_compilation_cache(config)
  pipeline.resolve_paths(config)
  target = pipeline.load_target(config)
  return target, pipeline.load_drafter(config, target), pipeline.load_tokenizer(
      config.target.path)


def build(config, target, drafter, tokenizer, slots: int, steps: int, max_waiting: int,
          model_name: str = "", drain_s: float = 30.0, chunk_s: float | None = CHUNK_S):
  """(app, Served) decoding with config's method and settings in `slots` slots, chunks of at
  most `steps` iterations and about chunk_s seconds (Engine)."""
  if max_waiting < 0:
    raise ValueError(f"max_waiting={max_waiting} must be >= 0 (requests queued for a slot)")
  stops = () if config.ignore_eos else pipeline.stop_ids(config.target.path, tokenizer)
  generator = pipeline.make_generator(config, target, drafter, stops)
  engine = Engine(generator, slots, int(config.max_len) or DEFAULT_MAX_LEN, steps, chunk_s)
  served = Served(model=model_name or Path(config.target.path).name,
                  max_tokens=int(config.max_new_tokens), temperature=float(config.temperature),
                  top_p=float(config.top_p), top_k=int(config.top_k), seed=int(config.seed),
                  vocab_size=target.cfg.vocab_size, tokenizer=tokenizer)
  return create_app(engine, served, max_waiting, drain_s), served


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1"):
  """The app served from a thread on a free port of `host`; yields its base URL."""
  server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
  thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
  thread.start()
  deadline = time.monotonic() + 120
  while not server.started:
    if time.monotonic() > deadline or not thread.is_alive():
      raise RuntimeError("the server did not start")
    time.sleep(0.02)
  port = server.servers[0].sockets[0].getsockname()[1]
  try:
    yield f"http://{host}:{port}"
  finally:
    server.should_exit = True
    thread.join(timeout=120)


class _Server(uvicorn.Server):
  """uvicorn's server, saying so once it listens."""

  def __init__(self, config: uvicorn.Config, ready_line: str):
    super().__init__(config)
    self.ready_line = ready_line

  async def startup(self, sockets=None):
    await super().startup(sockets)
    if self.started:
      print(self.ready_line, flush=True)

  async def shutdown(self, sockets=None):
    """After the graceful shutdown, forgets the SIGTERM it caught: uvicorn would raise it
    again on the way out, and a stop that finished its work exits 0."""
    await super().shutdown(sockets)
    self._captured_signals.clear()


def serve(app, served: Served, host: str, port: int, drain_s: float, method: str) -> None:
  """Runs until SIGTERM/SIGINT: then stops admitting, lets running requests finish for up to
  drain_s, cancels the rest, and returns."""
  config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=drain_s)
  _Server(config, f"cure_jax serve: ready on http://{host}:{port}/v1 (model {served.model}, "
                  f"method {method})").run()
