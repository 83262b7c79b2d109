"""Table 1 of the paper: the decoding methods side by side on the same prompts, in one process.

ar (target only), ar_draft (a small AR drafter, when one is given), chain (DFlash) and cure:
τ, TPOT, speedup over ar, tokens/s, nodes per iteration, compile time, and whether every
output equals ar's tokens; per-prompt results, and each method's raw results under raw/.
"""

from __future__ import annotations

import numpy as np

from cure_jax.analysis.report import md_table, num
from experiments.tables.bench import (PAPER, Bench, Variant, _indices, compile_seconds,
                                      run_variants, summarize, write_outputs, write_raw)


def _table1_variants(bench: Bench) -> list[Variant]:
  vs = [Variant.of("ar", "ar")]
  if bench.ar_drafter is not None:
    vs.append(Variant.of("ar_draft", "ar_draft"))
  vs += [Variant.of("chain", "chain"), Variant.of("cure", "cure")]
  return vs


def table1(bench: Bench) -> dict:
  """Methods side by side on the same prompts in one process: TPOT, τ, speedup vs AR, and
  whether every output equals AR's tokens."""
  idx = _indices(bench)
  variants = _table1_variants(bench)
  runs = run_variants(bench, variants, idx, "table 1")
  ar = runs["ar"]
  rows = []
  for v in variants:
    s = summarize(runs[v.label], None if v.label == "ar" else ar)
    s.update(method=v.label, compile_s=compile_seconds(bench, v),
             speedup_vs_ar=summarize(ar)["tpot_ms"] / s["tpot_ms"] if s["tpot_ms"] else None)
    if v.label == "ar":
      s.update(mismatches_vs_ar=0, token_agreement_vs_ar=1.0)
    rows.append(s)
    write_raw(bench, f"{v.label}", runs[v.label], idx)
  per_prompt = []
  for j, i in enumerate(idx):
    row = dict(index=i, task_id=bench.rows[i].get("task_id"), prompt_tokens=len(bench.ids[i]))
    for v in variants:
      r = runs[v.label][j]
      row[v.label] = dict(tokens=len(r.output_ids), iterations=r.iterations,
                          tau=float(np.mean(r.accept_lengths)) if r.accept_lengths else 0.0,
                          tpot_ms=r.tpot_ms, equal_to_ar=r.output_ids == ar[j].output_ids)
    per_prompt.append(row)
  notes = []
  if bench.ar_drafter is None:
    notes.append(f"ar_draft skipped: {bench.ar_drafter_note or 'no AR drafter given'}")
  chain = next((r for r in rows if r["method"] == "chain"), None)
  cure = next((r for r in rows if r["method"] == "cure"), None)
  extra = {}
  if chain and cure and chain["tau"]:
    extra = dict(cure_tau_gain=cure["tau"] / chain["tau"] - 1.0,
                 cure_tpot_ratio_vs_chain=cure["tpot_ms"] / chain["tpot_ms"])
  payload = dict(prompts=len(idx), rows=rows, per_prompt=per_prompt, notes=notes, **extra,
                 paper=PAPER["table1_humaneval"])
  md = [f"## Table 1: methods on the same {len(idx)} prompts, one process "
        f"(max_new_tokens={bench.config.max_new_tokens}, {bench.config.dtype}, "
        f"batch {bench.config.batch_size}; TPOT = decode wall time / tokens after the first)", "",
        md_table(["method", "τ", "TPOT ms", "speedup vs ar", "tokens/s", "nodes/iter",
                  "≠ ar (prompts)", "compile s"],
                 [[r["method"], num(r["tau"]), num(r["tpot_ms"], ".2f"),
                   num(r["speedup_vs_ar"], ".2f", "×"), num(r["tokens_per_s"], ".1f"),
                   num(r["nodes_verified"], ".1f"), f"{r['mismatches_vs_ar']}/{r['prompts']}",
                   num(r["compile_s"], ".1f")] for r in rows])]
  if extra:
    md.append(f"\ncure vs chain: τ {100 * extra['cure_tau_gain']:+.1f}%, TPOT ratio "
              f"{extra['cure_tpot_ratio_vs_chain']:.3f} (paper, Qwen3-8B HumanEval: τ 7.165 → "
              f"7.641 (+6.6%), TPOT ratio 1.40–1.61, cure speedup 3.49×).")
  md += [f"\nNote: {n}" for n in notes]
  return write_outputs(bench, "table1", payload, "\n".join(md) + "\n")
