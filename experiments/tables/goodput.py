"""The goodput table: does speculation ever lose? Every method at three budgets, and auto, side
by side at several batch sizes, each batch size one sweep in this process.

ar; chain; ddtree and cure at three node budgets each; auto (the goodput controller over budgets
1 / 4 / 8 / 16, on this machine's cost curve timed at start-up). Per variant and batch size: τ,
nodes verified per iteration, TPOT, tokens/s, speed against ar of the same sweep, and how often
auto took each budget. The verdicts the table checks: auto ≥ 0.97× ar and ≥ 0.95× the best fixed
setting at every batch size. Each batch size is timed in several rounds over the same prompts,
variants interleaved by batch in each; a variant's TPOT is its median over the rounds and its
speed against ar the median of the rounds' ratios, so that one disturbed pass on this shared
machine does not decide it (the same program twice reads ~1.00×). auto carries what its looks
learned from round to round, as a long-running process would.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import statistics

from cure_jax.analysis.report import md_table, num
from experiments.tables.bench import (Bench, Variant, _indices, run_variants, summarize,
                                      write_outputs)

BATCH_SIZES = (1, 4, 16)
ROUNDS = 3


def goodput_variants(block_size: int) -> list[Variant]:
  """ar, chain, ddtree and cure at budgets from the block up, auto."""
  k = block_size
  return ([Variant.of("ar", "ar"), Variant.of("chain", "chain")] +
          [Variant.of(f"ddtree v{v}", "ddtree", v_max=v) for v in (k, 2 * k, 4 * k)] +
          [Variant.of(f"cure v{v}", "cure", v_max=v) for v in (k + 8, 2 * k, 4 * k)] +
          [Variant.of("auto", "auto")])


def _sweep(bench: Bench, batch: int, variants, idx, rounds: int) -> list[dict]:
  """One batch size: a Bench of its own (results and compiles are per batch size), timed in
  `rounds` rounds that share its generators (one warm-up, before the first)."""
  config = copy.deepcopy(bench.config)
  with config.unlocked():
    config.batch_size = batch
  sub = dataclasses.replace(bench, config=config, runs={}, generators={})
  passes = []
  for r in range(rounds):
    timed = dataclasses.replace(sub, runs={}, warmup=sub.warmup and r == 0)
    passes.append(run_variants(timed, variants, idx, f"goodput batch {batch} round {r + 1}"))
  rows = []
  for v in variants:
    each = [summarize(runs[v.label]) for runs in passes]
    ratios = [summarize(runs["ar"])["tpot_ms"] / e["tpot_ms"] for runs, e in zip(passes, each)]
    s = summarize([r for runs in passes for r in runs[v.label]],   # τ, ≠ ar: every round
                  [r for runs in passes for r in runs["ar"]])
    s.update(tpot_ms=statistics.median(e["tpot_ms"] for e in each))
    s["tokens_per_s"] = 1000.0 / s["tpot_ms"]
    budgets = collections.Counter(st["budget"] for runs in passes for r in runs[v.label]
                                  for st in r.stats if st.get("budget"))
    s.update(method=v.label, batch=batch, vs_ar=statistics.median(ratios),
             rounds_tpot_ms=[e["tpot_ms"] for e in each], rounds_vs_ar=ratios,
             budgets={int(n): c for n, c in sorted(budgets.items())})
    rows.append(s)
  return rows


def table_goodput(bench: Bench, batch_sizes=BATCH_SIZES, variants=None, methods=(),
                  rounds: int = ROUNDS) -> dict:
  """variants: ar, auto and the fixed settings to compare (default: goodput_variants, or those
  of them labelled in `methods`); rounds: timed passes over the prompts per batch size."""
  idx = _indices(bench)
  variants = variants or goodput_variants(bench.drafter.cfg.block_size)
  if methods:
    unknown = sorted(set(methods) - {v.label for v in variants})
    if unknown or not {"ar", "auto"} <= set(methods):
      raise ValueError(f"--goodput_methods: {unknown or list(methods)}; give 'ar', 'auto' and any "
                       f"of {', '.join(v.label for v in variants)}")
    variants = [v for v in variants if v.label in methods]
  if rounds < 1:
    raise ValueError(f"--goodput_rounds={rounds} must be >= 1")
  rows, verdicts = [], []
  for batch in batch_sizes:
    sweep = _sweep(bench, batch, variants, idx, rounds)
    rows += sweep
    auto = next(r for r in sweep if r["method"] == "auto")
    fixed = [r for r in sweep if r["method"] != "auto"]
    best = max(fixed, key=lambda r: r["tokens_per_s"])
    verdicts.append(dict(batch=batch, auto_vs_ar=auto["vs_ar"],
                         auto_vs_best=auto["tokens_per_s"] / best["tokens_per_s"],
                         best_fixed=best["method"],
                         auto_ok=auto["vs_ar"] >= 0.97 and
                         auto["tokens_per_s"] >= 0.95 * best["tokens_per_s"]))
  payload = dict(prompts=len(idx), batch_sizes=list(batch_sizes), rounds=rounds, rows=rows,
                 verdicts=verdicts)
  md = [f"## Goodput: every method at three budgets and auto, {len(idx)} prompts, "
        f"max_new_tokens={bench.config.max_new_tokens}; per batch size {rounds} rounds, "
        "variants interleaved by batch in each; TPOT (decode wall time / tokens after the "
        "first) and vs ar: medians over the rounds, then each round's; ≠ ar: over all rounds",
        "",
        md_table(["batch", "method", "τ", "nodes/iter", "TPOT ms", "tokens/s", "vs ar",
                  "rounds: TPOT ms", "rounds: vs ar", "≠ ar", "budgets taken (auto)"],
                 [[r["batch"], r["method"], num(r["tau"]), num(r["nodes_verified"], ".1f"),
                   num(r["tpot_ms"], ".2f"), num(r["tokens_per_s"], ".1f"),
                   num(r["vs_ar"], ".3f", "×"),
                   " / ".join(num(t, ".2f") for t in r["rounds_tpot_ms"]),
                   " / ".join(num(x, ".3f") for x in r["rounds_vs_ar"]),
                   r.get("mismatches_vs_ar", 0),
                   " ".join(f"{n}:{c}" for n, c in r["budgets"].items())] for r in rows]),
        "", md_table(["batch", "auto vs ar", "auto vs best fixed", "best fixed", "auto ≥ 0.97× ar "
                      "and ≥ 0.95× best"],
                     [[v["batch"], num(v["auto_vs_ar"], ".2f", "×"),
                       num(v["auto_vs_best"], ".2f", "×"), v["best_fixed"],
                       "yes" if v["auto_ok"] else "no"] for v in verdicts])]
  return write_outputs(bench, "goodput", payload, "\n".join(md) + "\n")
