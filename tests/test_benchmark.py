"""The benchmark tables end to end on a tiny random pair: files exist, parse, and agree.

One Bench is shared by the module, so each variant compiles and decodes once (tables reuse
each other's runs, as `--table=all` does).
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from configs import common
from cure_jax.analysis import humaneval_exec
from experiments.tables import diagnostic, peers, sweep, table1, table3, table4, table5
from experiments.tables.bench import Bench, Variant, after_wins, prompt_batches, run_variants
from cure_jax.analysis import random_models

ARCH = random_models.Arch()
NUM_PROMPTS = 4
SOLVED = "```python\ndef identity(x):\n    return x\n```"


class _Tokenizer:
  """Decodes a completion to a correct solution when its first token is even."""

  def decode(self, ids, skip_special_tokens=True):
    return SOLVED if ids and ids[0] % 2 == 0 else "I do not know."


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  target, drafter = random_models.pair(ARCH, 3)
  config = common.base_config()
  config.max_new_tokens = 16
  config.cure.tau_margin = 3.0   # random drafters are confident: let the gate fire
  config.cure.v_max = 32
  ids = random_models.prompts(1, ARCH.vocab, NUM_PROMPTS)
  rows = [dict(prompt_ids=p, prompt="def identity(x):\n    \"\"\"Returns x.\"\"\"\n",
               entry_point="identity", task_id=f"toy/{i}",
               test="def check(candidate):\n    assert candidate(3) == 3\n") for i, p in
          enumerate(ids)]
  out = tmp_path_factory.mktemp("results")
  b = Bench(config=config, target=target, drafter=drafter, rows=rows, ids=ids,
            tokenizer=_Tokenizer(), results_dir=str(out), progress=False, echo=lambda s: None)
  # Compile and decode the three methods every table uses once, up front (~3 compiles).
  run_variants(b, [Variant.of(m, m) for m in ("ar", "chain", "cure")], list(range(NUM_PROMPTS)))
  return b


def _load(bench, name):
  out = Path(bench.results_dir)
  assert (out / f"{name}.md").read_text().startswith("## ")
  return json.loads((out / f"{name}.json").read_text())


def _raw(bench, label):
  return json.loads((Path(bench.results_dir) / "raw" / f"{label}.json").read_text())


def _results(bench, method):
  """The method's per-prompt results as the tables' raw files hold them, from the module's runs
  (decoded up front by the fixture), whichever test wrote its raw file or not."""
  runs = run_variants(bench, [Variant.of(method, method)], list(range(NUM_PROMPTS)))[method]
  return [dataclasses.asdict(r) for r in runs]


def test_table1(bench):
  table1.table1(bench)
  t1 = _load(bench, "table1")
  rows = {r["method"]: r for r in t1["rows"]}
  assert set(rows) == {"ar", "chain", "cure"}  # no AR drafter: skipped with a note
  assert any("ar_draft skipped" in n for n in t1["notes"])
  for name, row in rows.items():
    raw = _raw(bench, name)
    lens = [a for r in raw for a in r["accept_lengths"]]
    assert row["tau"] == pytest.approx(np.mean(lens))
    assert row["iterations"] == len(lens) and row["prompts"] == NUM_PROMPTS
    assert row["mismatches_vs_ar"] == 0  # float32 greedy: every method emits AR's tokens
    assert row["speedup_vs_ar"] == pytest.approx(rows["ar"]["tpot_ms"] / row["tpot_ms"])
    assert row["generated_tokens"] == sum(len(r["output_ids"]) for r in raw)
  assert rows["ar"]["tau"] == 1.0 and rows["ar"]["nodes_verified"] == 1.0
  assert rows["cure"]["nodes_verified"] >= rows["chain"]["nodes_verified"]
  assert all(p[m]["equal_to_ar"] for p in t1["per_prompt"] for m in rows)
  assert t1["cure_tau_gain"] == pytest.approx(rows["cure"]["tau"] / rows["chain"]["tau"] - 1)


def test_table3(bench):
  table3.table3(bench)
  t3 = _load(bench, "table3")
  ar = _results(bench, "ar")
  expected = sum(r["output_ids"][0] % 2 == 0 for r in ar)
  for row in t3["rows"]:  # identical tokens -> identical pass counts
    assert row["passed"] == expected and row["pass_at_1"] == expected / NUM_PROMPTS
    assert row["exact_match_vs_ar"] == NUM_PROMPTS and row["token_agreement_vs_ar"] == 1.0
  assert len(t3["completions"]) == 3 * NUM_PROMPTS


def test_program_runner():
  row = dict(prompt="def identity(x):\n    \"\"\"doc\"\"\"\n", entry_point="identity",
             test="def check(candidate):\n    assert candidate(3) == 3\n")
  ok = humaneval_exec.extract_program(row, "Here:\n" + SOLVED + "\nDone.")
  cont = humaneval_exec.extract_program(row, "    return x\n")
  wrong = humaneval_exec.extract_program(row, "```python\ndef identity(x):\n    return 4\n```")
  loop = humaneval_exec.extract_program(row, "    while True:\n        pass\n")
  results = humaneval_exec.check_programs([ok, cont, wrong, loop], timeout=3.0)
  assert [r["passed"] for r in results] == [True, True, False, False]
  assert "AssertionError" in results[2]["status"] and results[3]["status"] == "timed out"


def test_table5_and_diagnostic(bench):
  table5.table5(bench, kinds=("logreg",), steps=100)
  t5 = _load(bench, "table5")
  cure = json.loads(Path(t5["raw"]).read_text())  # the cure run the table scored
  kept = [s for r in cure for s in r["stats"][:-1]]
  assert t5["blocks"] == len(kept)
  assert t5["gated_blocks"] == sum(bool(s["ufp_positions"]) for s in kept)
  assert t5["useful_blocks"] == sum(bool(s["ufp_positions"]) and s["repair_gain"] > 0
                                    for s in kept)
  assert t5["train"]["blocks"] + t5["test"]["blocks"] == t5["gated_blocks"]

  diagnostic.diagnostic(bench)
  d = _load(bench, "diagnostic")
  chain = _results(bench, "chain")
  assert d["blocks"] == sum(len(r["stats"]) - 1 for r in chain)
  assert d["margins_available"] == d["blocks"]
  assert sum(d["first_rejection_hist"]["counts"]) == d["blocks_with_rejection"]
  assert sum(d["margin_hist"]["counts"]) == d["blocks"] * (ARCH.block_size - 1)
  assert isinstance(d["verdict"], str) and d["pays"] in (True, False)
  for png in d["figures"]:
    assert Path(png).stat().st_size > 0


def test_table4(bench):
  # One ablation keeps the test short; the table's shape is the same with all three.
  table4.table4(bench, problems=3, ablations=(Variant.of("cure w/o resync", "cure",
                                                         resync=False),))
  t4 = _load(bench, "table4")
  rows = {r["variant"]: r for r in t4["rows"]}
  assert t4["problems"] == 3 and set(rows) == {"ar", "chain", "cure", "cure w/o resync"}
  assert rows["cure"]["tau_change_vs_cure"] == 0.0
  assert rows["chain"]["tpot_ratio_vs_chain"] == 1.0
  for r in rows.values():
    assert r["mismatches_vs_ar"] == 0 and r["prompts"] == 3
    assert r["speedup_vs_ar"] == pytest.approx(rows["ar"]["tpot_ms"] / r["tpot_ms"])
  # every variant's per-prompt results are kept, so a later run can reuse them (--reuse_raw)
  raw = Path(bench.results_dir) / "raw"
  assert {p.stem for p in raw.glob("*.json")} >= {"ar", "chain", "cure", "cure_w_o_resync"}


def test_sweep(bench):
  # Base settings only (already compiled): two labels, one decode; plus the cost curves.
  sweep.table_sweep(bench, grid=dict(tau_margin=(3.0,), select=("margin",)), repeats=1,
                          nodes=(1, 4, 8))
  sw = _load(bench, "sweep")
  rows = {r["variant"]: r for r in sw["rows"]}
  assert set(rows) == {"ar", "chain", "tau_margin=3.0 (base)", "select=margin (base)"}
  assert rows["tau_margin=3.0 (base)"]["tau"] == rows["select=margin (base)"]["tau"]
  assert rows["ar"]["projected_speedup_cpu_curve"] == 1.0
  for r in rows.values():
    assert r["mismatches_vs_ar"] == 0
    assert np.isfinite(r["projected_speedup_cpu_curve"]) and r["projected_speedup_flat_curve"] > 0
  assert set(sw["costs"]["verify_ms"]) == {"1", "4", "8"}
  assert Path(sw["figure"]).stat().st_size > 0
  cure_rows = [r for r in sw["rows"] if r["cure"]]
  for curve in ("projected_speedup_cpu_curve", "projected_speedup_flat_curve"):
    assert sw["tuned"][curve]["projected_speedup"] == max(r[curve] for r in cure_rows)


def test_peers_without_hf_directories(bench):
  peers.table_peers(bench)  # no HF directories: ours only, peers skipped with a note
  result = _load(bench, "peers")
  assert [r["system"] for r in result["rows"]] == ["cure_jax ar", "cure_jax chain", "cure_jax cure"]
  assert result["notes"] and all(r["equal_to_our_ar"] == NUM_PROMPTS for r in result["rows"])
  assert set(result["phases_ms"]) == {"ar", "chain", "cure"}
  assert all(v > 0 for p in result["phases_ms"].values() for v in p.values())
  assert result["peaks"]["gflops"] > 0 and result["peaks"]["gbytes_per_s"] > 0
  assert set(result["floors_ms"]) == {"ar", "chain", "cure"}
  assert result["floors_ms"]["ar"]["draft_ms"] == 0 < result["floors_ms"]["chain"]["draft_ms"]
  assert result["peaks"]["gemv_gbytes_per_s"] > 0 and result["ar_vs_transformers"] is None


def test_ar_bound_against_transformers():
  """The ratio bound: transformers' TPOT over our AR floor, at streaming speed and at the slower
  matrix-vector speed (the floor stretches by read / gemv bandwidth)."""
  rows = [dict(system="cure_jax ar", tpot_ms=30.0),
          dict(system="transformers generate (torch fp32)", tpot_ms=60.0)]
  bound = peers._ar_bound(rows, 15.0, dict(gbytes_per_s=30.0, gemv_gbytes_per_s=20.0))
  assert bound == dict(measured=2.0, at_read_floor=4.0, at_gemv_floor=60.0 / 22.5)


def test_batched_runs_match_batch1(bench):
  """--config.batch_size: prompts decoded together (grouped by length) give each prompt its
  batch-1 tokens, and the batch's wall time is split so that totals are not counted twice."""
  import copy
  config = copy.deepcopy(bench.config)
  config.batch_size = 3
  batched = Bench(config=config, target=bench.target, drafter=bench.drafter, rows=bench.rows,
                  ids=bench.ids, results_dir=bench.results_dir, progress=False, warmup=False,
                  echo=lambda s: None)
  chunks = prompt_batches(batched, list(range(NUM_PROMPTS)))
  assert sorted(i for c in chunks for i in c) == list(range(NUM_PROMPTS))
  assert [len(c) for c in chunks] == [3, 1]
  variant = Variant.of("cure", "cure")
  one = run_variants(bench, [variant], list(range(NUM_PROMPTS)))["cure"]
  many = run_variants(batched, [variant], list(range(NUM_PROMPTS)))["cure"]
  assert [r.output_ids for r in many] == [r.output_ids for r in one]
  first = chunks[0]
  shares = [many[i].decode_s for i in first]
  assert shares == pytest.approx([shares[0]] * 3)
  assert many[first[0]].tpot_ms == pytest.approx(
      1000 * 3 * shares[0] / (len(many[first[0]].output_ids) - 1))


def test_roofline_floors(bench):
  """The floor is the larger of FLOPs at peak and weight bytes at bandwidth: the target reads
  each parameter once (4 bytes in float32) and spends 2 FLOPs per parameter per node, except an
  untied input embedding, of which only the gathered rows are touched."""
  from flax import nnx
  from cure_jax.costs import efficiency
  target, drafter = bench.target, bench.drafter
  params = sum(x.size for x in __import__("jax").tree.leaves(nnx.state(target, nnx.Param)))
  embed = target.cfg.vocab_size * target.cfg.hidden_size
  params -= 0 if target.cfg.tie_embeddings else embed
  memory_bound = dict(gflops=1e9, gbytes_per_s=1.0)
  compute_bound = dict(gflops=1.0, gbytes_per_s=1e9)
  f = efficiency.floors_ms(target, drafter, memory_bound, {"ar": 1, "chain": 8})
  assert f["ar"]["verify_ms"] == pytest.approx(1000 * 4 * params / 1e9)
  assert f["chain"]["verify_ms"] == pytest.approx(f["ar"]["verify_ms"])  # weights read once
  f = efficiency.floors_ms(target, drafter, compute_bound, {"ar": 1, "chain": 8, "cure": 8},
                           repair_paths=2, repair_rows=2 * (drafter.cfg.block_size - 1))
  assert f["ar"]["verify_ms"] == pytest.approx(1000 * 2 * params / 1e9)
  assert f["chain"]["verify_ms"] == pytest.approx(8 * f["ar"]["verify_ms"])
  assert f["cure"]["draft_ms"] == pytest.approx(3 * f["chain"]["draft_ms"])  # 2 full re-drafts
  fewer_rows = efficiency.floors_ms(target, drafter, compute_bound, {"cure": 8}, repair_paths=2,
                                    repair_rows=1)["cure"]["draft_ms"]
  head_row_ms = 1000 * 2 * embed / 1e9
  assert fewer_rows == pytest.approx(f["cure"]["draft_ms"] - (2 * (drafter.cfg.block_size - 1) - 1)
                                     * head_row_ms)
  assert f["chain"]["draft_ms"] > 2 * (drafter.cfg.block_size - 1) * embed / 1e6


def test_reuse_raw_skips_decoding(bench):
  """--reuse_raw: a variant whose raw file exists is read back, not decoded again."""
  table1.table1(bench)
  again = Bench(config=bench.config, target=bench.target, drafter=bench.drafter,
                rows=bench.rows, ids=bench.ids, results_dir=bench.results_dir,
                progress=False, echo=lambda s: None,
                reuse_raw=str(Path(bench.results_dir) / "raw"))
  runs = run_variants(again, [Variant.of("chain", "chain")], list(range(NUM_PROMPTS)))
  assert not again.generators  # nothing compiled or decoded
  first = bench.runs[("chain",)]
  assert [r.output_ids for r in runs["chain"]] == [first[i].output_ids for i in range(NUM_PROMPTS)]
  assert runs["chain"][0].stats == first[0].stats
  missing = dataclasses.replace(again, reuse_raw=str(Path(bench.results_dir) / "no_such_raw"))
  with pytest.raises(FileNotFoundError, match="reuse_raw"):
    run_variants(missing, [Variant.of("chain", "chain")], [0])


def test_accepted_length_after_a_repair_win():
  """Each iteration is credited to the winner of the iteration before it; a sequence's first
  iteration has no predecessor and the last one's successor does not exist."""
  from types import SimpleNamespace

  def it(won, accepted):
    return dict(winning_branch=won, accept_lengths=accepted)

  runs = [SimpleNamespace(stats=[it(2, 5), it(0, 1), it(0, 4), it(1, 3)]),
          SimpleNamespace(stats=[it(1, 2), it(0, 6)])]
  assert after_wins(runs) == dict(iterations_after_repair_win=2,
                                  tau_after_repair_win=(1 + 6) / 2,
                                  tau_after_branch0_win=(4 + 3) / 2)
  assert after_wins([SimpleNamespace(stats=[it(0, 3)])])["tau_after_repair_win"] is None


def test_trees_table(bench):
  from experiments.tables.trees import table_trees
  # 4 < block size: skipped; 6 = branch 0's nodes: ddtree only; 12: every strategy.
  table_trees(bench, budgets=(4, 6, 12), repeats=1)
  tr = _load(bench, "trees")
  rows = {r["variant"]: r for r in tr["rows"]}
  assert set(rows) == {"ar", "chain", "ddtree v6", "ddtree v12", "cure margin v12",
                       "cure earliest v12", "hybrid v12", "hybrid online v12"}
  for r in rows.values():
    assert r["mismatches_vs_ar"] == 0
    src = r["sources"]
    if r["method"] != "ar":  # the parts add up to τ, up to the truncated last iterations
      assert 0 <= sum(src.values()) - r["tau"] <= ARCH.block_size * NUM_PROMPTS / r["iterations"]
  assert rows["chain"]["sources"]["siblings"] == rows["chain"]["sources"]["redrafted"] == 0
  ddtree = rows["ddtree v12"]
  assert ddtree["sources"]["redrafted"] == 0 and ddtree["drafter_passes"] == 1
  assert rows["cure earliest v12"]["sources"]["siblings"] == 0
  assert rows["cure earliest v12"]["drafter_passes"] > 1        # the gate fires, a re-draft runs
  assert rows["hybrid v12"]["nodes_verified"] > rows["chain"]["nodes_verified"]
  assert all(x >= 0 for x in tr["online_costs"].values()) and tr["online_costs"]["cost_draft"] > 0
  assert rows["ar"]["projected_speedup_flat"] == 1.0


def test_goodput_table(bench):
  from experiments.tables.goodput import goodput_variants, table_goodput
  k = ARCH.block_size
  labels = ("ar", "chain", f"ddtree v{2 * k}", f"cure v{2 * k}", "auto")
  variants = [v for v in goodput_variants(k) if v.label in labels]
  assert len(variants) == len(labels)
  bench.config.auto.costs = "1.0,1.4,1.7,2.2"   # fixed costs: no timing in a test
  bench.config.auto.explore_every = 4            # looks that fit a 16-token run
  bench.config.auto.explore_overhead = 1.0
  try:
    table_goodput(bench, batch_sizes=(2,), variants=variants, rounds=2)
  finally:
    bench.config.auto.costs = ""
    bench.config.auto.explore_every, bench.config.auto.explore_overhead = 16, 0.02
  g = _load(bench, "goodput")
  rows = {r["method"]: r for r in g["rows"]}
  assert set(rows) == set(labels)
  for r in rows.values():   # two timed rounds: medians of each round's figures
    assert r["mismatches_vs_ar"] == 0 and r["batch"] == 2 and len(r["rounds_tpot_ms"]) == 2
    ratios = [a / t for a, t in zip(rows["ar"]["rounds_tpot_ms"], r["rounds_tpot_ms"])]
    assert r["rounds_vs_ar"] == pytest.approx(ratios)
    assert r["vs_ar"] == pytest.approx(sum(ratios) / 2)
    assert r["tpot_ms"] == pytest.approx(sum(r["rounds_tpot_ms"]) / 2)
  assert rows["ar"]["rounds_vs_ar"] == [1.0, 1.0]
  auto = rows["auto"]
  # one budget per iteration of a controlled call; a call no look falls inside (here the second,
  # after a look that did not pay) runs target-only and chooses none
  assert 0 < sum(auto["budgets"].values()) <= auto["iterations"]
  assert {int(n) for n in auto["budgets"]} <= {1, 4, 8, 16} and not rows["chain"]["budgets"]
  verdict, = g["verdicts"]
  best = max((r for r in rows.values() if r["method"] != "auto"), key=lambda r: r["tokens_per_s"])
  assert verdict["best_fixed"] == best["method"]
  assert verdict["auto_vs_best"] == pytest.approx(auto["tokens_per_s"] / best["tokens_per_s"])


def test_floors_table(bench):
  """Every part of auto's loop beside its floor, and the floor is the weights' products: the
  jitted chain against numpy's over the same random model."""
  import numpy as np
  from experiments.tables.floors import layer_weights, matmul_floor, table_floors
  target = bench.target
  head = np.asarray(target.head_rows(np.arange(ARCH.vocab, dtype=np.int32)))
  head = head if head.shape[0] == ARCH.vocab else head.T
  layers = layer_weights(target)
  assert len(layers) == target.cfg.num_layers and all(len(w) == 7 for w in layers)
  fn, args = matmul_floor(layers, head, 3)
  x = np.asarray(args[2], np.float64)
  for w in layers:
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    q, k, v = x @ w["q_proj"], x @ w["k_proj"], x @ w["v_proj"]
    x = x + q @ w["o_proj"] + k.mean() + v.mean()
    g = x @ w["gate_proj"]
    x = x + (g / (1 + np.exp(-g)) * (x @ w["up_proj"])) @ w["down_proj"]
  np.testing.assert_allclose(fn(*args), x @ head.T, rtol=1e-4, atol=1e-5)

  table_floors(bench)
  f = _load(bench, "floors")
  parts = [r["part"] for r in f["rows"]]
  drafted = [n for n in f["budgets"] if n > 1]
  assert drafted == [4, 8, 16]
  assert parts[0] == "plain step (1 row)" and parts[len(drafted) + 1].startswith("drafter pass (")
  assert parts[1:len(drafted) + 1] == [f"verify {n} nodes" for n in drafted]
  assert parts[len(drafted) + 2:] == [f"iteration at {n} nodes" for n in drafted]
  assert all(r["loop_ms"] > 0 and r["floor_ms"] > 0 and
             r["ratio"] == pytest.approx(r["loop_ms"] / r["floor_ms"]) for r in f["rows"])
  assert sorted(int(r) for r in f["matmul_floor_ms"]) == [1, 2, 4, 8, 16, 32]
