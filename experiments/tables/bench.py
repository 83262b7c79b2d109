"""What every benchmark table shares: decode the variants a table needs (cached per `Bench`),
summarize runs, and write JSON + markdown atomically under the results folder.

Every table function takes a `Bench` (models, prompts, config, results folder) and returns its
JSON-ready payload; decoded results are cached on the Bench by (method, cure settings, prompt),
so `--table=all` decodes each variant once and every table compares runs of the same process.
Within a table the variants are interleaved prompt by prompt (all variants decode prompt i
before any decodes prompt i+1), so a change in machine load hits every method alike.

Measured: τ (mean emitted tokens per iteration, bonus included), TPOT (decode wall time /
tokens generated after the first, compile and prefill excluded), speedups against target-only
AR of the same run, node counts, token equality with AR, pass@1. Projected (sweep and trees
tables only, labelled as such): speedups from the paper's efficiency model on measured cost
curves.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from cure_jax.runtime import pipeline, prompts as prompts_lib
from cure_jax import methods
from cure_jax.runtime.generation import Result
from cure_jax.analysis.agreement import common_prefix
from cure_jax.analysis.report import environment, jsonable, write_text

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
  """A decoding method with cure overrides on top of the config's cure settings, a drafter
  context window and a draft vocabulary (drafter.vocab; 0: the config's)."""

  label: str
  method: str
  cure: tuple[tuple[str, Any], ...] = ()
  window: int = 0
  vocab: int = 0

  @classmethod
  def of(cls, label: str, method: str, *, window: int = 0, vocab: int = 0, **cure) -> "Variant":
    return cls(label, method, tuple(sorted(cure.items())), window, vocab)


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
    drafter = tuple((name, value) for name, value in (("window", variant.window),
                                                      ("vocab", variant.vocab)) if value)
    if not methods.get(variant.method).tree_config:
      return (variant.method,) + drafter
    return (variant.method,) + tuple(sorted(self.cure_settings(variant).items())) + drafter


def from_config(config, **fields) -> Bench:
  """A Bench on the config's pair (paths resolved, models loaded; the block drafter whatever
  config.method says) and prompts (config.prompts, else HumanEval's; the first
  config.num_prompts); `fields`: the Bench's other fields."""
  pipeline.check_config(config)
  pipeline.resolve_paths(config)
  target = pipeline.load_target(config)
  with config.unlocked():
    config.method = "cure"
  drafter = pipeline.load_drafter(config, target)
  tokenizer = pipeline.load_tokenizer(config.target.path)
  rows = (prompts_lib.read_jsonl(config.prompts) if config.prompts
          else prompts_lib.humaneval_prompts())
  if config.num_prompts:
    rows = rows[:config.num_prompts]
  ids = prompts_lib.encode(rows, tokenizer, config.chat_template, target.cfg.vocab_size)
  return Bench(config=config, target=target, drafter=drafter, rows=rows, ids=ids,
               tokenizer=tokenizer, stops=pipeline.stop_ids(config.target.path, tokenizer),
               **fields)


def _generator(bench: Bench, variant: Variant):
  key = bench.key(variant)
  if key not in bench.generators:
    cfg = copy.deepcopy(bench.config)
    with cfg.unlocked():
      cfg.cure.update(dict(variant.cure))
      if variant.window:
        cfg.drafter.window = variant.window
      if variant.vocab:
        cfg.drafter.vocab = variant.vocab
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
          store[i] = dataclasses.replace(r, decode_s=r.decode_s / len(chunk_v), batch_size=1)
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
    store.setdefault(row["prompt_index"], Result(**{k: row[k] for k in fields if k in row}))


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
