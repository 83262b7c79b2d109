"""The paper's tables on the configured target / drafter pair, one command per table.

  python -m experiments.benchmark --table=1 --num_prompts=20           # methods: TPOT, τ, speedup
  python -m experiments.benchmark --table=3                             # pass@1 (HumanEval tests)
  python -m experiments.benchmark --table=4                             # ablations, 64 problems
  python -m experiments.benchmark --table=5 --scorer_tau=2.0            # offline repair scorer
  python -m experiments.benchmark --table=diagnostic                    # margin diagnostic
  python -m experiments.benchmark --table=sweep --num_prompts=16        # grids + cost model
  python -m experiments.benchmark --table=sweep --sweep_factors=select  # the gate rules only
  python -m experiments.benchmark --table=peers --num_prompts=8         # transformers, dflash
  python -m experiments.benchmark --table=trees --num_prompts=20        # tree strategies
  python -m experiments.benchmark --table=goodput --num_prompts=8       # auto vs every budget
  python -m experiments.benchmark --table=floors --num_prompts=1        # loop parts vs floors
  python -m experiments.benchmark --table=long_context                  # 1k/4k/8k context, windows
  python -m experiments.benchmark --table=serving                       # server under load
  python -m experiments.benchmark --table=all --results=results/
  python -m experiments.benchmark --table=1,3,diagnostic,5 --config.batch_size=8 --num_prompts=0

Default config: configs/smollm2_135m.py (SmolLM2-135M target, its DFlash drafter, HumanEval).
Every config field is a flag (--config.max_new_tokens=64, --config.cure.tau_margin=2.0, ...).
Writes results/<table>.json and .md (and PNGs) atomically and prints the markdown. Table 3
executes model-written code in a resource-limited subprocess (cure_jax/analysis/humaneval_exec.py);
pass --noexecute to skip that.
"""

from pathlib import Path

from absl import app, flags

from cure_jax.runtime import errors, pipeline
from experiments.tables import registry, sweep, table4
from experiments.tables.bench import from_config

_CONFIG = errors.config_flag("configs/smollm2_135m.py", "ml_collections config file")
_TABLE = flags.DEFINE_string("table", "1", f"table to run: {', '.join(registry.TABLES)}, a "
                             "comma-separated list (sharing decodes) or all")
_RESULTS = flags.DEFINE_string("results", "results", "output folder")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", None, "first N prompts (default: "
                                    "config.num_prompts, 0 = all)")
_PROMPTS = flags.DEFINE_string("prompts", None, "JSONL prompt file (default: config.prompts, "
                               "else HumanEval's 164 problems)")
_AR_DRAFTER = flags.DEFINE_string("ar_drafter", "embedded:smollm2_ar_drafter",
                                  "AR drafter (small Qwen3/Llama) for the ar_draft baseline; "
                                  "'' to skip")
_SCORER_TAU = flags.DEFINE_float("scorer_tau", None, "table 5: gate threshold of the cure run "
                                 "(default config.cure.tau_margin)")
_SWEEP_FACTORS = flags.DEFINE_multi_enum("sweep_factors", None, list(sweep.SWEEP_GRID),
                                         "sweep: the factors to vary (default: all)")
_TABLE4_PROBLEMS = flags.DEFINE_integer("table4_problems", table4.TABLE4_PROBLEMS,
                                        "table 4: the first N problems")
_TABLE4_ABLATIONS = flags.DEFINE_multi_enum(
    "table4_ablations", None, [v.label for v in table4.TABLE4_VARIANTS[1:]],
    "table 4: the ablations to run (default: all)")
_TREES_BUDGETS = flags.DEFINE_multi_integer("trees_budgets", [16, 32, 64],
                                           "trees: node budgets v_max to compare")
_GOODPUT_BATCHES = flags.DEFINE_multi_integer("goodput_batches", [1, 4, 16],
                                             "goodput: batch sizes, one sweep each")
_GOODPUT_ROUNDS = flags.DEFINE_integer("goodput_rounds", 3, "goodput: timed rounds per batch size "
                                       "(medians reported)")
_GOODPUT_METHODS = flags.DEFINE_list("goodput_methods", [], "goodput: only these variants "
                                     "(labels, e.g. 'ar,auto,ddtree v16'; default: all)")
_LONG_CONTEXTS = flags.DEFINE_multi_integer("long_contexts", None, "long_context: context "
                                           "lengths in tokens (default 1024, 4096, 8192)")
_LONG_WINDOWS = flags.DEFINE_multi_integer("long_windows", None, "long_context: drafter windows "
                                          "(0 = the whole context; default 0, 1024, 256)")
_REUSE_RAW = flags.DEFINE_string("reuse_raw", None, "raw/ folder of an earlier run with the same "
                                 "config: variants found there are not decoded again")
_SERVING = {k: f(f"serving_{k}", d, h) for k, f, d, h in [
    ("count", flags.DEFINE_integer, 64, "serving: requests in the throughput workload"),
    ("concurrency", flags.DEFINE_integer, 8, "serving: clients in flight at once"),
    ("slots", flags.DEFINE_integer, 8, "serving: the server's slots"),
    ("steps", flags.DEFINE_integer, 8, "serving: iterations per compiled chunk"),
    ("transformers", flags.DEFINE_bool, True, "serving: also transformers serve"),
    ("invariance_count", flags.DEFINE_integer, 48, "serving: requests per invariance run"),
    ("fault_count", flags.DEFINE_integer, 400, "serving: requests of the fault run"),
    ("tokens", flags.DEFINE_integer, 32, "serving: max_tokens of invariance and fault requests"),
    ("runs", flags.DEFINE_list, None, "serving: invariance runs as method:temperature "
     "(default: ar, chain, ddtree, cure, auto at 0; chain, ddtree, cure at 1)"),
    ("sections", flags.DEFINE_list, None, "serving: overhead, throughput, invariance, faults "
     "(default: all)")]}
_EXECUTE = flags.DEFINE_bool("execute", True, "table 3: run the HumanEval tests")
_WARMUP = flags.DEFINE_bool("warmup", True, "decode one prompt per variant before timing")
_PROGRESS = flags.DEFINE_bool("progress", True, "tqdm progress bars")


def _ar_drafter(config, target):
  """(model, note): the AR drafter if its checkpoint exists, else (None, why)."""
  path = _AR_DRAFTER.value
  if not path:
    return None, "--ar_drafter=''"
  sub = config.copy_and_resolve_references()
  with sub.unlocked():
    sub.method = "ar_draft"
    sub.drafter.path = path
  try:
    pipeline.resolve_paths(sub)
  except ValueError as e:
    return None, str(e)
  if not (Path(sub.drafter.path) / "config.json").is_file():
    return None, f"no AR drafter checkpoint at {sub.drafter.path}"
  return pipeline.load_drafter(sub, target), ""


def main(argv):
  del argv
  bad = [n for n in _TABLE.value.split(",") if n.strip() not in (*registry.TABLES, "all")]
  if bad:
    raise app.UsageError(f"--table={_TABLE.value!r}: unknown {bad}; choose from "
                         f"{', '.join(registry.TABLES)} (comma-separated) or all")
  config = _CONFIG.value
  with config.unlocked():
    if _NUM_PROMPTS.value is not None:
      config.num_prompts = _NUM_PROMPTS.value
    if _PROMPTS.value is not None:
      config.prompts = _PROMPTS.value
  bench = from_config(config, results_dir=_RESULTS.value, warmup=_WARMUP.value,
                      progress=_PROGRESS.value, reuse_raw=_REUSE_RAW.value)
  bench.ar_drafter, bench.ar_drafter_note = _ar_drafter(config, bench.target)
  if Path(config.target.path, "config.json").is_file():
    bench.target_dir = config.target.path
  if Path(config.drafter.path, "config.json").is_file():
    bench.drafter_dir = config.drafter.path
  registry.run_tables(bench, _TABLE.value, execute=_EXECUTE.value, scorer_tau=_SCORER_TAU.value,
                    sweep_factors=_SWEEP_FACTORS.value, table4_problems=_TABLE4_PROBLEMS.value,
                    table4_ablations=_TABLE4_ABLATIONS.value, trees_budgets=_TREES_BUDGETS.value,
                    goodput_batches=_GOODPUT_BATCHES.value,
                    goodput_methods=_GOODPUT_METHODS.value,
                    goodput_rounds=_GOODPUT_ROUNDS.value,
                    long_contexts=_LONG_CONTEXTS.value, long_windows=_LONG_WINDOWS.value,
                    **{f"serving_{k}": f.value for k, f in _SERVING.items()})
  print(f"results in {Path(_RESULTS.value).resolve()}")


if __name__ == "__main__":
  errors.run(main)
