"""The HTTP server on 127.0.0.1 with a small random model in numerics=invariant: the real
`openai` client's completions (whole and streamed) equal offline decoding of each request alone,
every bad request gets its 4xx and OpenAI's error body, a full queue answers 429, a client that
leaves frees its slot, the metrics count every request once, and SIGTERM exits 0."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from cure_jax.analysis import random_models
from cure_jax.runtime.generation import Generator
from cure_jax.serving import server
from cure_jax.serving.app import create_app
from cure_jax.serving.engine import Engine
from cure_jax.serving.requests import Served
from cure_jax.tree.sampling import Sampling

REPO = Path(__file__).resolve().parents[1]
ARCH = random_models.Arch(vocab=64, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                          draft_layers=1, block_size=4, target_layer_ids=(0, 1))
MAX_LEN, MAX_NEW = 256, 200
MODEL = "random"


@pytest.fixture(scope="module")
def models():
  target, drafter = random_models.pair(ARCH, 2)
  target.numerics = "invariant"
  return target, drafter


def _generator(models, max_new_tokens=MAX_NEW, sampling=Sampling()):
  return Generator(*models, method="chain", max_new_tokens=max_new_tokens, max_len=MAX_LEN,
                   sampling=sampling)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _serving(models, slots=2, max_waiting=8, steps=1, temperature=0.0):
  """The app on a free port of 127.0.0.1, in a thread, greedy (temperature 0) or sampled;
  yields (base url, app)."""
  served = Served(MODEL, MAX_NEW, temperature, 1.0, 0, 0, ARCH.vocab)
  engine = Engine(_generator(models, sampling=Sampling(temperature)), slots, MAX_LEN, steps)
  app = create_app(engine, served, max_waiting, 5.0)
  with server.running(app) as url:
    yield url, app


def _prompts(count, seed=1):
  return random_models.prompts(seed, ARCH.vocab, count, lo=3, hi=20)


def _alone(models, prompt, max_tokens, seed=0, sampling=Sampling()):
  return _generator(models, max_tokens, sampling).generate([prompt], seed=seed)[0].output_ids


def _metric(text: str, name: str) -> float:
  """The sum of a metric's samples in a /metrics page."""
  return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text,
                                          re.M))


def test_openai_client_gets_each_request_decoded_alone(models):
  """Six requests at once through 2 slots, three streamed with usage: token ids equal each
  request decoded alone offline; usage carries the speculation figures."""
  prompts = _prompts(6)
  limits = [5, 30, 30, 5, 30, 5]

  async def ask(client, prompt, n, stream):
    if not stream:
      r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n)
      return r.choices[0].token_ids, r.usage.model_dump(), r.choices[0].finish_reason
    ids, usage, finish = [], None, None
    async for chunk in await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, stream=True,
        stream_options={"include_usage": True}):
      for c in chunk.choices:
        ids += c.token_ids
        finish = c.finish_reason or finish
      usage = chunk.usage.model_dump() if chunk.usage else usage
    return ids, usage, finish

  async def run(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return await asyncio.gather(*[ask(client, p, n, i % 2 == 1)
                                  for i, (p, n) in enumerate(zip(prompts, limits))])

  with _serving(models) as (url, _):
    got = asyncio.run(run(url))
  for (ids, usage, finish), p, n in zip(got, prompts, limits):
    assert ids == _alone(models, p, n)
    assert usage["completion_tokens"] == len(ids) and usage["prompt_tokens"] == len(p)
    assert usage["iterations"] >= 1 and 1.0 <= usage["mean_accepted_length"] <= ARCH.block_size
    assert finish == ("length" if len(ids) == n else "stop")


def test_a_sampled_server_takes_sampling_settings_per_request(models):
  """A server started at temperature 1: five requests at once through 2 slots, each with its
  own temperature, top_p and top_k (top_k as vLLM's extra field), one greedy and one with the
  server's defaults: token ids equal each request decoded alone offline with its settings."""
  prompts = _prompts(5, seed=7)
  asks = [dict(temperature=0.0), dict(temperature=0.6, top_p=0.9), dict(),
          dict(temperature=1.4, top_k=5), dict(temperature=0.8, top_p=0.7, top_k=20)]

  async def run(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def ask(prompt, a, seed):
      extra = {"top_k": a["top_k"]} if "top_k" in a else None
      r = await client.completions.create(
          model=MODEL, prompt=prompt, max_tokens=24, seed=seed, extra_body=extra,
          **{k: v for k, v in a.items() if k != "top_k"})
      return r.choices[0].token_ids

    return await asyncio.gather(*[ask(p, a, 10 + i) for i, (p, a) in enumerate(zip(prompts, asks))])

  with _serving(models, temperature=1.0) as (url, _):
    got = asyncio.run(run(url))
  for i, (ids, p, a) in enumerate(zip(got, prompts, asks)):
    settings = Sampling(a.get("temperature", 1.0), a.get("top_k", 0), a.get("top_p", 1.0))
    assert ids == _alone(models, p, 24, 10 + i, settings), a


BAD = [  # (body, status, param, words in the message)
    (b"{not json", 400, None, "not valid JSON"),
    (dict(model="gpt-4", prompt=[1, 2], max_tokens=4), 404, "model", "does not exist"),
    (dict(model=MODEL, prompt=[1, 2]), 400, "max_tokens", "required"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=-3), 400, "max_tokens", ">= 1"),
    (dict(model=MODEL, prompt=[1] * 100, max_tokens=MAX_NEW), 400, "max_tokens",
     f"max_len={MAX_LEN}"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=4, n=2), 400, "n", "n=1"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=4, logprobs=2), 400, "logprobs", "not built"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=4, temperature=0.7), 400, "temperature",
     "--config.temperature"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=4, top_p=1.5), 400, "top_p", "(0, 1]"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=4, top_k=2.5), 400, "top_k", "integer"),
    (dict(model=MODEL, prompt=[1, 2], max_tokens=4, best_of=3), 400, "best_of", "not supported"),
    (dict(model=MODEL, prompt="hello", max_tokens=4), 400, "prompt", "token ids"),
    (dict(model=MODEL, prompt=[1, 99], max_tokens=4), 400, "prompt", "[0, 64)"),
    (dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4), 400,
     "messages", "chat template"),
]


def test_every_bad_request_gets_its_4xx_and_openai_error_body(models):
  with _serving(models) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
    for body, status, param, words in BAD:
      path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else \
          "/v1/completions"
      r = (http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body))
      error = r.json()["error"]
      assert (r.status_code, error["param"]) == (status, param), (body, r.text)
      assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    metrics = http.get("/metrics").text
    assert _metric(metrics, "cure_jax:requests_rejected_total") == len(BAD)
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_load_with_leavers_and_a_full_queue_counts_every_request_once(models):
  """24 requests at once on 2 slots with a queue of 2: some answered 429 with Retry-After,
  four clients leave after their first streamed tokens; every completed one equals its offline
  decode, completed + cancelled + rejected = sent, and every slot is free at the end."""
  prompts = _prompts(24, seed=5)

  async def one(http, i):
    body = dict(model=MODEL, prompt=prompts[i], max_tokens=MAX_NEW if i % 6 == 0 else 16,
                stream=i % 6 == 0)
    if not body["stream"]:
      r = await http.post("/v1/completions", json=body)
      return i, r.status_code, r.headers.get("retry-after"), r.json()
    async with http.stream("POST", "/v1/completions", json=body) as r:
      if r.status_code != 200:
        return i, r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
      async for line in r.aiter_lines():
        if line.startswith("data: {"):
          return i, "left", None, None   # leaves after the first chunk

  async def run(url):
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
      return await asyncio.gather(*[one(http, i) for i in range(len(prompts))])

  with _serving(models, slots=2, max_waiting=2) as (url, _):
    got = asyncio.run(run(url))
    deadline = time.monotonic() + 30
    while (health := httpx.get(url + "/health").json())["free_slots"] < 2:
      assert time.monotonic() < deadline, health
      time.sleep(0.05)
    metrics = httpx.get(url + "/metrics").text
  done = [(i, body) for i, status, _, body in got if status == 200]
  full = [(retry, body) for _, status, retry, body in got if status == 429]
  left = [i for i, status, _, _ in got if status == "left"]
  assert full
  assert all(retry == "1" and body["error"]["code"] == "queue_full" for retry, body in full)
  assert len(done) + len(full) + len(left) == len(prompts)
  for i, body in done:
    assert body["choices"][0]["token_ids"] == _alone(models, prompts[i], 16)
  completed = _metric(metrics, "vllm:request_success_total")
  cancelled = _metric(metrics, "cure_jax:requests_cancelled_total")
  rejected = _metric(metrics, "cure_jax:requests_rejected_total")
  assert rejected == len(full) and len(done) <= completed <= len(done) + len(left)
  assert completed + cancelled + rejected == len(prompts)
  assert _metric(metrics, "vllm:num_requests_running") == 0


def test_sigterm_lets_the_running_request_finish_and_exits_0(models, tmp_path):
  """`python -m experiments.serve` on a random pair: ready line, a streamed request under way
  when SIGTERM comes still ends with [DONE], and the process exits 0."""
  target_dir, drafter_dir = random_models.write_hf(tmp_path, *random_models.pair(ARCH, 2))
  port = _free_port()
  cmd = [sys.executable, "-m", "experiments.serve", f"--port={port}", "--slots=2", "--steps=1",
         f"--config.target.path={target_dir}", f"--config.drafter.path={drafter_dir}",
         "--config.method=chain", f"--config.max_len={MAX_LEN}",
         f"--config.max_new_tokens={MAX_NEW}", "--config.compilation_cache=off",
         "--config.drafter.vocab=0", "--model_name=random"]
  env = dict(os.environ, PYTHONPATH=str(REPO))
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    line = proc.stdout.readline()
    while line and "ready on" not in line:
      line = proc.stdout.readline()
    assert f"ready on http://127.0.0.1:{port}/v1" in line
    body = dict(model="random", prompt=[1, 2, 3], max_tokens=MAX_NEW, stream=True)
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=60) as r:
      for line in r.iter_lines():
        if line.startswith("data:") and not events:
          proc.send_signal(signal.SIGTERM)
        events.append(line)
    assert events[-2:] == ["data: [DONE]", ""] or events[-1] == "data: [DONE]"
    assert proc.wait(timeout=60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
