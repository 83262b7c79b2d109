"""The benchmark tables: decode the variants a table needs, assemble its rows, render markdown,
and write JSON + markdown (+ PNG) atomically under the results folder.

Every table function takes a `Bench` (models, prompts, config, results folder) and returns its
JSON-ready payload; decoded results are cached on the Bench by (method, cure settings, prompt),
so `--table=all` decodes each variant once and every table compares runs of the same process.
Within a table the variants are interleaved prompt by prompt (all variants decode prompt i
before any decodes prompt i+1), so a change in machine load hits every method alike.

Measured: τ (mean emitted tokens per iteration, bonus included), TPOT (decode wall time /
tokens generated after the first, compile and prefill excluded), speedups against target-only
AR of the same run, node counts, token equality with AR, pass@1. Projected (sweep table only,
labelled as such): speedups from the paper's efficiency model on measured cost curves.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from cure_jax import diagnostics, pipeline, scorer, viz
from cure_jax.drafting import TREE_METHODS
from cure_jax.generation import Result
from experiments import cost_model
from experiments.humaneval_exec import check_programs, extract_program
from experiments.report import environment, jsonable, md_table, num, save_figure, write_text

TABLES = ("1", "3", "4", "5", "diagnostic", "sweep", "peers", "trees")
TABLE4_PROBLEMS = 64
SWEEP_GRID = dict(tau_margin=(0.5, 1.0, 2.0, 4.0), v_max=(32, 48, 64), b_max=(2, 3, 5),
                  select=("margin", "earliest", "expected_gain"))

# The paper's numbers (Qwen3-8B, bf16, one GPU), for context in the markdown only.
PAPER = dict(
    table1_humaneval=dict(ar_tpot_ms=30.430, chain_tau=7.165, cure_tau=7.641, cure_tpot_ms=8.718,
                          cure_speedup=3.49, naive_sd_tpot_ms=42.203),
    table3_pass1=dict(humaneval=0.799, mbpp=0.711, lcb_lite=0.234),
    table4=dict(cure=dict(tau=6.826, speedup=2.708, tpot_ratio=1.776),
                no_branch0=dict(tau_change=-0.057, speedup=2.616),
                no_resync=dict(tau=4.089, tau_change=-0.401, tpot_ratio=2.642)),
)


# ----------------------------------------------------------------------------- decoding

@dataclasses.dataclass(frozen=True)
class Variant:
  """A decoding method with cure overrides on top of the config's cure settings."""

  label: str
  method: str
  cure: tuple[tuple[str, Any], ...] = ()

  @classmethod
  def of(cls, label: str, method: str, **cure) -> "Variant":
    return cls(label, method, tuple(sorted(cure.items())))


@dataclasses.dataclass
class Bench:
  """Everything the tables share: models, prompts, config, where results go."""

  config: Any                          # ml_collections.ConfigDict (paths resolved)
  target: Any
  drafter: Any
  rows: list[dict]                     # prompt rows (prompt text, task_id, test, entry_point...)
  ids: list[list[int]]                 # their token ids
  tokenizer: Any = None
  stops: tuple[int, ...] = ()
  results_dir: str = "results"
  ar_drafter: Any = None
  ar_drafter_note: str = ""            # why ar_draft is absent, when it is
  target_dir: str | None = None        # HF directories, for the peers table
  drafter_dir: str | None = None
  warmup: bool = True                  # decode the first prompt once per variant before timing
  progress: bool = True
  echo: Callable[[str], None] = print
  reuse_raw: str | None = None         # a raw/ folder of an earlier run with the same config
  runs: dict = dataclasses.field(default_factory=dict)        # cache key -> {index: Result}
  generators: dict = dataclasses.field(default_factory=dict)  # cache key -> Generator

  def cure_settings(self, variant: Variant) -> dict:
    c = dict(self.config.cure)
    c.update(dict(variant.cure))
    return c

  def key(self, variant: Variant) -> tuple:
    if variant.method not in TREE_METHODS:
      return (variant.method,)
    return (variant.method,) + tuple(sorted(self.cure_settings(variant).items()))


def _generator(bench: Bench, variant: Variant):
  key = bench.key(variant)
  if key not in bench.generators:
    cfg = copy.deepcopy(bench.config)
    with cfg.unlocked():
      cfg.cure.update(dict(variant.cure))
      if variant.method == "ar_draft":
        cfg.drafter.block_size = 0  # gamma + 1
    drafter = bench.ar_drafter if variant.method == "ar_draft" else bench.drafter
    bench.generators[key] = pipeline.make_generator(cfg, bench.target, drafter, bench.stops,
                                                    variant.method)
  return bench.generators[key]


def _progress(iterable, desc: str, bench: Bench):
  from tqdm import tqdm
  return tqdm(iterable, desc=desc, disable=not bench.progress, file=sys.stderr, leave=False)


def run_variants(bench: Bench, variants: Sequence[Variant], indices: Sequence[int],
                 desc: str = "decode") -> dict[str, list]:
  """Decodes every variant on every prompt index (interleaved by prompt); cached per Bench.

  Returns label -> list of Results in `indices` order.
  """
  for v in variants:
    _load_raw(bench, v)
  todo = list({bench.key(v): v for v in variants
               if any(i not in bench.runs.get(bench.key(v), {}) for i in indices)}.values())
  missing = sorted({i for v in todo for i in indices if i not in bench.runs.get(bench.key(v), {})})
  batches = prompt_batches(bench, missing)
  for v in todo:
    gen = _generator(bench, v)
    if bench.warmup and batches:  # compile + one untimed decode
      gen.generate([bench.ids[i] for i in batches[0]])
  for chunk in _progress(batches, desc, bench):
    for v in todo:
      store = bench.runs.setdefault(bench.key(v), {})
      chunk_v = [i for i in chunk if i not in store]
      if chunk_v:
        results = _generator(bench, v).generate([bench.ids[i] for i in chunk_v])
        for i, r in zip(chunk_v, results):  # each sequence owns its share of the batch's time
          store[i] = dataclasses.replace(r, decode_s=r.decode_s / len(chunk_v))
  return {v.label: [bench.runs[bench.key(v)][i] for i in indices] for v in variants}


def _load_raw(bench: Bench, variant: Variant) -> None:
  """Takes the variant's per-prompt results from bench.reuse_raw/<label>.json when it exists
  (written by `write_raw` in an earlier run of the same config), so that only the rest decode."""
  if not bench.reuse_raw:
    return
  if not Path(bench.reuse_raw).is_dir():
    raise FileNotFoundError(f"--reuse_raw={bench.reuse_raw} is not a folder: pass the raw/ folder "
                            "of an earlier benchmark run (results/<run>/raw)")
  path = Path(bench.reuse_raw) / f"{_raw_name(variant.label)}.json"
  if not path.is_file():
    return
  fields = {f.name for f in dataclasses.fields(Result)}
  store = bench.runs.setdefault(bench.key(variant), {})
  for row in json.loads(path.read_text()):
    store.setdefault(row["prompt_index"], Result(**{k: row[k] for k in fields}))


def prompt_batches(bench: Bench, indices: Sequence[int]) -> list[list[int]]:
  """config.batch_size prompts per decode call, grouped by length so that a batch pads little
  (batch 1: the given order)."""
  size = max(int(bench.config.get("batch_size", 1)), 1)
  order = sorted(indices, key=lambda i: len(bench.ids[i])) if size > 1 else list(indices)
  return [order[j:j + size] for j in range(0, len(order), size)]


def compile_seconds(bench: Bench, variant: Variant) -> float:
  gen = bench.generators.get(bench.key(variant))
  return float(sum(gen.compile_s.values())) if gen is not None else 0.0


# ----------------------------------------------------------------------------- summaries

def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def summarize(results: Sequence, reference: Sequence | None = None) -> dict:
  """τ, TPOT, tokens/s, nodes, gate statistics; equality with `reference` (AR) when given."""
  lens = [a for r in results for a in r.accept_lengths]
  stats = [s for r in results for s in r.stats]
  tokens_after_first = sum(max(len(r.output_ids) - 1, 0) for r in results)
  decode_s = sum(r.decode_s for r in results)
  out = dict(prompts=len(results), generated_tokens=sum(len(r.output_ids) for r in results),
             iterations=len(lens), tau=float(np.mean(lens)) if lens else 0.0,
             tpot_ms=1000.0 * decode_s / max(tokens_after_first, 1),
             tpot_ms_prompt_mean=float(np.mean([r.tpot_ms for r in results])) if results else 0.0,
             tokens_per_s=tokens_after_first / max(decode_s, 1e-9), decode_s=decode_s,
             nodes_verified=float(np.mean([s["nodes_verified"] for s in stats])) if stats else 0.0,
             gate_rate=float(np.mean([bool(s.get("ufp_positions")) for s in stats])) if stats
             else 0.0,
             repair_wins=int(sum(s.get("winning_branch", 0) > 0 for s in stats)),
             repair_gain_tokens=int(sum(max(s.get("repair_gain", 0), 0) for s in stats)))
  out.update(after_wins(results))
  if reference is not None:
    same = [r.output_ids == a.output_ids for r, a in zip(results, reference)]
    out["mismatches_vs_ar"] = int(len(same) - sum(same))
    out["mismatched_prompts"] = [i for i, s in enumerate(same) if not s]
    out["token_agreement_vs_ar"] = float(np.mean([
        common_prefix(r.output_ids, a.output_ids) / max(len(r.output_ids), len(a.output_ids), 1)
        for r, a in zip(results, reference)])) if results else 0.0
  return out


def after_wins(results: Sequence) -> dict:
  """Mean accepted length (τ) of the iteration right after a repair won and of one right after
  branch 0 won. A drafter left with stale context after a winning repair (no resync) shows up
  as a drop in the first; its weight in the overall τ is the share of repair wins."""
  after = {True: [], False: []}
  for r in results:
    for prev, nxt in zip(r.stats, r.stats[1:]):
      after[prev.get("winning_branch", 0) > 0].append(nxt["accept_lengths"])
  return dict(iterations_after_repair_win=len(after[True]),
              tau_after_repair_win=float(np.mean(after[True])) if after[True] else None,
              tau_after_branch0_win=float(np.mean(after[False])) if after[False] else None)


def write_outputs(bench: Bench, name: str, payload: dict, md: str) -> dict:
  """results/<name>.json and results/<name>.md (atomic); prints the markdown."""
  out = Path(bench.results_dir)
  payload = dict(payload, table=name, environment=environment(),
                 config=bench.config.to_dict())
  pipeline.write_json(str(out / f"{name}.json"), jsonable(payload))
  write_text(out / f"{name}.md", md)
  bench.echo(md)
  return payload


def _raw_name(label: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)


def write_raw(bench: Bench, label: str, results: Sequence, indices: Sequence[int]) -> str:
  """Per-prompt results (ids, accept lengths, per-iteration stats) of one variant."""
  path = Path(bench.results_dir) / "raw" / f"{_raw_name(label)}.json"
  rows = []
  for i, r in zip(indices, results):
    row = dataclasses.asdict(r)
    row["prompt_index"] = i
    row["task_id"] = bench.rows[i].get("task_id")
    rows.append(row)
  pipeline.write_json(str(path), jsonable(rows))
  return str(path)


def _indices(bench: Bench, limit: int | None = None) -> list[int]:
  n = len(bench.ids)
  return list(range(n if limit is None else min(limit, n)))


# ----------------------------------------------------------------------------- table 1

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


# ----------------------------------------------------------------------------- table 3

def completion_text(bench: Bench, ids: Sequence[int]) -> str:
  if bench.tokenizer is None:
    return ""
  return bench.tokenizer.decode(list(ids), skip_special_tokens=True)


def table3(bench: Bench, timeout: float = 10.0, execute: bool = True) -> dict:
  """pass@1 of every method's completions on the prompts that carry tests, with τ, TPOT and
  token-level agreement with AR."""
  idx = [i for i in _indices(bench) if "test" in bench.rows[i] and "entry_point" in bench.rows[i]]
  notes = []
  if not idx:
    notes.append("no prompt carries `test` and `entry_point` (HumanEval rows do): pass@1 skipped")
  variants = _table1_variants(bench)
  runs = run_variants(bench, variants, idx, "table 3") if idx else {}
  if bench.tokenizer is None:
    notes.append("no tokenizer: completions cannot be decoded to text, so every test fails")
  rows, completions = [], []
  ar = runs.get("ar")
  for v in variants if idx else []:
    texts = [completion_text(bench, r.output_ids) for r in runs[v.label]]
    programs = [extract_program(bench.rows[i], t) for i, t in zip(idx, texts)]
    verdicts = (check_programs(programs, timeout) if execute
                else [dict(passed=None, status="not executed")] * len(programs))
    s = summarize(runs[v.label], None if v.label == "ar" else ar)
    passes = sum(bool(x["passed"]) for x in verdicts)
    rows.append(dict(method=v.label, problems=len(idx), passed=passes if execute else None,
                     pass_at_1=passes / len(idx) if execute else None, tau=s["tau"],
                     tpot_ms=s["tpot_ms"],
                     exact_match_vs_ar=len(idx) - s.get("mismatches_vs_ar", 0),
                     token_agreement_vs_ar=s.get("token_agreement_vs_ar", 1.0)))
    for i, t, x in zip(idx, texts, verdicts):
      completions.append(dict(method=v.label, index=i, task_id=bench.rows[i].get("task_id"),
                              completion=t, **x))
  if not execute:
    notes.append("tests not executed (--noexecute)")
  payload = dict(problems=len(idx), rows=rows, completions=completions, notes=notes,
                 timeout_s=timeout, paper=PAPER["table3_pass1"])
  md = [f"## Table 3: pass@1 on {len(idx)} problems (greedy, one sample)", "",
        md_table(["method", "pass@1", "passed", "τ", "TPOT ms", "= ar (prompts)",
                  "token agreement vs ar"],
                 [[r["method"], num(r["pass_at_1"] and 100 * r["pass_at_1"], ".1f", "%")
                   if r["pass_at_1"] is not None else "n/a",
                   f"{r['passed']}/{r['problems']}" if r["passed"] is not None else "n/a",
                   num(r["tau"]), num(r["tpot_ms"], ".2f"),
                   f"{r['exact_match_vs_ar']}/{r['problems']}",
                   num(100 * r["token_agreement_vs_ar"], ".1f", "%")] for r in rows]),
        "\nPaper (Qwen3-8B): pass@1 equal to target AR on HumanEval 79.9%, MBPP 71.1%, "
        "LCB-lite 23.4%."]
  md += [f"\nNote: {n}" for n in notes]
  return write_outputs(bench, "table3", payload, "\n".join(md) + "\n")


# ----------------------------------------------------------------------------- table 4

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


# ----------------------------------------------------------------------------- table 5

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


# ----------------------------------------------------------------------------- diagnostic

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


# ----------------------------------------------------------------------------- sweep

def sweep_variants(base_cure: dict, grid: dict = SWEEP_GRID) -> list[Variant]:
  """One factor at a time around the config's cure settings."""
  out = []
  for name, values in grid.items():
    for value in values:
      tag = " (base)" if base_cure.get(name) == value else ""
      out.append(Variant.of(f"{name}={value}{tag}", "cure", **{name: value}))
  return out


def table_sweep(bench: Bench, grid: dict = SWEEP_GRID, cost_context: int | None = None,
                repeats: int = 5, nodes: Sequence[int] = cost_model.NODES) -> dict:
  """tau_margin / v_max / b_max grids and the three gate rules: τ, nodes, measured TPOT; plus
  projected speedups from the measured verification cost curve and a GPU-like flat one."""
  idx = _indices(bench)
  base = dict(bench.config.cure)
  k = bench.drafter.cfg.block_size
  def allowed(name, value):  # drop settings the config cannot take
    if name == "v_max":
      return value >= min(base["max_depth"], k - 1) + 1
    if name == "b_max":
      return value >= base["b_min"]
    return True

  grid = {n: tuple(v for v in vals if allowed(n, v)) for n, vals in grid.items()}
  cure_variants = sweep_variants(base, grid)
  seen = {}
  for v in cure_variants:  # the base settings appear once per factor: decode once
    seen.setdefault(bench.key(v), v)
  refs = [Variant.of("ar", "ar"), Variant.of("chain", "chain")]
  runs = run_variants(bench, refs + list(seen.values()), idx, "sweep")
  for v in cure_variants:
    runs.setdefault(v.label, runs[seen[bench.key(v)].label])
  mean_prompt = int(np.mean([len(bench.ids[i]) for i in idx])) if idx else 64
  context = cost_context or mean_prompt + int(bench.config.max_new_tokens) // 2
  num_paths = max(bench.generators[bench.key(v)].cure.num_paths for v in seen.values())
  costs = cost_model.measure(bench.target, bench.drafter, num_paths=num_paths, context=context,
                             nodes=nodes, feature_layers=bench.drafter.cfg.feature_layers,
                             repeats=repeats)
  curve = costs["verify_ms"]
  flat = cost_model.flat_curve(curve)
  ar_tpot = summarize(runs["ar"])["tpot_ms"]
  rows = []
  for v in refs + cure_variants:
    res = runs[v.label]
    s = summarize(res, None if v.label == "ar" else runs["ar"])
    nodes = [st["nodes_verified"] for r in res for st in r.stats]
    if v.method == "cure":
      paths = bench.generators[bench.key(v)].cure.num_paths
      costs["draft_ms"].setdefault(paths, cost_model.draft_cost(
          bench.target, bench.drafter, (paths,), context, repeats)[paths])
    else:
      paths = 1
    proj = {}
    for name, c, is_flat in (("projected_speedup_cpu_curve", curve, False),
                             ("projected_speedup_flat_curve", flat, True)):
      d_ms = cost_model.method_draft_ms(v.method, costs, s["gate_rate"], paths, flat=is_flat)
      proj[name] = (1.0 if v.method == "ar" else
                    cost_model.projected_speedup(s["tau"], nodes, d_ms, c))
    s.update(variant=v.label, measured_speedup_vs_ar=ar_tpot / s["tpot_ms"],
             cure=bench.cure_settings(v) if v.method == "cure" else None, **proj)
    if v.label == "ar":
      s.update(mismatches_vs_ar=0)
    rows.append(s)
  notes = ["measured: τ, nodes/iter, TPOT, measured speedup (this machine, same run)",
           "projected: speedup = τ·C_v(1) / (C_d + mean_t C_v(n_t)) from the measured cost "
           "curve (above); 'flat' assumes a GPU-like C_v(n) = C_v(1) for n <= 64 with the "
           "drafter priced at its measured cost relative to the target at equal token count"]
  # Budget tuning: the cure setting the efficiency model favours on each cost curve.
  best = {name: max((r for r in rows if r["cure"]), key=lambda r: r[name])
          for name in ("projected_speedup_cpu_curve", "projected_speedup_flat_curve")}
  tuned = {name: dict(variant=r["variant"], cure=r["cure"], projected_speedup=r[name])
           for name, r in best.items()}
  payload = dict(prompts=len(idx), grid={n: list(v) for n, v in grid.items()}, rows=rows,
                 costs=costs, notes=notes, tuned=tuned)
  out = Path(bench.results_dir)
  try:
    payload["figure"] = _plot_sweep(rows, curve, str(out / "sweep.png"))
  except ImportError:
    notes.append("matplotlib is not installed: no PNG")
  md = [f"## Sweep on {len(idx)} prompts (one factor at a time around the config)", "",
        md_table(["variant", "τ", "nodes/iter", "gate rate", "TPOT ms", "speedup (measured)",
                  "speedup (projected, CPU curve)", "speedup (projected, flat GPU-like)", "≠ ar"],
                 [[r["variant"], num(r["tau"]), num(r["nodes_verified"], ".1f"),
                   num(100 * r["gate_rate"], ".0f", "%"), num(r["tpot_ms"], ".2f"),
                   num(r["measured_speedup_vs_ar"], ".2f", "×"),
                   num(r["projected_speedup_cpu_curve"], ".2f", "×"),
                   num(r["projected_speedup_flat_curve"], ".2f", "×"),
                   f"{r['mismatches_vs_ar']}/{r['prompts']}"] for r in rows]),
        "", f"Measured cost curve on {costs['device']} (context {context} tokens): C_v(n) ms = " +
        ", ".join(f"{n}: {ms:.2f}" for n, ms in curve.items()) +
        "; C_d (DFlash pass, A blocks) ms = " +
        ", ".join(f"A={a}: {ms:.2f}" for a, ms in costs["draft_ms"].items()) + ".", "",
        "Budget tuning (argmax of the efficiency model over the sweep): " + "; ".join(
            f"{name.replace('projected_speedup_', '').replace('_', ' ')}: {t['variant']} "
            f"({t['projected_speedup']:.2f}×)" for name, t in tuned.items()) + "."]
  md += [f"\nNote: {n}" for n in notes]
  return write_outputs(bench, "sweep", payload, "\n".join(md) + "\n")


def _plot_sweep(rows: list[dict], curve: dict, path: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  ax = axes[0]
  for r in rows:
    ax.scatter(r["nodes_verified"], r["tau"])
    ax.annotate(r["variant"], (r["nodes_verified"], r["tau"]), fontsize=7)
  ax.set_xlabel("nodes verified per iteration (measured)")
  ax.set_ylabel("τ (measured)")
  ax.set_title("acceptance vs tree size")
  ax = axes[1]
  labels = [r["variant"] for r in rows]
  x = np.arange(len(rows))
  w = 0.27
  ax.bar(x - w, [r["measured_speedup_vs_ar"] for r in rows], w, label="measured")
  ax.bar(x, [r["projected_speedup_cpu_curve"] for r in rows], w, label="projected (CPU curve)")
  ax.bar(x + w, [r["projected_speedup_flat_curve"] for r in rows], w,
         label="projected (flat GPU-like)")
  ax.set_xticks(x, labels, rotation=70, fontsize=7)
  ax.set_ylabel("speedup vs ar")
  ax.axhline(1.0, color="k", lw=0.5)
  ax.legend(fontsize=7)
  viz.draw_cost_curve(axes[2], curve)
  fig.tight_layout()
  save_figure(fig, path)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------- peers

def table_peers(bench: Bench) -> dict:
  """transformers `generate` (torch CPU float32) and the `dflash` wheel's chain decoding on the
  same weights and prompts, beside ours, in the same run."""
  idx = _indices(bench)
  ours_v = [Variant.of("ar", "ar"), Variant.of("chain", "chain"), Variant.of("cure", "cure")]
  runs = run_variants(bench, ours_v, idx, "peers (ours)")
  sums = {v.label: summarize(runs[v.label], None if v.label == "ar" else runs["ar"])
          for v in ours_v}
  rows = []
  for v in ours_v:
    s = sums[v.label]
    rows.append(dict(system=f"cure_jax {v.label}", tau=s["tau"] if v.label != "ar" else 1.0,
                     tokens_per_s=s["tokens_per_s"], tpot_ms=s["tpot_ms"],
                     equal_to_our_ar=len(idx) - s.get("mismatches_vs_ar", 0)))
  notes = []
  if not bench.target_dir:
    notes.append("no HF target directory: transformers and dflash peers skipped")
  else:
    try:
      rows += _peer_rows(bench, idx, runs)
    except ImportError as e:
      notes.append(f"peers skipped: {e}")
  phases = {v.label: cost_model.phase_ms(_generator(bench, v), bench.ids[idx[0]])
            for v in ours_v}
  peaks = cost_model.machine_peaks()
  cure = _generator(bench, ours_v[2]).cure
  gate = sums["cure"]["gate_rate"]
  floors = cost_model.floors_ms(bench.target, bench.drafter, peaks,
                                {m: max(s["nodes_verified"], 1.0) for m, s in sums.items()},
                                repair_paths=gate * cure.num_paths, repair_rows=gate * cure.v_max)
  iteration = {m: s["tpot_ms"] * max(s["tau"], 1.0) for m, s in sums.items()}
  ar_bound = _ar_bound(rows, floors["ar"]["verify_ms"], peaks)
  payload = dict(prompts=len(idx), rows=rows, notes=notes, phases_ms=phases, peaks=peaks,
                 floors_ms=floors, iteration_ms=iteration, ar_vs_transformers=ar_bound)
  md = [f"## Peers on {len(idx)} prompts (same weights, same run, CPU)", "",
        md_table(["system", "τ", "tokens/s", "TPOT ms", "= our ar (prompts)"],
                 [[r["system"], num(r["tau"]), num(r["tokens_per_s"], ".1f"),
                   num(r["tpot_ms"], ".2f"),
                   "n/a" if r["equal_to_our_ar"] is None else f"{r['equal_to_our_ar']}/{len(idx)}"]
                  for r in rows]),
        "\ntokens/s excludes prefill for every system (transformers: generate time minus a "
        "separately timed prefill forward).", "",
        "Where one of our iterations goes (ms, batch 1, each phase jitted alone):", "",
        md_table(["method", "draft + tree build", "verify", "commit + resync"],
                 [[m, num(p["draft_and_tree_ms"], ".2f"), num(p["verify_ms"], ".2f"),
                   num(p["commit_and_resync_ms"], ".2f")] for m, p in phases.items()]),
        "", f"Against the roofline floor of this machine (measured here: "
        f"{peaks['gflops']:.0f} GFLOP/s float32 matmul, {peaks['gbytes_per_s']:.1f} GB/s read; "
        "floor = max(FLOPs at that peak, weight bytes at that bandwidth), mean nodes per "
        "iteration from the runs above):", "",
        md_table(["method", "nodes/iter", "draft floor", "verify floor", "iteration floor",
                  "iteration measured (TPOT × τ)", "floor / measured"],
                 [[m, num(sums[m]["nodes_verified"], ".1f"), num(f["draft_ms"], ".2f"),
                   num(f["verify_ms"], ".2f"), num(f["total_ms"], ".2f"),
                   num(iteration[m], ".2f"), num(f["total_ms"] / iteration[m], ".2f")]
                  for m, f in floors.items()])]
  if ar_bound:
    md.append(f"\nOur ar is {ar_bound['measured']:.2f}× transformers `generate` here. A decode "
              f"step that only streamed the weights would be {ar_bound['at_read_floor']:.2f}×; one "
              f"whose matrix-vector products ran at the {peaks['gemv_gbytes_per_s']:.1f} GB/s "
              f"jitted matrix-vector products reach here, {ar_bound['at_gemv_floor']:.2f}×.")
  md += [f"\nNote: {n}" for n in notes]
  return write_outputs(bench, "peers", payload, "\n".join(md) + "\n")


def _ar_bound(rows: list[dict], ar_floor_ms: float, peaks: dict) -> dict | None:
  """Our ar's speedup over transformers `generate`, and the most it could be at this machine's
  weight-streaming floor and at its matrix-vector speed (AR is memory-bound)."""
  ours = next(r for r in rows if r["system"] == "cure_jax ar")
  hf = next((r for r in rows if r["system"].startswith("transformers")), None)
  if hf is None:
    return None
  gemv_floor_ms = ar_floor_ms * peaks["gbytes_per_s"] / peaks["gemv_gbytes_per_s"]
  return dict(measured=hf["tpot_ms"] / ours["tpot_ms"], at_read_floor=hf["tpot_ms"] / ar_floor_ms,
              at_gemv_floor=hf["tpot_ms"] / gemv_floor_ms)


def _peer_rows(bench: Bench, idx: Sequence[int], ours: dict) -> list[dict]:
  import warnings
  from unittest import mock

  import torch
  from transformers import AutoModelForCausalLM

  torch.manual_seed(0)
  target = AutoModelForCausalLM.from_pretrained(bench.target_dir, dtype=torch.float32).eval()
  max_new = int(bench.config.max_new_tokens)
  stops = [] if bench.config.ignore_eos else list(bench.stops)
  rows = []
  hf_ids, hf_s, hf_tok = [], 0.0, 0
  gen_kwargs = dict(max_new_tokens=max_new, do_sample=False, num_beams=1,
                    pad_token_id=stops[0] if stops else 0)
  if stops:
    gen_kwargs["eos_token_id"] = stops
  else:
    gen_kwargs.update(eos_token_id=None, min_new_tokens=max_new)
  with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for i in _progress(idx, "peers (transformers)", bench):
      x = torch.tensor([bench.ids[i]])
      target(x)  # warm
      t0 = time.perf_counter()
      target(x)
      prefill = time.perf_counter() - t0
      t0 = time.perf_counter()
      out = target.generate(x, attention_mask=torch.ones_like(x), **gen_kwargs)
      total = time.perf_counter() - t0
      new = out[0, x.shape[1]:].tolist()
      hf_ids.append(new)
      hf_s += max(total - prefill, 1e-9)
      hf_tok += max(len(new) - 1, 0)
  same = sum(a == r.output_ids for a, r in zip(hf_ids, ours["ar"]))
  rows.append(dict(system="transformers generate (torch fp32)", tau=1.0,
                   tokens_per_s=hf_tok / hf_s, tpot_ms=1000 * hf_s / max(hf_tok, 1),
                   equal_to_our_ar=same))
  if not bench.drafter_dir:
    return rows
  from dflash import model as dflash_model
  from dflash.model import DFlashDraftModel, dflash_generate
  drafter = DFlashDraftModel.from_pretrained(bench.drafter_dir, dtype=torch.float32).eval()
  lens, d_s, d_tok, d_ids = [], 0.0, 0, []
  with torch.no_grad(), warnings.catch_warnings(), mock.patch.object(
      dflash_model, "_cuda_time", time.perf_counter):
    warnings.simplefilter("ignore")
    for n, i in enumerate(_progress(idx, "peers (dflash)", bench)):
      x = torch.tensor([bench.ids[i]])
      if n == 0:  # warm-up
        dflash_generate(drafter, target, x, max_new, stop_token_ids=stops or None,
                        temperature=0.0, return_stats=True)
      out = dflash_generate(drafter, target, x, max_new, stop_token_ids=stops or None,
                            temperature=0.0, return_stats=True)
      lens += list(out.acceptance_lengths)
      d_s += out.time_per_output_token * out.num_output_tokens
      d_tok += out.num_output_tokens
      d_ids.append(out.output_ids[0, x.shape[1]:].tolist())
  same = sum(a == r.output_ids for a, r in zip(d_ids, ours["ar"]))
  rows.append(dict(system="dflash wheel dflash_generate (torch fp32)", tau=float(np.mean(lens)),
                   tokens_per_s=d_tok / max(d_s, 1e-9), tpot_ms=1000 * d_s / max(d_tok, 1),
                   equal_to_our_ar=same))
  return rows


# ----------------------------------------------------------------------------- dispatch

def _table_trees(bench: Bench, budgets=None) -> dict:
  from experiments import table_trees  # it builds on this module
  return table_trees.table_trees(bench, budgets or table_trees.BUDGETS)


def run_tables(bench: Bench, which: str, **kwargs) -> dict:
  """Runs tables named in `which`: one of '1', '3', '4', '5', 'diagnostic', 'sweep', 'peers',
  'trees', a comma-separated list of them (decodes are shared), or 'all'."""
  fns = {"1": table1, "3": lambda b: table3(b, execute=kwargs.get("execute", True)),
         "4": lambda b: table4(b, kwargs.get("table4_problems") or TABLE4_PROBLEMS,
                               [v for v in TABLE4_VARIANTS[1:]
                                if v.label in (kwargs.get("table4_ablations") or
                                               [a.label for a in TABLE4_VARIANTS[1:]])]),
         "5": lambda b: table5(b, tau=kwargs.get("scorer_tau")),
         "diagnostic": diagnostic, "peers": table_peers,
         "trees": lambda b: _table_trees(b, kwargs.get("trees_budgets")),
         "sweep": lambda b: table_sweep(b, {f: SWEEP_GRID[f] for f in
                                            kwargs.get("sweep_factors") or SWEEP_GRID})}
  names = list(TABLES) if which == "all" else [n.strip() for n in which.split(",")]
  bad = [n for n in names if n not in fns]
  if bad:
    raise ValueError(f"--table={which!r}: choose one of {', '.join(TABLES)} or all")
  return {n: fns[n](bench) for n in names}
