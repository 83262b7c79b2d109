"""The offline repair-utility scorer: ranking metrics with known answers, features, training."""

import json

import numpy as np
import pytest

from cure_jax.analysis import scorer
from cure_jax.analysis.diagnostics import BlockRecord

K = 6


def test_ranking_metrics_known_answers():
  gain = np.array([0, 5, 0, 0, 1, 0, 0, 1, 0, 0], float)
  useful = gain > 0
  perfect = scorer.ranking_metrics(gain, useful, gain, budgets=(0.1, 0.3))
  assert perfect["0.1"] == dict(admitted=1, precision=1.0, recall=pytest.approx(1 / 3),
                                extra_token_recall=pytest.approx(5 / 7))
  assert perfect["0.3"]["precision"] == 1.0 and perfect["0.3"]["recall"] == 1.0
  assert perfect["0.3"]["extra_token_recall"] == 1.0
  worst = scorer.ranking_metrics(-gain, useful, gain, budgets=(0.1, 0.3))
  assert worst["0.3"]["precision"] == 0.0 and worst["0.3"]["extra_token_recall"] == 0.0
  # No useful block: recall undefined, precision 0.
  none = scorer.ranking_metrics(np.arange(4.0), np.zeros(4, bool), np.zeros(4))
  assert none["0.1"]["precision"] == 0.0 and none["0.1"]["recall"] is None


def test_random_baseline_is_the_expectation():
  rng = np.random.default_rng(1)
  gain = rng.integers(0, 3, 40) * (rng.random(40) < 0.3)
  useful = gain > 0
  exact = scorer.random_metrics(useful, gain, (0.1, 0.3))
  sampled = [scorer.ranking_metrics(rng.random(40), useful, gain, (0.1, 0.3), seed=s)
             for s in range(3000)]
  for r in ("0.1", "0.3"):
    for m in ("precision", "recall", "extra_token_recall"):
      assert np.mean([x[r][m] for x in sampled]) == pytest.approx(exact[r][m], abs=0.02)


def test_ties_are_broken_without_order_bias():
  scores = np.zeros(100)
  first = [scorer.rank(scores, seed=s)[0] for s in range(200)]
  assert len(set(first)) > 50
  np.testing.assert_array_equal(scorer.rank(scores, 3), scorer.rank(scores, 3))
  assert list(scorer.rank(np.array([0.1, 0.9, 0.5]))) == [1, 2, 0]


def _record(prompt, iteration, margins, ufp, gain, accepted=0):
  return BlockRecord(prompt=prompt, iteration=iteration, block_size=K, branch0_accepted=accepted,
                     accepted=accepted + max(gain, 0), margins=tuple(margins),
                     ufp_positions=(ufp,), ufp_margins=(margins[ufp - 1],), branches=(3,),
                     nodes_verified=12, repair_gain=gain, prev_accept=2)


def test_block_features():
  r = _record(0, 0, [3.0, 0.4, 2.0, 0.8, 50.0], ufp=2, gain=1)
  names = scorer.feature_names(True)
  f = dict(zip(names, scorer.block_features(r, tau=1.0, with_margins=True)))
  assert f["ufp_margin"] == pytest.approx(0.4) and f["ufp_position"] == 2
  assert f["ufp_position_frac"] == pytest.approx(2 / 5) and f["branches"] == 3
  assert f["block_min_margin"] == pytest.approx(0.4)
  assert f["positions_under_tau"] == 2 and f["ufp_margin_rank"] == 0
  assert f["prefix_min_margin"] == 3.0 and f["prefix_under_tau"] == 0
  assert f["next_margin"] == 2.0 and f["second_lowest_gap"] == pytest.approx(0.4)
  assert f["block_mean_margin"] == pytest.approx((3 + 0.4 + 2 + 0.8 + scorer.MARGIN_CAP) / 5)
  with pytest.raises(ValueError, match="no UFP"):
    scorer.block_features(BlockRecord(0, 0, K, 0, 0, None), 1.0, False)
  # Without margins only the base features.
  data = scorer.dataset([dataclass_replace(r, margins=None)], tau=1.0)
  assert data.names == scorer.BASE_FEATURES and data.x.shape == (1, len(scorer.BASE_FEATURES))


def dataclass_replace(r, **kw):
  import dataclasses
  return dataclasses.replace(r, **kw)


def _synthetic(num_prompts=40, per_prompt=10, seed=0):
  """Useful iff the UFP is at position 1 with an uncertain prefix-free block (a rule the margin
  alone does not reveal): low margin elsewhere is a decoy."""
  rng = np.random.default_rng(seed)
  recs = []
  for p in range(num_prompts):
    for t in range(per_prompt):
      margins = rng.uniform(1.5, 6.0, K - 1)
      ufp = int(rng.integers(1, K))
      margins[ufp - 1] = rng.uniform(0.0, 1.0)
      useful = ufp == 1 and rng.random() < 0.9
      recs.append(_record(p, t, margins, ufp, gain=int(rng.integers(1, 4)) if useful else 0))
  return recs


@pytest.mark.parametrize("kind", ["logreg", "mlp"])
def test_trained_scorer_beats_the_baselines(kind):
  recs = _synthetic()
  data = scorer.dataset(recs, tau=1.0)
  train, test = scorer.split_by_prompt(data, 40)
  assert len(train) == len(test) == 200 and set(train.prompt) == set(range(20))
  model = scorer.train(train, kind=kind, steps=300)
  m = scorer.ranking_metrics(model.score(test.x), test.useful, test.gain)
  rand = scorer.random_metrics(test.useful, test.gain)
  assert m["0.1"]["precision"] >= 0.9
  assert m["0.3"]["extra_token_recall"] > 2 * rand["0.3"]["extra_token_recall"]
  json.dumps(model.to_json())


def test_evaluate_end_to_end():
  out = scorer.evaluate(_synthetic(), tau=1.0, num_prompts=40, kinds=("logreg",), steps=200)
  assert out["gated_blocks"] == 400 and out["test"]["blocks"] == 200
  assert set(out["rankings"]) == {"scorer_logreg", "random", "lowest_margin", "earliest_ufp",
                                  "oracle"}
  assert out["rankings"]["oracle"]["0.1"]["precision"] == 1.0
  assert out["rankings"]["scorer_logreg"]["0.1"]["precision"] >= 0.9
  md = scorer.markdown(out)
  assert "| scorer_logreg |" in md and "paper (Qwen3-8B)" in md
  json.dumps(out)


def test_single_class_training_gives_a_constant_scorer():
  recs = [_record(p, 0, [0.5, 2, 2, 2, 2], 1, gain=0) for p in range(6)]
  data = scorer.dataset(recs, tau=1.0)
  model = scorer.train(data)
  assert "constant scorer" in model.note
  assert np.all(model.score(data.x) == model.score(data.x)[0])
  out = scorer.evaluate(recs, tau=1.0, kinds=("logreg",))
  assert out["useful_blocks"] == 0
  assert out["rankings"]["scorer_logreg"]["0.1"]["extra_token_recall"] is None
