"""Table 5 of the paper: the offline repair-utility scorer.

Trained on cure's per-iteration stats of the first half of the prompts, it ranks the gated
blocks of the second half by whether a repair adds tokens: precision, recall and extra-token
recall at each repair budget, beside random, lowest-margin, earliest and oracle rankings and
the paper's numbers.
"""

from __future__ import annotations

from typing import Sequence

from cure_jax.analysis import diagnostics, scorer
from experiments.tables.bench import (Bench, Variant, _indices, run_variants, write_outputs,
                                      write_raw)


def table5(bench: Bench, tau: float | None = None, kinds: Sequence[str] = ("logreg", "mlp"),
           steps: int = 400, seed: int = 0) -> dict:
  """The offline repair-utility scorer on cure's per-iteration stats: train on the first half
  of the prompts, rank the blocks of the second half."""
  idx = _indices(bench)
  tau = float(bench.config.cure.tau_margin if tau is None else tau)
  variant = Variant.of("cure" if tau == bench.config.cure.tau_margin else f"cure tau={tau:g}",
                       "cure", tau_margin=tau)
  runs = run_variants(bench, [variant], idx, "table 5")[variant.label]
  k = bench.generators[bench.key(variant)].block_size
  records = diagnostics.block_records(runs, k)
  result = scorer.evaluate(records, tau, num_prompts=len(idx), kinds=kinds, steps=steps,
                           seed=seed)
  result.update(prompts=len(idx), tau=tau, raw=write_raw(bench, f"table5_{variant.label}", runs,
                                                          idx))
  md = scorer.markdown(result)
  md += (f"\ncure tau_margin={tau:g} on {len(idx)} prompts (first half trains, second half "
         f"tests; the last iteration of each prompt is dropped).\n")
  return write_outputs(bench, "table5", result, md)
