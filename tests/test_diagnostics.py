"""The margin diagnostic and the per-block records it reads, on statistics with known answers."""

import json

import numpy as np
import pytest

from cure_jax.analysis import diagnostics
from cure_jax.analysis.diagnostics import BlockRecord

K = 6  # block size: positions 1..5


def _rec(margins, accepted, prompt=0, iteration=0, **kw):
  return BlockRecord(prompt=prompt, iteration=iteration, block_size=K, branch0_accepted=accepted,
                     accepted=accepted, margins=tuple(float(m) for m in margins), **kw)


def _four_blocks():
  """Lowest margin at the first rejection in blocks 0, 1, 2; after it in block 3."""
  return [
      _rec([5, 5, 0.2, 5, 5], accepted=2),   # first rejection 3, lowest 3: hit
      _rec([0.1, 5, 5, 5, 5], accepted=0),   # first rejection 1, lowest 1: hit
      _rec([5, 5, 5, 5, 0.3], accepted=4),   # first rejection 5, lowest 5: hit
      _rec([5, 0.9, 5, 0.1, 5], accepted=1),  # first rejection 2, lowest 4: after
  ]


def test_block_records_from_stats_dicts():
  stats = [
      dict(accept_lengths=3, nodes_verified=6, winning_branch=0, ufp_positions=[2],
           ufp_margins=[0.5], branches=[3], repair_gain=0, branch0_accepted=2,
           block_margins=[4.0, 0.5, 1.0, 2.0, 3.0]),
      dict(accept_lengths=5, nodes_verified=12, winning_branch=1, ufp_positions=[1],
           ufp_margins=[0.2], branches=[4], repair_gain=3, branch0_accepted=1,
           block_margins=[0.2, 1.0, 1.0, 1.0, 1.0]),
      dict(accept_lengths=2, nodes_verified=6, winning_branch=0, ufp_positions=[],
           ufp_margins=[], branches=[], repair_gain=0, branch0_accepted=5,
           block_margins=[9.0] * 5),
  ]
  recs = diagnostics.block_records([stats], K)
  assert len(recs) == 2  # the last (truncated) iteration is dropped
  assert recs[0].first_rejection == 3 and recs[0].lowest_margin_position == 2
  assert recs[1].accepted == 4 and recs[1].prev_accept == 3 and recs[1].gate_fired
  everything = diagnostics.block_records([stats], K, drop_last=False)
  assert everything[2].first_rejection is None  # all 5 accepted

  # Without the decoder's branch0_accepted / block_margins: derived / unknown.
  bare = [{k: v for k, v in s.items() if k not in ("branch0_accepted", "block_margins")}
          for s in stats]
  recs = diagnostics.block_records([bare], K)
  assert [r.branch0_accepted for r in recs] == [2, 1]  # accept - 1 - repair_gain
  assert all(r.margins is None for r in recs)

  with pytest.raises(ValueError, match="block_margins has 3 entries"):
    diagnostics.block_records([[dict(stats[0], block_margins=[1, 2, 3])] * 2], K)


def test_lowest_margin_is_first_rejection_in_three_of_four():
  d = diagnostics.diagnose(_four_blocks(), tau=1.0)
  assert d["blocks"] == 4 and d["blocks_with_rejection"] == 4
  assert d["lowest_is_first_rejection"] == pytest.approx(0.75)
  assert d["lowest_after_first_rejection"] == pytest.approx(0.25)
  assert d["lowest_before_first_rejection"] == 0.0
  assert d["first_rejection_hist"]["counts"] == [1, 1, 1, 0, 1]
  # margins at the first rejections: 0.2, 0.1, 0.3, 0.9 -> all under tau = 1
  assert d["first_rejection_under_tau"] == 1.0
  # earliest under-tau: block 3's earliest is position 2 = its first rejection -> 4/4
  assert d["gate_earliest_hits_first_rejection"] == 1.0
  assert d["gate_lowest_hits_first_rejection"] == pytest.approx(0.75)
  # reached positions: block0 1,2 ok 3 wrong; block1 1 wrong; block2 1-4 ok 5 wrong; block3 1 ok,
  # 2 wrong. Under tau: 0.2w, 0.1w, 0.3w, 0.9w -> 4/4; over tau: 8 reached, all right.
  assert d["error_rate_under_tau"] == 1.0 and d["error_rate_over_tau"] == 0.0
  assert d["margin_auc"] == 1.0
  assert sum(d["margin_hist"]["counts"]) == 20
  assert d["frac_positions_under_tau"] == pytest.approx(5 / 20)
  assert d["pays"] is True and d["verdict"].startswith("repair likely to pay")
  json.dumps(d)  # JSON-ready


def test_confident_drafter_verdict():
  recs = [_rec([8, 9, 7, 8, 9], accepted=a, iteration=i) for i, a in enumerate([1, 3, 0, 4])]
  d = diagnostics.diagnose(recs, tau=1.0)
  assert d["gate_rate"] == 0.0 and d["first_rejection_under_tau"] == 0.0
  assert d["pays"] is False
  assert "confident almost everywhere" in d["verdict"]


def test_errors_after_the_lowest_margin_are_flagged():
  # Lowest margin always after the first rejection, errors at confident positions.
  recs = [_rec([5, 6, 7, 0.1, 0.2], accepted=0, iteration=i) for i in range(5)]
  d = diagnostics.diagnose(recs, tau=1.0)
  assert d["lowest_after_first_rejection"] == 1.0
  assert d["pays"] is False
  assert "confident positions" in d["verdict"] and "cannot help" in d["verdict"]


def test_cure_gate_statistics_and_partial_verdict():
  base = dict(prompt=0, block_size=K, margins=None)
  recs = [BlockRecord(iteration=0, branch0_accepted=1, accepted=3, ufp_positions=(2,),
                      ufp_margins=(0.3,), branches=(3,), repair_gain=2, **base),
          BlockRecord(iteration=1, branch0_accepted=1, accepted=1, ufp_positions=(4,),
                      ufp_margins=(0.5,), branches=(2,), repair_gain=0, **base),
          BlockRecord(iteration=2, branch0_accepted=3, accepted=3, **base)]
  d = diagnostics.diagnose(recs, tau=1.0)
  assert d["margins_available"] == 0
  assert d["cure_gate_rate"] == pytest.approx(2 / 3)
  assert d["cure_gate_at_first_rejection"] == 0.5
  assert d["cure_useful_repairs"] == 1 and d["cure_extra_tokens"] == 2
  assert "partial diagnostic" in d["verdict"]


def test_histogram_and_auc():
  h = diagnostics.histogram([-1.0, 0.0, 0.49, 0.5, 10.0, 99.0])
  assert h["counts"][0] == 3 and h["counts"][1] == 1 and h["counts"][-1] == 2
  rng = np.random.default_rng(0)
  pos, neg = rng.normal(1, 1, 30), rng.normal(0, 1, 40)
  pos[:3] = neg[:3]  # ties
  brute = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
  assert diagnostics._auc(pos, neg) == pytest.approx(brute)


def test_markdown_and_plots(tmp_path):
  d = diagnostics.diagnose(_four_blocks(), tau=1.0)
  md = diagnostics.markdown(d)
  assert "lowest margin IS the first rejection | 75.0%" in md
  pytest.importorskip("matplotlib")

  def save(fig, path):
    fig.savefig(path)

  paths = diagnostics.plot(d, str(tmp_path / "m.png"), str(tmp_path / "r.png"), save)
  assert all((tmp_path / p).stat().st_size > 0 for p in ("m.png", "r.png")) and len(paths) == 2
