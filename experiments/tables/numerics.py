"""The numerics modes side by side (cure_jax/models/numerics.py).

Per mode: target-only decoding of every prompt alone (batch 1) and `batch` at a time; the prompts
whose tokens differ between the two, with the first step where they do and the batch-1 top-2
logits there (a near-tie the batch's other rows tipped); then the TPOT of target-only decoding
and of auto (the embedded default's method) at batch 1 in each mode, the modes interleaved prompt by prompt, round by round, so a shared
machine's drift falls on both alike.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np

from cure_jax.analysis.report import md_table
from cure_jax.models import numerics
from cure_jax.models.kernels import prefix as prefix_attention
from cure_jax.runtime import pipeline
from experiments.tables.bench import Bench, write_outputs

BATCH, ROUNDS, TIMED = 4, 3, 4   # TIMED: the first prompts that the TPOT rounds decode
METHODS = ("ar", "auto")          # timed: target-only and the embedded default's method


def _generator(bench: Bench, mode: str, method: str):
  cfg = copy.deepcopy(bench.config)
  with cfg.unlocked():
    cfg.numerics = mode
  bench.target.numerics = mode
  drafter = None if method == "ar" else bench.drafter
  return pipeline.make_generator(cfg, bench.target, drafter, bench.stops, method)


def _top2(target, ids: list[int]) -> list[float]:
  """The two largest next-token logits after `ids`, one prompt forward (in the target's mode)."""
  n = len(ids)
  cache = target.init_cache(1, n)
  tokens = jnp.asarray([ids], jnp.int32)
  out = target(tokens, jnp.arange(n)[None], cache,
               prefix_attention.Prefix(cache.lengths, jnp.full((1,), n, jnp.int32)))
  logits = np.asarray(target.logits(out.hidden[:, -1:]))[0, 0]
  return [float(x) for x in np.sort(logits)[-2:][::-1]]


def _flips(bench: Bench, mode: str, batch: int) -> tuple[list[dict], list]:
  """Prompts whose target-only tokens differ between batch 1 and `batch`, and the batch-1 runs."""
  gen = _generator(bench, mode, "ar")
  alone = pipeline.decode_all(gen, bench.ids, 1)
  together = pipeline.decode_all(gen, bench.ids, batch)
  flips = []
  for i, (a, t) in enumerate(zip(alone, together)):
    if a.output_ids == t.output_ids:
      continue
    step = next((j for j, (x, y) in enumerate(zip(a.output_ids, t.output_ids)) if x != y),
                min(len(a.output_ids), len(t.output_ids)))
    top2 = _top2(bench.target, bench.ids[i] + a.output_ids[:step])
    flips.append(dict(prompt=i, step=step, batch_1_token=a.output_ids[step] if step < len(
        a.output_ids) else None, batch_n_token=t.output_ids[step] if step < len(
        t.output_ids) else None, top2_logits=top2))
  return flips, alone


def table_numerics(bench: Bench, batch: int = BATCH, rounds: int = ROUNDS,
                   timed: int = TIMED) -> dict:
  modes = numerics.MODES
  flips, alone = {}, {}
  for mode in modes:
    flips[mode], alone[mode] = _flips(bench, mode, batch)
  timed_methods = list(METHODS)
  cases = [(mode, m) for m in timed_methods for mode in modes]
  gens = {c: _generator(bench, *c) for c in cases}
  for gen in gens.values():                           # compile + one untimed decode each
    gen.generate([bench.ids[0]])
  tpot = {c: [] for c in cases}
  for _ in range(rounds):
    for ids in bench.ids[:timed]:
      for c in cases:
        tpot[c].append(gens[c].generate([ids])[0].tpot_ms)
  bench.target.numerics = "default"
  ms = {c: float(np.median(tpot[c])) for c in cases}
  rows = [dict(numerics=mode, prompts=len(bench.ids), differ_batch_1_vs_n=len(flips[mode]),
               flips=flips[mode],
               tpot_ms={m: ms[(mode, m)] for m in timed_methods},
               tpot_ms_all={m: tpot[(mode, m)] for m in timed_methods},
               vs_default={m: ms[(mode, m)] / ms[("default", m)] for m in timed_methods})
          for mode in modes]
  payload = dict(batch=batch, rounds=rounds, timed_prompts=min(timed, len(bench.ids)),
                 max_new_tokens=int(bench.config.max_new_tokens), rows=rows,
                 same_tokens_across_modes=sum(
                     a.output_ids == b.output_ids
                     for a, b in zip(alone["default"], alone["invariant"])))
  md = [f"## Numerics modes: target-only at batch 1 vs {batch}, and TPOT at batch 1 "
        f"({len(bench.ids)} prompts, {payload['max_new_tokens']} new tokens; TPOT: the first "
        f"{payload['timed_prompts']}, median over {rounds} interleaved rounds)", "",
        md_table(["numerics", f"prompts whose tokens differ, batch 1 vs {batch}",
                  "first flip: prompt, step, top-2 logits at batch 1"] +
                 [f"{m} TPOT ms (vs default)" for m in timed_methods],
                 [[r["numerics"], f"{r['differ_batch_1_vs_n']} of {r['prompts']}",
                   "; ".join(f"{f['prompt']}, {f['step']}, {f['top2_logits'][0]:.5f} / "
                             f"{f['top2_logits'][1]:.5f}" for f in r["flips"][:1]) or "-"] +
                  [f"{r['tpot_ms'][m]:.1f} ({r['vs_default'][m]:.2f}×)" for m in timed_methods]
                  for r in rows]),
        "", f"Batch-1 tokens equal across the modes: {payload['same_tokens_across_modes']} of "
        f"{len(bench.ids)} prompts."]
  return write_outputs(bench, "numerics", payload, "\n".join(md) + "\n")
