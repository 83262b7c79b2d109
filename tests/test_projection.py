"""The roofline projection from compiled counts (cure_jax/costs/roofline.py, cure_jax/analysis/
projection.py, experiments.projection)."""

import numpy as np
import pytest

from cure_jax.costs import roofline
from cure_jax.analysis import projection


def _rec(method, hbm, flops, v_max=0, batch=1):
  return {"method": method, "v_max": v_max, "batch": batch, "program": "decode",
          "xla_flops": flops, "iteration": {"hbm_bytes": hbm, "by_label": {
              "target_weights": 0.8 * hbm, "target_kv": 0.2 * hbm}}}


def test_bandwidth_or_compute_bound_and_speedup_over_ar():
  bw, peak, _ = roofline.DEVICES["v5e"]
  assert roofline.iteration_ms(bw * 1e9, 0, "v5e") == pytest.approx(1000)
  assert roofline.iteration_ms(0, peak * 1e12, "v5e") == pytest.approx(1000)
  records = {("ar", 0, 1): _rec("ar", 4e9, 1e9), ("chain", 0, 1): _rec("chain", 5e9, 1e11)}
  rows = roofline.project(records, ["v5e"], 1.0, {"paper": roofline.PAPER_TAU})
  chain = next(r for r in rows if r["method"] == "chain")
  assert chain["speedup"] == pytest.approx(roofline.PAPER_TAU["chain"] * 4 / 5)
  assert chain["weights"] == pytest.approx(0.8) and chain["kv"] == pytest.approx(0.2)


def test_measured_tau_is_checked():
  assert projection.parse_tau("chain=2.0,cure=2.5") == {"ar": 1.0, "chain": 2.0, "cure": 2.5}
  with pytest.raises(ValueError, match="method=value"):
    projection.parse_tau("beam=3")


def test_a_gpu_compile_adds_its_launches_and_prices_flops_from_the_weights():
  """GPU programs carry no cost analysis: FLOPs are 2 x parameters x tokens, and each host
  launch (a kernel outside a CUDA graph, or a graph) costs launch_us."""
  bw, peak, _ = roofline.DEVICES["H100"]
  weights = {"target": 16e9, "drafter": 2e9}
  ar = dict(_rec("ar", 16e9, 0.0), weights=weights,
            gpu_launches={"iteration": {"launches": 250}})
  cure = dict(_rec("cure", 20e9, 0.0, v_max=64, batch=8), weights=weights,
              gpu_launches={"iteration": {"launches": 10}})
  assert roofline.weight_flops(ar) == 16e9
  assert roofline.weight_flops(cure) == 8 * (16e9 * 64 + 2e9 * 16)
  rows = roofline.project({("ar", 0, 1): ar, ("cure", 64, 8): cure}, ["H100"], 1.0,
                            {"paper": roofline.PAPER_TAU}, launch_us=4.0)
  by = {r["method"]: r for r in rows}
  assert by["ar"]["iteration_ms"] == pytest.approx(1000 * 16e9 / (bw * 1e9) + 250 * 0.004)
  compute_ms = 1000 * 8 * (16e9 * 64 + 2e9 * 16) / (peak * 1e12)   # above its 6 ms of bytes
  assert by["cure"]["iteration_ms"] == pytest.approx(compute_ms + 10 * 0.004)


def test_decode_projects_the_tree_size_it_runs_from_the_committed_counts():
  """experiments.decode's H200 line: the committed H100 counts, at the config's v_max; TPOT is
  the iteration over τ and target-only is 1x."""
  from experiments import decode
  small, big = (decode.gpu_projection("ddtree", 2.0, v) for v in (32, 64))
  assert big["iteration_ms"] > small["iteration_ms"] > decode.gpu_projection("ar", 1.0, 32)[
      "iteration_ms"]
  assert small["tpot_ms"] == pytest.approx(small["iteration_ms"] / 2.0)
  assert decode.gpu_projection("ar", 1.0, 32)["speedup"] == pytest.approx(1.0)
  assert decode.gpu_projection("ddtree", 2.0, 48) == small     # not compiled: the first one


def _auto_rec(method, batch, hbm_gb):
  return dict(method=method, v_max=0, batch=batch, iteration=dict(hbm_bytes=hbm_gb * 1e9),
              weights=dict(target=16e9, drafter=2e9), gpu_launches=None)


def test_auto_projection_picks_the_budget_with_the_most_tokens_per_second():
  """Hand-computed: H100 (3350 GB/s, 989 TFLOP/s). Bytes linear in the batch through the two
  records; FLOPs = batch × (16e9 × nodes + 2e9 × 16); τ(n) geometric with α = 0.5."""
  from cure_jax.costs import curve
  assert curve.prefix_tau(1.875, 4, 2) == pytest.approx(1.5)      # 1 + 0.5 (+ 0.25 + 0.125)
  assert curve.prefix_tau(4.0, 4, 3) == 3 and curve.prefix_tau(1.0, 4, 3) == pytest.approx(1.0)
  ar, chain = (_auto_rec("ar", 1, 17.0), _auto_rec("ar", 8, 24.0)), (_auto_rec("chain", 1, 21.0),
                                                            _auto_rec("chain", 8, 35.0))
  assert curve.bytes_at(*chain, 64) == pytest.approx(21e9 + 14e9 * 63 / 7)
  rows = curve.auto_rows(ar, chain, "H100", [1, 64], [1, 2, 4], 1.875, 4, launch_us=0.0)
  for row, batch in zip(rows, (1, 64)):
    want = {}
    for n in (1, 2, 4):
      recs = ar if n == 1 else chain
      b = recs[0]["iteration"]["hbm_bytes"] + (recs[1]["iteration"]["hbm_bytes"] -
                                               recs[0]["iteration"]["hbm_bytes"]) * (batch - 1) / 7
      flops = batch * (16e9 * n + (0 if n == 1 else 2e9 * 4))
      ms = 1000 * max(b / 3350e9, flops / 989e12)
      want[n] = batch * {1: 1.0, 2: 1.5, 4: 1.875}[n] / ms * 1000
    got = {o["budget"]: o["tokens_per_s"] for o in row["options"]}
    assert got == pytest.approx(want)
    assert row["auto_budget"] == max(want, key=want.get)
    assert row["auto_vs_ar"] == pytest.approx(want[row["auto_budget"]] / want[1])


def test_an_moe_curve_adds_the_experts_its_tokens_reach():
  """MoE records (8 GB of experts, 1/16 per token): each record's bytes less the experts its
  batch x 16 tokens reach are linear in the batch; at batch 32 and 4 nodes the experts 128
  tokens reach are added back, at batch 2 and 1 node those of 2 tokens."""
  from cure_jax.costs import curve
  moe = dict(experts=8e9, experts_per_token=1 / 16)
  recs = tuple(dict(_auto_rec("chain", b, hbm), verify_tokens=16, weights=dict(
      target=16e9, drafter=2e9, **moe)) for b, hbm in ((1, 12.0), (8, 19.0)))
  reach = lambda n: 8e9 * (1 - (15 / 16) ** n)                           # noqa: E731
  rest = [12e9 - reach(16), 19e9 - reach(128)]
  for batch, nodes in ((32, 4), (2, 1), (8, 16)):
    want = rest[0] + (rest[1] - rest[0]) * (batch - 1) / 7 + reach(batch * nodes)
    assert curve.bytes_at(*recs, batch, nodes) == pytest.approx(want)
  assert curve.bytes_at(*recs, 8) == pytest.approx(19e9)
  dense = tuple(dict(r, weights=dict(target=16e9, drafter=2e9)) for r in recs)
  assert curve.bytes_at(*dense, 32, 4) == pytest.approx(12e9 + 7e9 * 31 / 7)


def test_auto_on_a_measured_curve_adds_the_draft_pass_to_every_drafting_budget(tmp_path):
  """Hand-computed on a curve as experiments.device_costs writes it: budget 1 costs the plain
  step alone, budget n the drafter pass plus the target over n nodes; a later file's batch
  replaces an earlier one's."""
  import json
  rows = [dict(batch=1, budgets=[1, 2, 4], draft_s=0.002, verify_s=[0.010, 0.009, 0.011]),
          dict(batch=8, budgets=[1, 2, 4], draft_s=0.004, verify_s=[0.010, 0.020, 0.040])]
  old = tmp_path / "old.json"
  old.write_text(json.dumps(dict(device_kind="GPU X", rows=[dict(rows[0], draft_s=1.0)])))
  new = tmp_path / "new.json"
  new.write_text(json.dumps(dict(device_kind="GPU X", rows=rows)))
  got = projection.measured_auto([str(old), str(new)], [1, 2, 4], [1.875])
  # the τ is a 16-token block's: α is the positive root of Σ_{d<16} α^d = 1.875
  roots = np.roots([1.0] * 15 + [1.0 - 1.875])
  a = float(next(r.real for r in roots if abs(r.imag) < 1e-12 and r.real > 0))
  tau = {1: 1.0, 2: 1 + a, 4: 1 + a + a ** 2 + a ** 3}
  b1 = {1: tau[1] / 10, 2: tau[2] / 11, 4: tau[4] / 13}            # tokens per ms, batch 1
  b8 = {1: 8 / 10, 2: 8 * tau[2] / 24, 4: 8 * tau[4] / 44}          # batch 8: plain steps win
  for row, want in zip(got, (b1, b8)):
    assert row["device"] == "GPU X (measured)"
    assert {o["budget"]: o["tokens_per_s"] for o in row["options"]} == pytest.approx(
        {n: 1000 * v for n, v in want.items()})
    assert row["auto_budget"] == max(want, key=want.get)
  assert [r["auto_budget"] for r in got] == [4, 1]
  with pytest.raises(ValueError, match="no batch 1 budget 16"):
    from cure_jax.costs import curve
    curve.measured_ms(rows)(1, 16)


def test_measured_loops_are_priced_at_each_published_tau(tmp_path):
  """Hand-computed: ar 10 ms, chain 12 ms, a 256-node ddtree 14 ms an iteration at batch 1; the
  paper's chain τ 7.165 gives 10 / (12 / 7.165); DDTree's τ 10.73 prices every ddtree, JetSpec's
  10.76 the 256-node one; a failed program gives no row."""
  import json
  from absl import flags
  from absl.testing import flagsaver
  from experiments import projection as entry_point
  loops = dict(device_kind="GPU X", hbm_gbps=3000.0, bf16_tflops=700.0, records=[
      dict(method="ar", batch=1, nodes=1, ms_per_iteration=10.0, count_ms=5.0),
      dict(method="chain", batch=1, nodes=16, ms_per_iteration=12.0, count_ms=6.0),
      dict(method="ddtree", batch=1, nodes=256, ms_per_iteration=14.0, count_ms=8.0),
      dict(method="cure", batch=1, nodes=64, failed="out of memory")])
  path = tmp_path / "loops.json"
  path.write_text(json.dumps(loops))
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(loops=[str(path)], output=str(tmp_path / "out"), tpu=[], gpu=[],
                           cpu="", auto_measured=[], auto_batches=[]):
    entry_point.main([])
  rows = json.loads((tmp_path / "out.json").read_text())["measured"]
  got = {(r["method"], r["tau_from"]): r["speedup"] for r in rows}
  assert got == pytest.approx({
      ("ar", "paper"): 1.0, ("chain", "paper"): 10 / (12 / 7.165),
      ("ddtree", "DDTree (MATH-500)"): 10 / (14 / 10.73),
      ("ddtree", "JetSpec (MATH-500, 256 nodes)"): 10 / (14 / 10.76)})
  assert all(r["device"] == "GPU X (measured)" for r in rows)
  assert "Measured on a device" in (tmp_path / "out.md").read_text()
