"""Serving under load (docs/serving.md), with the seeded load client of cure_jax/serving/load.py.

  overhead     concurrency 1, streamed TPOT of the server against experiments.decode's TPOT
               (batch 1) on the same prompts and token counts
  throughput   one workload (max_tokens drawn per request) at a concurrency cap: our server
               (continuous batching), static batches of experiments.decode, and transformers'
               own continuous batching (`transformers serve --continuous-batching`), same client
  invariance   numerics=invariant: each request's tokens under load (random arrivals) against
               it decoded alone offline at batch 1, per method, greedy and seeded sampling
  faults       many clients, some leaving mid-stream, some sending malformed bodies: statuses,
               tokens against offline, the metrics' counts, free slots, memory growth

Our server runs in this process (a thread, cure_jax.serving.server.running); transformers in a
subprocess on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from cure_jax.analysis.report import md_table, num
from cure_jax.runtime import pipeline
from cure_jax.serving import load, server
from experiments.tables.bench import Bench, write_outputs

MODEL = "served"


def _config(bench: Bench, **fields):
  cfg = copy.deepcopy(bench.config)
  with cfg.unlocked():
    cfg.update(fields)
  bench.target.numerics = cfg.numerics
  return cfg


def _drafter(bench: Bench, cfg):
  return None if cfg.method == "ar" else bench.drafter


@contextlib.contextmanager
def _ours(bench: Bench, cfg, slots: int, steps: int, max_waiting: int = 1024):
  app, _ = server.build(cfg, bench.target, _drafter(bench, cfg), bench.tokenizer, slots, steps,
                        max_waiting, MODEL)
  with server.running(app) as url:
    yield url


def _client(url: str, items, rate: float, concurrency: int, chat: bool = False, model=MODEL,
            temperature=None):
  return asyncio.run(load.run(url, model, items, rate, concurrency, chat,
                              temperature=temperature))


def _offline(bench: Bench, cfg, prompts, batch: int):
  gen = pipeline.make_generator(cfg, bench.target, _drafter(bench, cfg), () if cfg.ignore_eos
                                else bench.stops)
  gen.generate(prompts[:batch])                                   # compile + warm
  start = time.perf_counter()
  results = pipeline.decode_all(gen, prompts, batch)
  return results, time.perf_counter() - start


def overhead(bench: Bench, prompts: int, tokens: int, slots: int, steps: int) -> dict:
  cfg = _config(bench, method="ar", max_new_tokens=tokens, ignore_eos=True, max_len=1024)
  ids = bench.ids[:prompts]
  results, _ = _offline(bench, cfg, ids, 1)
  items = [load.Item(p, tokens, 0) for p in ids]
  with _ours(bench, cfg, slots, steps) as url:
    _client(url, items[:1], math.inf, 1)                          # warm
    records, wall = _client(url, items, math.inf, 1)
  served = load.summary(records, wall)
  decode = 1000 * sum(r.decode_s for r in results) / sum(len(r.output_ids) - 1 for r in results)
  return dict(prompts=prompts, tokens=tokens, slots=slots, steps=steps,
              decode_tpot_ms=decode, served_tpot_ms=served["tpot_ms"]["mean"],
              ratio=served["tpot_ms"]["mean"] / decode, served=served)


def _transformers(bench: Bench, items, rate, concurrency) -> dict:
  """The same workload through `transformers serve --continuous-batching` (chat, text)."""
  port = 8765
  cmd = [shutil.which("transformers") or "transformers", "serve", "--continuous-batching",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         bench.config.target.path]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 300
    while True:
      try:
        httpx.get(url + "/v1/models", timeout=2).raise_for_status()
        break
      except httpx.HTTPError:
        if time.monotonic() > deadline or proc.poll() is not None:
          return dict(error=f"transformers serve did not start (exit {proc.poll()})")
        time.sleep(1)
    model = bench.config.target.path
    _client(url, items[:1], math.inf, 1, chat=True, model=model, temperature=0.0)  # load, warm
    records, wall = _client(url, items, rate, concurrency, chat=True, model=model,
                            temperature=0.0)
    return load.summary(records, wall)
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def throughput(bench: Bench, count: int, low: int, high: int, concurrency: int, slots: int,
               steps: int, rate: float, transformers: bool) -> dict:
  """Target-only (ar) greedy on every side: transformers serve does not speculate."""
  cfg = _config(bench, method="ar", max_new_tokens=high, max_len=1024)
  rows = [(bench.rows[i % len(bench.rows)]["prompt"], bench.ids[i % len(bench.ids)])
          for i in range(count)]
  items = load.workload([ids for _, ids in rows], count, low, high, seed=0)
  with _ours(bench, cfg, slots, steps) as url:
    _client(url, items[:1], math.inf, 1)
    ours = load.summary(*_client(url, items, rate, concurrency))
  results, wall = _offline(bench, cfg, [ids for _, ids in rows], concurrency)
  static = sum(min(len(r.output_ids), it.max_tokens) for r, it in zip(results, items))
  out = dict(count=count, max_tokens=[low, high], concurrency=concurrency, rate=rate, ours=ours,
             static=dict(output_tokens=static, wall_s=wall, output_tokens_per_s=static / wall),
             method=cfg.method)
  if transformers:
    text = [load.Item(p, it.max_tokens, it.seed) for (p, _), it in zip(rows, items)]
    out["transformers"] = _transformers(bench, text, rate, concurrency)
  return out


def _mismatches(records, alone) -> int:
  return sum(r.token_ids != a.output_ids for r, a in zip(records, alone) if r.status == 200)


def _alone(gen, items, greedy: bool) -> list:
  """Each item decoded alone at batch 1; repeats of one request (its seed matters only when
  sampling) are decoded once."""
  done = {}
  for it in items:
    key = (tuple(it.prompt), it.max_tokens, None if greedy else it.seed)
    if key not in done:
      done[key] = gen.generate([it.prompt], seed=it.seed)[0]
  return [done[(tuple(it.prompt), it.max_tokens, None if greedy else it.seed)] for it in items]


PREFILL = 64   # prompt tokens per prefill step of the invariance and fault runs


def _invariant(bench: Bench, items, tokens: int, **fields):
  """numerics=invariant with a cache just long enough for the items and short prefill steps
  (a prompt pads to a whole step): on a CPU the invariant kernels pay for every padded row."""
  longest = max(len(it.prompt) for it in items) + tokens
  return _config(bench, numerics="invariant", max_new_tokens=tokens, prefill_chunk=PREFILL,
                 max_len=PREFILL * -(-longest // PREFILL), **fields)


def invariance(bench: Bench, count: int, tokens: int, concurrency: int, slots: int, steps: int,
               runs, save) -> list[dict]:
  """Per run, its row handed to `save` as soon as it is measured."""
  out = []
  for method, temperature in runs:
    start = time.perf_counter()
    items = load.workload(bench.ids, count, tokens, tokens, seed=1)
    cfg = _invariant(bench, items, tokens, method=method, temperature=temperature)
    gen = pipeline.make_generator(cfg, bench.target, _drafter(bench, cfg), bench.stops)
    alone = _alone(gen, items, temperature == 0.0)
    alone_s = time.perf_counter() - start
    with _ours(bench, cfg, slots, steps) as url:
      records, wall = _client(url, items, 4.0, concurrency)
    usage = [r.usage for r in records if r.status == 200 and r.usage]
    iterations = sum(u["iterations"] for u in usage)
    emitted = sum(u["iterations"] * u["mean_accepted_length"] for u in usage)
    out.append(dict(method=method, temperature=temperature, requests=count, max_tokens=tokens,
                    max_len=cfg.max_len, completed=sum(r.status == 200 for r in records),
                    mismatches=_mismatches(records, alone), iterations=iterations,
                    tau=emitted / max(iterations, 1), alone_s=alone_s, load_wall_s=wall,
                    wall_s=time.perf_counter() - start, utc=_utc()))
    save(out[-1])
  return out


def _utc() -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _rss_mb() -> float:
  with open("/proc/self/status") as f:
    return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def _outcomes(records, alone) -> dict:
  return dict(sent=len(records),
              statuses={s: sum(str(r.status) == s for r in records)
                        for s in sorted({str(r.status) for r in records})},
              server_errors=sum(isinstance(r.status, int) and r.status >= 500 for r in records),
              mismatches=_mismatches(records, alone))


def faults(bench: Bench, count: int, tokens: int, concurrency: int, slots: int,
           steps: int, save) -> dict:
  """What the run has seen handed to `save` after every 100 requests, the whole at the end."""
  start = time.perf_counter()
  items = load.workload(bench.ids, count, tokens, tokens, seed=2, leave=0.10, malformed=0.05)
  cfg = _invariant(bench, items, tokens, method="ar")
  unique = list({tuple(it.prompt): it.prompt for it in items}.values())   # greedy: one each
  results, _ = _offline(bench, cfg, unique, slots)
  by_prompt = {tuple(p): r for p, r in zip(unique, results)}
  alone = [by_prompt[tuple(it.prompt)] for it in items]
  row = dict(requests=count, concurrency=concurrency, slots=slots, max_tokens=tokens,
             max_len=cfg.max_len)
  with _ours(bench, cfg, slots, steps) as url:
    records, rss = [], []
    for first in range(0, count, 100):
      records += _client(url, items[first:first + 100], math.inf, concurrency)[0]
      rss.append(_rss_mb())
      save(dict(row, **_outcomes(records, alone), rss_mb=rss, partial=True, utc=_utc()))
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").json()["free_slots"] < slots and time.monotonic() < deadline:
      time.sleep(0.1)
    health = httpx.get(url + "/health").json()
    metrics = httpx.get(url + "/metrics").text

  def metric(name):
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                            metrics, re.M))

  counted = (metric("vllm:request_success_total") + metric("cure_jax:requests_cancelled_total")
             + metric("cure_jax:requests_rejected_total"))
  out = dict(row, **_outcomes(records, alone), counted=counted,
             free_slots=health["free_slots"], rss_mb=rss,
             rss_growth=rss[-1] / rss[0] - 1 if len(rss) > 1 else 0.0,
             wall_s=time.perf_counter() - start, utc=_utc())
  save(out)
  return out


SECTIONS = ("overhead", "throughput", "invariance", "faults")
RUNS = (("ar", 0.0), ("chain", 0.0), ("ddtree", 0.0), ("cure", 0.0), ("auto", 0.0),
        ("chain", 1.0), ("ddtree", 1.0), ("cure", 1.0))


def _earlier(bench: Bench) -> dict:
  """What an earlier run wrote into the same results folder (its sections are kept)."""
  path = Path(bench.results_dir) / "serving.json"
  if not path.is_file():
    return {}
  earlier = json.loads(path.read_text())
  return {k: earlier[k] for k in SECTIONS if k in earlier}


def table_serving(bench: Bench, count: int = 64, concurrency: int = 8, slots: int = 8,
                  steps: int = 8, rate: float = math.inf, transformers: bool = True,
                  invariance_count: int = 48, fault_count: int = 400, tokens: int = 32,
                  runs=RUNS, sections: tuple[str, ...] = SECTIONS) -> dict:
  """The sections asked for, each written (atomically) as soon as it is measured, beside what
  earlier runs wrote into the same folder; an invariance run replaces the row of its (method,
  temperature). tokens: max_tokens of every invariance and fault request."""
  payload = _earlier(bench)
  save = lambda: write_outputs(bench, "serving", payload, _markdown(payload))   # noqa: E731
  if "overhead" in sections:   # with the server's slots, and with one (no idle rows)
    payload["overhead"] = [overhead(bench, 4, 64, n, steps) for n in sorted({slots, 1})]
    save()
  if "throughput" in sections:
    payload["throughput"] = throughput(bench, count, 16, 256, concurrency, slots, steps, rate,
                                       transformers)
    save()
  if "invariance" in sections:
    def keep(row):
      rows = [r for r in payload.get("invariance", [])
              if (r["method"], r["temperature"]) != (row["method"], row["temperature"])]
      payload["invariance"] = rows + [row]
      save()
    invariance(bench, invariance_count, tokens, concurrency, slots, steps, runs, keep)
  if "faults" in sections:
    def keep_faults(row):
      payload["faults"] = row
      save()
    faults(bench, fault_count, tokens, 32, slots, steps, keep_faults)
  return payload


def _markdown(p: dict) -> str:
  lines = []
  med = lambda s, k: f"{s[k]['median']:.1f}" if k in s else "—"   # noqa: E731
  if "throughput" in p:
    t = p["throughput"]
    systems = [("cure_jax serve", t["ours"]), ("experiments.decode static batches", t["static"])]
    if "transformers" in t:
      systems.append(("transformers serve --continuous-batching", t["transformers"]))
    rows = [[name, f"{s.get('output_tokens_per_s', math.nan):.1f}", med(s, "ttft_ms"),
             med(s, "tpot_ms"), med(s, "itl_ms"), med(s, "e2e_ms")] for name, s in systems]
    lines += [f"Serving, {t['count']} requests, max_tokens {t['max_tokens']}, concurrency "
              f"{t['concurrency']}, method {t['method']}", "",
              md_table(["system", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
                        "e2e p50 ms"], rows), ""]
  for o in p.get("overhead", []):
    lines += [f"Overhead at concurrency 1 (ar, {o['tokens']} tokens, {o['slots']} slots): served "
              f"TPOT {o['served_tpot_ms']:.2f} ms vs experiments.decode {o['decode_tpot_ms']:.2f} "
              f"ms ({o['ratio']:.3f}x)", ""]
  if "invariance" in p:
    lines += [md_table(["method", "temperature", "requests", "max_tokens", "completed",
                        "mismatches", "iterations", "τ", "measured"],
                       [[r["method"], r["temperature"], r["requests"], r.get("max_tokens"),
                         r["completed"], r["mismatches"], r.get("iterations", "—"),
                         num(r["tau"], ".3f") if "tau" in r else "—", r.get("utc")]
                        for r in p["invariance"]]), ""]
  if "faults" in p:
    f = p["faults"]
    if f.get("partial"):
      lines += [f"Faults ({f['utc']}), so far: {f['sent']} of {f['requests']} requests, "
                f"statuses {f['statuses']}, 5xx {f['server_errors']}, mismatches "
                f"{f['mismatches']}, RSS {f['rss_mb']} MB"]
    else:
      lines += [f"Faults ({f['utc']}): {f['requests']} requests, statuses {f['statuses']}, 5xx "
                f"{f['server_errors']}, mismatches {f['mismatches']}, counted "
                f"{f['counted']:.0f}, free slots {f['free_slots']}/{f['slots']}, RSS growth "
                f"{100 * f['rss_growth']:.1f}% ({f['rss_mb'][0]:.0f} -> {f['rss_mb'][-1]:.0f} MB)"]
  return "\n".join(lines)
