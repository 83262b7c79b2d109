"""The roofline projection from compiled counts (cure_jax/costs/roofline.py, projection.py)."""

import pytest

from cure_jax.costs import roofline
from experiments import projection


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
