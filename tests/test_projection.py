"""The roofline projection from compiled counts (experiments/projection.py)."""

import pytest

from experiments import projection


def _rec(method, hbm, flops, v_max=0, batch=1):
  return {"method": method, "v_max": v_max, "batch": batch, "program": "decode",
          "xla_flops": flops, "iteration": {"hbm_bytes": hbm, "by_label": {
              "target_weights": 0.8 * hbm, "target_kv": 0.2 * hbm}}}


def test_bandwidth_or_compute_bound_and_speedup_over_ar():
  bw, peak, _ = projection.DEVICES["v5e"]
  assert projection.iteration_ms(bw * 1e9, 0, "v5e") == pytest.approx(1000)
  assert projection.iteration_ms(0, peak * 1e12, "v5e") == pytest.approx(1000)
  records = {("ar", 0, 1): _rec("ar", 4e9, 1e9), ("chain", 0, 1): _rec("chain", 5e9, 1e11)}
  rows = projection.project(records, ["v5e"], 1.0, {"paper": projection.PAPER_TAU})
  chain = next(r for r in rows if r["method"] == "chain")
  assert chain["speedup"] == pytest.approx(projection.PAPER_TAU["chain"] * 4 / 5)
  assert chain["weights"] == pytest.approx(0.8) and chain["kv"] == pytest.approx(0.2)


def test_measured_tau_is_checked():
  assert projection.parse_tau("chain=2.0,cure=2.5") == {"ar": 1.0, "chain": 2.0, "cure": 2.5}
  with pytest.raises(ValueError, match="method=value"):
    projection.parse_tau("beam=3")
