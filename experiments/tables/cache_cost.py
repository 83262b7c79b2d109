"""What a target-only step costs as the context and the cache grow: ar's TPOT at a short and a
long context with the cache sized to the prompt (the default), and at the short context in the
long one's cache. A step should pay for the context it holds, not the cache it could hold.

The long prompt is HumanEval problem 0 after other problems' code (as the long-context table
builds it), the short one its last tokens. The cases run interleaved, round by round, so that a shared machine's drift falls on
all of them alike; each case's TPOT is the median over rounds.
"""

from __future__ import annotations

import copy

import numpy as np

from cure_jax.analysis.report import md_table, num
from cure_jax.runtime import pipeline
from experiments.tables.bench import Bench, write_outputs
from experiments.tables.long_context import _bench_at

SHORT, LONG = 256, 4000          # context tokens
ROUNDS = 5


def _generator(bench: Bench, max_len: int):
  cfg = copy.deepcopy(bench.config)
  with cfg.unlocked():
    cfg.max_len = max_len
  return pipeline.make_generator(cfg, bench.target, bench.drafter, bench.stops, "ar")


def table_cache_cost(bench: Bench, short: int = SHORT, long: int = LONG,
                     rounds: int = ROUNDS) -> dict:
  if bench.tokenizer is None:
    raise ValueError("the cache-cost table builds text prompts: the target needs a tokenizer")
  ids = _bench_at(bench, long, 1).ids[0]
  prompts = {long: ids, short: ids[-short:]}       # the short one: the long one's last tokens
  new = int(bench.config.max_new_tokens)
  big = _generator(bench, 0).cache_len(len(prompts[long]))   # the long prompt's cache, in slots
  cases = [(short, 0), (short, big), (long, 0)]     # (context, max_len; 0: sized to the prompt)
  gens = {c: _generator(bench, c[1]) for c in cases}
  for (n, _), gen in gens.items():                  # compile + one untimed decode
    gen.generate([prompts[n]])
  tpot = {c: [] for c in cases}
  outputs = {}
  for _ in range(rounds):
    for c in cases:
      r = gens[c].generate([prompts[c[0]]])[0]
      tpot[c].append(r.tpot_ms)
      outputs[c] = r.output_ids
  base = float(np.median(tpot[(short, 0)]))
  rows = []
  for (n, max_len), times in tpot.items():
    ms = float(np.median(times))
    rows.append(dict(context_tokens=len(prompts[n]), max_len=max_len or "prompt",
                     cache_slots=gens[(n, max_len)].cache_len(len(prompts[n])), tpot_ms=ms,
                     tpot_ms_rounds=times, vs_short_default=ms / base))
  payload = dict(rounds=rounds, max_new_tokens=new, rows=rows,
                 same_tokens_in_both_caches=outputs[(short, 0)] == outputs[(short, big)])
  md = [f"## Target-only TPOT against context and cache size (ar, batch 1, {new} new tokens, "
        f"median of {rounds} interleaved rounds)", "",
        md_table(["context tokens", "max_len", "cache slots", "TPOT ms", "vs short, default"],
                 [[r["context_tokens"], r["max_len"], r["cache_slots"], num(r["tpot_ms"], ".1f"),
                   num(r["vs_short_default"], ".2f", "×")] for r in rows]),
        "", f"Same tokens in both caches: {payload['same_tokens_in_both_caches']}."]
  return write_outputs(bench, "cache_cost", payload, "\n".join(md) + "\n")
