"""Table 4 of the paper: cure's ablations on a fixed subset (the first 64 problems by default).

cure without branch 0, without the drafter resync after a winning repair, and without both,
beside ar, chain and cure: τ and its change against cure, TPOT, speedup over ar, TPOT ratio
against chain, repair wins, and τ right after a repair win / a branch-0 win.
"""

from __future__ import annotations

from typing import Sequence

from cure_jax.analysis.report import md_table, num
from experiments.tables.bench import (PAPER, Bench, Variant, _indices, run_variants, summarize,
                                      write_outputs, write_raw)

TABLE4_PROBLEMS = 64

TABLE4_VARIANTS = (Variant.of("cure", "cure"),
                   Variant.of("cure w/o branch 0", "cure", keep_branch0=False),
                   Variant.of("cure w/o resync", "cure", resync=False),
                   Variant.of("cure w/o both", "cure", keep_branch0=False, resync=False))


def table4(bench: Bench, problems: int = TABLE4_PROBLEMS,
           ablations: Sequence[Variant] = TABLE4_VARIANTS[1:]) -> dict:
  """Ablations on a fixed subset (the first `problems` prompts): branch 0 and resync."""
  idx = _indices(bench, problems)
  refs = [Variant.of("ar", "ar"), Variant.of("chain", "chain"), TABLE4_VARIANTS[0]]
  variants = refs + list(ablations)
  runs = {}
  for group, desc in ((list(ablations), "table 4 (ablations)"), (refs, "table 4")):
    runs.update(run_variants(bench, group, idx, desc))
    for v in group:  # kept at once: a later or resumed run reuses them (--reuse_raw)
      write_raw(bench, v.label, runs[v.label], idx)
  ar_tpot = summarize(runs["ar"])["tpot_ms"]
  chain_tpot = summarize(runs["chain"])["tpot_ms"]
  base = summarize(runs["cure"])
  rows = []
  for v in variants:
    s = summarize(runs[v.label], None if v.label == "ar" else runs["ar"])
    s.update(variant=v.label, speedup_vs_ar=ar_tpot / s["tpot_ms"],
             tpot_ratio_vs_chain=s["tpot_ms"] / chain_tpot,
             tau_change_vs_cure=s["tau"] / base["tau"] - 1.0 if base["tau"] else None)
    if v.label == "ar":
      s.update(mismatches_vs_ar=0)
    rows.append(s)
  payload = dict(problems=len(idx), rows=rows, paper=PAPER["table4"],
                 definitions=dict(tpot_ratio="TPOT / chain TPOT (same prompts, same run)",
                                  tau_change="τ / τ(cure) - 1"))
  md = [f"## Table 4: ablations on the first {len(idx)} prompts", "",
        md_table(["variant", "τ", "Δτ vs cure", "TPOT ms", "speedup vs ar",
                  "TPOT ratio vs chain", "nodes/iter", "repair wins", "τ after a repair win",
                  "τ after a branch-0 win", "≠ ar"],
                 [[r["variant"], num(r["tau"]),
                   num(None if r["tau_change_vs_cure"] is None
                       else 100 * r["tau_change_vs_cure"], "+.1f", "%"), num(r["tpot_ms"], ".2f"),
                   num(r["speedup_vs_ar"], ".3f", "×"), num(r["tpot_ratio_vs_chain"], ".3f"),
                   num(r["nodes_verified"], ".1f"),
                   f"{r['repair_wins']}/{r['iterations']}", num(r["tau_after_repair_win"]),
                   num(r["tau_after_branch0_win"]), f"{r['mismatches_vs_ar']}/{r['prompts']}"]
                  for r in rows]),
        "\nτ after a repair win: mean accepted length of the iteration that follows an iteration "
        "a repair path won (the drafter's context then holds the repair's features, or branch "
        "0's without resync).",
        "\nPaper (Qwen3-8B, 64-example subset): cure τ 6.826, speedup 2.708×, TPOT ratio 1.776; "
        "w/o branch 0: τ −5.7%, speedup 2.616×; w/o resync: τ 4.089 (−40.1%), TPOT ratio 2.642."]
  return write_outputs(bench, "table4", payload, "\n".join(md) + "\n")
