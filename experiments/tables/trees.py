"""The trees table: tree strategies on one block drafter, side by side, at equal node budgets.

chain (no tree), ddtree (best-first from the one pass, no second drafter pass), cure with the
paper's lowest-margin gate and with the earliest low-margin position, the hybrid (cure plus
best-first sibling leaves in the budget cure leaves free) and the hybrid under the online budget
(repair only while the efficiency model, fed this machine's measured costs, says it pays), at
v_max = 16 / 32 / 64. Per variant: τ, nodes, drafter passes, where the accepted tokens came
from (branch 0 / the main path, sibling leaves, re-drafted suffixes, bonus), measured TPOT, and
TPOT projected on the measured cost curve and on a flat GPU-like one. Every count is end to end
(decoded, not a counterfactual replay of traces).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cure_jax.methods.cure import Cure
from cure_jax.methods.hybrid import leaf_branch
from cure_jax import methods
from cure_jax.costs import efficiency
from cure_jax.analysis.report import md_table, num
from experiments.tables.bench import (Bench, Variant, _indices, compile_seconds, run_variants,
                                      summarize, write_outputs, write_raw)

BUDGETS = (16, 32, 64)


def online_costs(costs: dict, num_paths: int) -> dict:
  """The online budget's cost settings from measured costs (ms): C_d, the re-draft pass, and
  a least-squares line through the verification curve C_v(n)."""
  nodes = np.array(sorted(costs["verify_ms"]), np.float64)
  per_node, base = np.polyfit(nodes, [costs["verify_ms"][int(n)] for n in nodes], 1)
  draft = costs["draft_ms"]
  return dict(cost_draft=float(draft[1]), cost_redraft=float(draft.get(num_paths, draft[1])),
              cost_verify_base=float(max(base, 0.0)), cost_verify_per_node=float(max(per_node,
                                                                                      0.0)))


def strategies(budget: int, costs: dict, branch0_nodes: int) -> list[Variant]:
  """The tree variants at one node budget; the repair methods only where a repair fits beside
  branch 0 (root + max_depth nodes, never pruned): below that they decode exactly as chain."""
  out = [Variant.of(f"ddtree v{budget}", "ddtree", v_max=budget)]
  if budget > branch0_nodes:
    out += [Variant.of(f"cure margin v{budget}", "cure", v_max=budget, select="margin"),
            Variant.of(f"cure earliest v{budget}", "cure", v_max=budget, select="earliest"),
            Variant.of(f"hybrid v{budget}", "hybrid", v_max=budget, select="earliest"),
            Variant.of(f"hybrid online v{budget}", "hybrid", v_max=budget, select="earliest",
                       online=True, **costs)]
  return out


def token_sources(results: Sequence, method: str, leaf: int | None) -> dict:
  """Accepted tokens per iteration by where they came from: the main path (branch 0 alone),
  the extra tokens of winners off it (sibling leaves or one-pass siblings, re-drafted suffixes),
  and the bonus token. Their sum is τ up to truncation at max_new_tokens or a stop token.
  leaf: the hybrid's Tree.branch of sibling leaves."""
  stats = [s for r in results for s in r.stats]
  n = max(len(stats), 1)
  out = dict(main=sum(s["branch0_accepted"] for s in stats) / n, siblings=0.0, redrafted=0.0,
             bonus=len(stats) / n)
  for s in stats:
    gain, branch = max(s["repair_gain"], 0), s["winning_branch"]
    if branch <= 0:
      continue
    kind = "siblings" if method == "ddtree" or (method == "hybrid" and branch == leaf) else \
        "redrafted"
    out[kind] += gain / n
  return out


def table_trees(bench: Bench, budgets: Sequence[int] = BUDGETS, repeats: int = 5) -> dict:
  idx = _indices(bench)
  k = bench.drafter.cfg.block_size
  num_paths = min(int(bench.config.cure.beam_width),
                  int(bench.config.cure.max_repair_positions) * int(bench.config.cure.b_max))
  mean_prompt = int(np.mean([len(bench.ids[i]) for i in idx])) if idx else 64
  context = mean_prompt + int(bench.config.max_new_tokens) // 2
  costs = efficiency.measure(bench.target, bench.drafter, num_paths=num_paths, context=context,
                             feature_layers=bench.drafter.cfg.feature_layers, repeats=repeats)
  settings = online_costs(costs, num_paths)
  refs = [Variant.of("ar", "ar"), Variant.of("chain", "chain")]
  branch0 = 1 + min(int(bench.config.cure.max_depth), k - 1)
  variants = refs + [v for b in budgets if b >= k for v in strategies(b, settings, branch0)]
  runs = {}
  for v in variants:  # one at a time, kept at once: a resumed run reuses them (--reuse_raw)
    runs.update(run_variants(bench, [v], idx, f"trees: {v.label}"))
    write_raw(bench, v.label, runs[v.label], idx)
  curve, flat = costs["verify_ms"], efficiency.flat_curve(costs["verify_ms"])
  ar = summarize(runs["ar"])
  rows = []
  for v in variants:
    s = summarize(runs[v.label], None if v.label == "ar" else runs["ar"])
    gen = bench.generators[bench.key(v)]
    nodes = [st["nodes_verified"] for r in runs[v.label] for st in r.stats]
    repairs = s["gate_rate"] if isinstance(methods.get(v.method), Cure) else 0.0
    proj = {}
    for name, c, is_flat in (("cpu_curve", curve, False), ("flat", flat, True)):
      d_ms = efficiency.method_draft_ms(v.method, costs, repairs, num_paths, flat=is_flat)
      speedup = 1.0 if v.method == "ar" else efficiency.projected_speedup(s["tau"], nodes, d_ms, c)
      proj[f"projected_speedup_{name}"] = speedup
      proj[f"projected_tpot_ms_{name}"] = c[min(c)] / speedup  # AR's C_v(1) per token, sped up
    s.update(variant=v.label, method=v.method, v_max=gen.cure.v_max if gen.cure else None,
             drafter_passes=0.0 if v.method == "ar" else 1.0 + repairs,
             sources=token_sources(runs[v.label], v.method,
                                   leaf_branch(gen.cure) if gen.cure else None),
             measured_speedup_vs_ar=ar["tpot_ms"] / s["tpot_ms"],
             compile_s=compile_seconds(bench, v), **proj)
    if v.label == "ar":
      s.update(mismatches_vs_ar=0)
    rows.append(s)
  task_ids = [bench.rows[i].get("task_id") for i in idx]
  payload = dict(prompts=len(idx), task_ids=task_ids, budgets=list(budgets), costs=costs,
                 online_costs=settings, rows=rows)
  md = [f"## Tree strategies on {len(idx)} prompts ({task_ids[0]} … {task_ids[-1]}), "
        f"{bench.config.max_new_tokens} new tokens, {bench.config.dtype}, batch "
        f"{bench.config.batch_size}", "",
        md_table(["variant", "τ", "nodes/iter", "drafter passes", "main", "siblings",
                  "re-drafted", "bonus", "TPOT ms", "speedup (measured)",
                  "speedup (proj. CPU curve)", "speedup (proj. flat)", "≠ ar"],
                 [[r["variant"], num(r["tau"], ".3f"), num(r["nodes_verified"], ".1f"),
                   num(r["drafter_passes"], ".2f"), num(r["sources"]["main"], ".3f"),
                   num(r["sources"]["siblings"], ".3f"), num(r["sources"]["redrafted"], ".3f"),
                   num(r["sources"]["bonus"], ".2f"), num(r["tpot_ms"], ".1f"),
                   num(r["measured_speedup_vs_ar"], ".2f", "×"),
                   num(r["projected_speedup_cpu_curve"], ".2f", "×"),
                   num(r["projected_speedup_flat"], ".2f", "×"),
                   f"{r['mismatches_vs_ar']}/{r['prompts']}"] for r in rows]),
        "", f"cure and hybrid need v_max > {branch0} (branch 0's root + {branch0 - 1} nodes "
        "are never pruned); below that they decode exactly as chain and are not listed.",
        "main / siblings / re-drafted / bonus: accepted tokens per iteration from branch 0 "
        "alone, the extra of winners off it (ddtree: one-pass siblings and their subtrees; "
        "hybrid: sibling leaves) or re-drafted suffixes (cure, hybrid), and the bonus token.",
        f"Measured on {costs['device']} (context {context}): C_v(n) ms = " +
        ", ".join(f"{n}: {ms:.1f}" for n, ms in curve.items()) + "; C_d ms = " +
        ", ".join(f"A={a}: {ms:.1f}" for a, ms in costs["draft_ms"].items()) +
        f". Online budget costs: {', '.join(f'{n}={x:.3g}' for n, x in settings.items())}.",
        "Projected speedup = τ·C_v(1) / (C_d + mean C_v(n)); 'flat': C_v(n) = C_v(1) for "
        "n <= 64 (GPU-like), the drafter priced relative to the target at equal tokens. The "
        "online variant decides with this machine's costs; with batch > 1 a chain-only "
        "verification happens only when no sequence of the batch repairs."]
  return write_outputs(bench, "trees", payload, "\n".join(md) + "\n")
