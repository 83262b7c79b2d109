"""A bounded load client for OpenAI-compatible servers (ours, or transformers serve), measuring
as `vllm bench serve` does: TTFT, TPOT = (latency - TTFT) / (tokens - 1), inter-token latency,
end-to-end latency (mean, median, p99), output tokens per second over the whole run.

A workload is fixed and seeded: prompts, max_tokens drawn per request, Poisson arrivals at a
rate (inf: all at once) under a concurrency cap; chosen requests leave after their first tokens
or are sent malformed. Every request is streamed with usage and bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time

import httpx
import numpy as np
import openai


logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per request


@dataclasses.dataclass(frozen=True)
class Item:
  prompt: list[int] | str
  max_tokens: int
  seed: int
  leave: bool = False        # the client disconnects after its first streamed tokens
  malformed: bool = False    # sent as a body that is not JSON


def workload(prompts: list, count: int, low: int, high: int, seed: int = 0,
             leave: float = 0.0, malformed: float = 0.0) -> list[Item]:
  """count requests cycling through prompts, max_tokens uniform in [low, high], fractions of
  them leaving or malformed: all drawn from `seed`."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(low, high + 1, count)
  fate = rng.random(count)
  return [Item(prompts[i % len(prompts)], int(tokens[i]), int(rng.integers(1 << 30)),
               leave=bool(fate[i] < leave), malformed=bool(leave <= fate[i] < leave + malformed))
          for i in range(count)]


@dataclasses.dataclass
class Record:
  status: int | str          # HTTP status, or "left"
  ttft: float = math.nan
  latency: float = math.nan
  times: list = dataclasses.field(default_factory=list)   # arrival time of each content chunk
  token_ids: list = dataclasses.field(default_factory=list)
  tokens: int = 0
  usage: dict | None = None


async def _send(client: openai.AsyncOpenAI, http: httpx.AsyncClient, model: str, item: Item,
                chat: bool, timeout: float, temperature: float | None) -> Record:
  if item.malformed:
    r = await http.post("/v1/completions", content=b'{"model": "' + model.encode() + b'", ')
    return Record(r.status_code)
  start = time.perf_counter()
  args = dict(model=model, max_tokens=item.max_tokens, seed=item.seed, stream=True,
              stream_options={"include_usage": True}, timeout=timeout)
  if temperature is not None:
    args["temperature"] = temperature
  try:
    if chat:
      stream = await client.chat.completions.create(
          messages=[{"role": "user", "content": item.prompt}], **args)
    else:
      stream = await client.completions.create(prompt=item.prompt, **args)
  except openai.APIStatusError as e:
    return Record(e.status_code)
  rec = Record(200)
  async with stream:
    async for chunk in stream:
      if chunk.usage is not None:
        rec.usage = chunk.usage.model_dump()
      for c in chunk.choices:
        ids = getattr(c, "token_ids", None) or []
        text = c.delta.content if chat else c.text
        if ids or text:
          rec.times.append(time.perf_counter() - start)
          rec.token_ids += ids
          rec.tokens += len(ids) or 1
      if item.leave and rec.times:
        rec.status = "left"
        return rec
  if rec.usage:
    rec.tokens = rec.usage["completion_tokens"]
  if rec.times:
    rec.ttft, rec.latency = rec.times[0], time.perf_counter() - start
  return rec


async def run(base_url: str, model: str, items: list[Item], rate: float, concurrency: int,
              chat: bool = False, seed: int = 0, timeout: float = 600.0,
              temperature: float | None = None):
  """Sends items in order at Poisson arrivals of `rate` per second (inf: at once), at most
  `concurrency` in flight; `temperature` sent when given (else the server's default). Returns
  (records in item order, wall seconds)."""
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(items)) if rate < math.inf \
      else np.zeros(len(items))
  cap = asyncio.Semaphore(concurrency)
  client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
  limits = httpx.Limits(max_connections=concurrency + 8)
  async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
    async def one(i, item):
      async with cap:
        return await _send(client, http, model, item, chat, timeout, temperature)

    start = time.perf_counter()
    tasks = []
    for i, item in enumerate(items):
      await asyncio.sleep(float(gaps[i]))
      tasks.append(asyncio.ensure_future(one(i, item)))
    records = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
  await client.close()
  return records, wall


def _stats(values) -> dict:
  v = np.asarray([x for x in values if not math.isnan(x)], float) * 1000.0
  if not len(v):
    return dict(mean=math.nan, median=math.nan, p99=math.nan)
  return dict(mean=float(v.mean()), median=float(np.median(v)), p99=float(np.percentile(v, 99)))


def summary(records: list[Record], wall: float) -> dict:
  """vLLM's serving figures (milliseconds) over the completed requests."""
  done = [r for r in records if r.status == 200 and r.tokens > 0]
  tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in done if r.tokens > 1]
  itl = [b - a for r in done for a, b in zip(r.times, r.times[1:])]
  accepted = [r.usage["mean_accepted_length"] for r in done
              if r.usage and r.usage.get("mean_accepted_length")]
  output = sum(r.tokens for r in done)
  return dict(completed=len(done), output_tokens=output, wall_s=wall,
              output_tokens_per_s=output / wall, ttft_ms=_stats(r.ttft for r in done),
              tpot_ms=_stats(tpot), itl_ms=_stats(itl),
              e2e_ms=_stats(r.latency for r in done),
              mean_accepted_length=float(np.mean(accepted)) if accepted else None)
