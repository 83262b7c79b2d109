"""The draft-vocabulary table: what scoring only the N most frequent tokens saves and costs.

For each N (drafter.vocab; 0 = the whole vocabulary): C_d, one timed drafter pass with its head
(cure_jax/runtime/cost_curve.py), and τ / TPOT / ms per iteration of chain and ddtree on
held-out HumanEval problems beside target-only ar in the same run. A smaller N reads fewer head
rows; τ mostly falls (a token outside the subset is never drafted; but a subset's best token
can also hit where the full argmax missed, and a tree's alternatives change); every output must
equal ar's. The N head rows are gathered once per generate call, before the decoding loop
(decoding.decode), and C_d is timed the same way (cost_curve.draft_seconds), so it is the
pass's cost inside the loop.
"""

from __future__ import annotations

from cure_jax.analysis.report import md_table, num
from cure_jax.runtime import cost_curve
from experiments.tables.bench import (Bench, Variant, _generator, _indices, run_variants,
                                      summarize, write_outputs)

SIZES = (0, 16384, 8192, 4096, 2048)   # 0: the whole vocabulary
METHODS = ("chain", "ddtree")


def _label(method: str, n: int) -> str:
  return f"{method} N={n or 'full'}"


def _share(tokens: list[int], vocab: tuple[int, ...]) -> float:
  """The share of `tokens` the drafter could have proposed (all for the whole vocabulary)."""
  kept = set(vocab)
  return sum(t in kept for t in tokens) / max(len(tokens), 1) if vocab else 1.0


def draft_ms(bench: Bench, n: int, prompt: list[int]) -> float:
  """ms of one chain drafter pass (block, head, argmax) at draft vocabulary n, batch 1."""
  gen = _generator(bench, Variant.of(_label("chain", n), "chain", vocab=n))
  spec = gen.spec(gen.cache_len(len(prompt)))
  return 1000.0 * cost_curve.draft_seconds(gen.graphdef, gen.params, spec, 1)


def table_draft_vocab(bench: Bench, sizes=SIZES, name: str = "draft_vocab") -> dict:
  """C_d and τ per draft vocabulary size; writes <results>/<name>.json and .md."""
  idx = _indices(bench)
  variants = [Variant.of("ar", "ar")] + [Variant.of(_label(m, n), m, vocab=n)
                                         for n in sizes for m in METHODS]
  costs = {n: draft_ms(bench, n, bench.ids[idx[0]]) for n in sizes}
  runs = run_variants(bench, variants, idx, "draft vocabulary")
  ar_tokens = [t for r in runs["ar"] for t in r.output_ids]
  rows = []
  for v in variants[1:]:
    s = summarize(runs[v.label], runs["ar"])
    s.update(method=v.method, vocab=v.vocab, label=v.label, draft_ms=costs[v.vocab],
             iteration_ms=1000.0 * s["decode_s"] / max(s["iterations"], 1),
             ar_tokens_in_vocab=_share(ar_tokens, _generator(bench, v).draft_vocab))
    rows.append(s)
  ar = summarize(runs["ar"])
  payload = dict(sizes=list(sizes), problems=[bench.rows[i].get("task_id") for i in idx],
                 ar=ar, rows=rows, draft_ms=costs,
                 all_equal_to_ar=all(r["mismatches_vs_ar"] == 0 for r in rows))
  md = [f"## Draft vocabulary: the N most frequent tokens (HumanEval {idx[0]}-{idx[-1]}, "
        f"max_new_tokens={bench.config.max_new_tokens}, batch 1; ar TPOT "
        f"{num(ar['tpot_ms'], '.1f')} ms; C_d: one chain drafter pass with its head)", "",
        md_table(["N", "method", "C_d ms", "τ", "ms / iteration", "TPOT ms", "ar tokens in N",
                  "≠ ar"],
                 [[r["vocab"] or "full", r["method"], num(r["draft_ms"], ".1f"), num(r["tau"]),
                   num(r["iteration_ms"], ".1f"), num(r["tpot_ms"], ".1f"),
                   num(r["ar_tokens_in_vocab"], ".3f"), r["mismatches_vs_ar"]] for r in rows])]
  return write_outputs(bench, name, payload, "\n".join(md) + "\n")
