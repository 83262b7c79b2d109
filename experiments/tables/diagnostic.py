"""The margin diagnostic (the paper's motivation): does a low drafter margin mark where a chain
block is first rejected?

From a chain run: margin histograms, where the first rejection falls, how the lowest-margin
positions line up with it, and whether a repair there would pay; plus the cure run's gate
decisions. Figures as PNG when matplotlib is installed.
"""

from __future__ import annotations

from pathlib import Path

from cure_jax.analysis import diagnostics
from cure_jax.analysis.report import save_figure
from experiments.tables.bench import Bench, Variant, _indices, run_variants, write_outputs


def diagnostic(bench: Bench, tau: float | None = None) -> dict:
  """The margin diagnostic from a chain run (plus the cure run's gate decisions)."""
  idx = _indices(bench)
  tau = float(bench.config.cure.tau_margin if tau is None else tau)
  runs = run_variants(bench, [Variant.of("chain", "chain"), Variant.of("cure", "cure")], idx,
                      "diagnostic")
  k = bench.generators[bench.key(Variant.of("chain", "chain"))].block_size
  chain = diagnostics.block_records(runs["chain"], k)
  cure = diagnostics.block_records(runs["cure"], k)
  d = diagnostics.diagnose(chain, tau, cure_records=cure)
  notes = []
  if not d["margins_available"]:
    notes.append("the decoder's stats carry no `block_margins`: margin histograms and the "
                 "lowest-margin analysis are missing (only the cure gate's decisions are used)")
  out = Path(bench.results_dir)
  try:
    figures = diagnostics.plot(d, str(out / "diagnostic_margins.png"),
                               str(out / "diagnostic_first_rejection.png"), save_figure)
  except ImportError:
    figures = []
    notes.append("matplotlib is not installed: no PNG")
  d.update(prompts=len(idx), figures=figures, notes=notes)
  md = diagnostics.markdown(d) + "".join(f"\nNote: {n}\n" for n in notes)
  return write_outputs(bench, "diagnostic", d, md)
