"""The goodput table: does speculation ever lose? Every method at three budgets, and auto, side
by side at several batch sizes, each batch size one sweep in this process.

ar; chain; ddtree and cure at three node budgets each; auto (the goodput controller over budgets
1 / 4 / 8 / 16, on this machine's cost curve timed at start-up). Per variant and batch size: τ,
nodes verified per iteration, TPOT, tokens/s, speed against ar of the same sweep, and how often
auto took each budget. The verdicts the table checks: auto ≥ 0.97× ar and ≥ 0.95× the best fixed
setting at every batch size.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

from cure_jax.analysis.report import md_table, num
from experiments.tables.bench import (Bench, Variant, _indices, run_variants, summarize,
                                      write_outputs)

BATCH_SIZES = (1, 4, 16)


def goodput_variants(block_size: int) -> list[Variant]:
  """ar, chain, ddtree and cure at budgets from the block up, auto."""
  k = block_size
  return ([Variant.of("ar", "ar"), Variant.of("chain", "chain")] +
          [Variant.of(f"ddtree v{v}", "ddtree", v_max=v) for v in (k, 2 * k, 4 * k)] +
          [Variant.of(f"cure v{v}", "cure", v_max=v) for v in (k + 8, 2 * k, 4 * k)] +
          [Variant.of("auto", "auto")])


def _sweep(bench: Bench, batch: int, variants, idx) -> list[dict]:
  """One batch size: a Bench of its own (results and compiles are per batch size)."""
  config = copy.deepcopy(bench.config)
  with config.unlocked():
    config.batch_size = batch
  sub = dataclasses.replace(bench, config=config, runs={}, generators={})
  runs = run_variants(sub, variants, idx, f"goodput batch {batch}")
  ar = summarize(runs["ar"])
  rows = []
  for v in variants:
    s = summarize(runs[v.label], runs["ar"])
    budgets = collections.Counter(st["budget"] for r in runs[v.label] for st in r.stats
                                  if st.get("budget"))
    s.update(method=v.label, batch=batch, vs_ar=ar["tpot_ms"] / s["tpot_ms"],
             budgets={int(n): c for n, c in sorted(budgets.items())})
    rows.append(s)
  return rows


def table_goodput(bench: Bench, batch_sizes=BATCH_SIZES, variants=None, methods=()) -> dict:
  """variants: ar, auto and the fixed settings to compare (default: goodput_variants, or those
  of them labelled in `methods`)."""
  idx = _indices(bench)
  variants = variants or goodput_variants(bench.drafter.cfg.block_size)
  if methods:
    unknown = sorted(set(methods) - {v.label for v in variants})
    if unknown or not {"ar", "auto"} <= set(methods):
      raise ValueError(f"--goodput_methods: {unknown or list(methods)}; give 'ar', 'auto' and any "
                       f"of {', '.join(v.label for v in variants)}")
    variants = [v for v in variants if v.label in methods]
  rows, verdicts = [], []
  for batch in batch_sizes:
    sweep = _sweep(bench, batch, variants, idx)
    rows += sweep
    auto = next(r for r in sweep if r["method"] == "auto")
    fixed = [r for r in sweep if r["method"] != "auto"]
    best = max(fixed, key=lambda r: r["tokens_per_s"])
    verdicts.append(dict(batch=batch, auto_vs_ar=auto["vs_ar"],
                         auto_vs_best=auto["tokens_per_s"] / best["tokens_per_s"],
                         best_fixed=best["method"],
                         auto_ok=auto["vs_ar"] >= 0.97 and
                         auto["tokens_per_s"] >= 0.95 * best["tokens_per_s"]))
  payload = dict(prompts=len(idx), batch_sizes=list(batch_sizes), rows=rows, verdicts=verdicts)
  md = [f"## Goodput: every method at three budgets and auto, {len(idx)} prompts, "
        f"max_new_tokens={bench.config.max_new_tokens}; one sweep per batch size, variants "
        "interleaved by batch (TPOT = decode wall time / tokens after the first)", "",
        md_table(["batch", "method", "τ", "nodes/iter", "TPOT ms", "tokens/s", "vs ar",
                  "≠ ar", "budgets taken (auto)"],
                 [[r["batch"], r["method"], num(r["tau"]), num(r["nodes_verified"], ".1f"),
                   num(r["tpot_ms"], ".1f"), num(r["tokens_per_s"], ".1f"),
                   num(r["vs_ar"], ".2f", "×"), r.get("mismatches_vs_ar", 0),
                   " ".join(f"{n}:{c}" for n, c in r["budgets"].items())] for r in rows]),
        "", md_table(["batch", "auto vs ar", "auto vs best fixed", "best fixed", "auto ≥ 0.97× ar "
                      "and ≥ 0.95× best"],
                     [[v["batch"], num(v["auto_vs_ar"], ".2f", "×"),
                       num(v["auto_vs_best"], ".2f", "×"), v["best_fixed"],
                       "yes" if v["auto_ok"] else "no"] for v in verdicts])]
  return write_outputs(bench, "goodput", payload, "\n".join(md) + "\n")
