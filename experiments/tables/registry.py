"""The benchmark tables by name, as `experiments.benchmark --table` takes them.

Each table lives in its own module (experiments/tables/table1.py, table3.py, ...) on the shared
machinery of bench.py; `run_tables` maps the benchmark's flags onto their options.
"""

from __future__ import annotations

from experiments.tables import (cache_cost, diagnostic, floors, goodput, long_context, numerics,
                               peers, serving, sweep, table1, table3, table4, table5, trees)
from experiments.tables.bench import Bench

TABLES = {"1": table1.table1, "3": table3.table3, "4": table4.table4, "5": table5.table5,
          "diagnostic": diagnostic.diagnostic, "sweep": sweep.table_sweep,
          "peers": peers.table_peers, "trees": trees.table_trees,
          "goodput": goodput.table_goodput, "long_context": long_context.table_long_context,
          "cache_cost": cache_cost.table_cache_cost, "numerics": numerics.table_numerics,
          "serving": serving.table_serving, "floors": floors.table_floors}


def _options(name: str, kwargs: dict) -> dict:
  """The keyword arguments of table `name` from run_tables' (the benchmark's flags)."""
  if name == "3":
    return dict(execute=kwargs.get("execute", True))
  if name == "4":
    ablations = table4.TABLE4_VARIANTS[1:]
    chosen = kwargs.get("table4_ablations") or [a.label for a in ablations]
    return dict(problems=kwargs.get("table4_problems") or table4.TABLE4_PROBLEMS,
                ablations=[v for v in ablations if v.label in chosen])
  if name == "5":
    return dict(tau=kwargs.get("scorer_tau"))
  if name == "sweep":
    grid = sweep.SWEEP_GRID
    return dict(grid={f: grid[f] for f in kwargs.get("sweep_factors") or grid})
  if name == "trees":
    return dict(budgets=kwargs.get("trees_budgets") or trees.BUDGETS)
  if name == "long_context":
    return dict(contexts=tuple(kwargs.get("long_contexts") or long_context.CONTEXTS),
                windows=tuple(kwargs.get("long_windows") or long_context.WINDOWS))
  if name == "goodput":
    return dict(batch_sizes=tuple(kwargs.get("goodput_batches") or goodput.BATCH_SIZES),
                methods=tuple(kwargs.get("goodput_methods") or ()),
                rounds=kwargs.get("goodput_rounds") or goodput.ROUNDS)
  if name == "serving":
    out = {k: kwargs[f"serving_{k}"] for k in ("count", "concurrency", "slots", "steps",
                                                "transformers", "invariance_count",
                                                "fault_count", "tokens", "sections")
           if kwargs.get(f"serving_{k}") is not None}
    if kwargs.get("serving_runs"):
      out["runs"] = tuple(_run(r) for r in kwargs["serving_runs"])
    return out
  return {}


def _run(text: str) -> tuple[str, float]:
  """'method:temperature' -> (method, temperature)."""
  method, _, temperature = text.partition(":")
  try:
    return method, float(temperature)
  except ValueError:
    raise ValueError(f"--serving_runs: {text!r} is not method:temperature (e.g. cure:1)") from None


def run_tables(bench: Bench, which: str, **kwargs) -> dict:
  """Runs tables named in `which`: one of '1', '3', '4', '5', 'diagnostic', 'sweep', 'peers',
  'trees', 'goodput', 'long_context', 'cache_cost', a comma-separated list of them (decodes are
  shared), or 'all'."""
  names = list(TABLES) if which == "all" else [n.strip() for n in which.split(",")]
  bad = [n for n in names if n not in TABLES]
  if bad:
    raise ValueError(f"--table={which!r}: choose one of {', '.join(TABLES)} or all")
  return {n: TABLES[n](bench, **_options(n, kwargs)) for n in names}
