"""method=auto through the loop: the controller's budget is what the target verifies, plain
target steps skip the drafter, the device's cost curve is timed once and cached, and bad
settings end in one line. (Losslessness: tests/test_lossless.py, test_sharding.py,
test_multiprocess.py and test_sampling.py run auto with the other methods.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cure_jax.analysis import random_models
from cure_jax.runtime import cost_curve
from cure_jax.runtime.generation import Generator
from cure_jax.tree import controller, repair

ARCH = random_models.Arch()
BUDGETS = (1, 3, 6)


def _auto(target, drafter, costs=(), **kw):
  """auto with looks at the drafter every 4 iterations unless kw says otherwise, so that a
  16-token run holds some (one without any runs the target-only program)."""
  kw = dict(dict(explore_every=4, explore_overhead=100.0), **kw)
  cure = repair.RepairConfig(tau_margin=1e9, max_depth=ARCH.block_size - 1, topk=3)
  return Generator(target, drafter, method="auto", max_new_tokens=16, cure=cure,
                   auto=controller.Settings(budgets=BUDGETS, costs=costs, **kw))


@pytest.fixture(scope="module")
def pair():
  return random_models.pair(ARCH, 4)


@pytest.mark.parametrize("costs, every", [((1.0, 50.0, 60.0), 4), ((50.0, 60.0, 1.0), 4)],
                         ids=["plain_steps_pay", "whole_tree_pays"])
def test_the_chosen_budget_is_what_the_target_verifies(pair, costs, every):
  target, drafter = pair
  batch = random_models.prompts(4, ARCH.vocab, 2)
  gen = _auto(target, drafter, costs, explore_every=every, explore_overhead=100.0,
              fallback=False)
  # a look at step 0; it cannot pay (drafting 50x a plain step), so the spacing doubles: the
  # next at 8, then 24, past the last step a 16-token run can repay (12)
  looks = {0, 2 * every}
  for r in gen.generate(batch):
    for step, s in enumerate(r.stats):
      cheap = BUDGETS[costs.index(min(costs))]
      explores = cheap == 1 and step in looks   # a plain step turned into the smallest draft
      assert s["budget"] == (BUDGETS[1] if explores else cheap), (step, r.stats)
      assert s["nodes_verified"] <= s["budget"]
      if s["budget"] == 1:                          # a plain target step: one token, no tree
        assert s["nodes_verified"] == 1 and s["accept_lengths"] == 1
      assert s["expected"] >= 1.0


def test_a_look_the_run_cannot_repay_is_not_taken(pair):
  """Drafting 49x dearer than a plain step with 100% of the time allowed for looks: a look
  every 49 iterations, more than a 16-token run has, so every iteration is a plain step (the
  parametrized test above sees the looks when the run can repay them); with the fallback on,
  a run no look falls inside is the target-only program (no budget chosen)."""
  target, drafter = pair
  prompts = random_models.prompts(4, ARCH.vocab, 2)
  want = Generator(target, None, method="ar", max_new_tokens=16).generate(prompts)
  for fallback, budget in ((False, 1), (True, 0)):
    gen = _auto(target, drafter, (1.0, 50.0, 60.0), explore_every=4, explore_overhead=1.0,
                fallback=fallback)
    assert gen.auto.explore_interval == 49 > gen.max_new_tokens
    assert gen.spec(64, batch=2).method == ("ar" if fallback else "auto")
    got = gen.generate(prompts)
    assert all(s["budget"] == budget for r in got for s in r.stats)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_looks_that_do_not_pay_space_out_across_calls(pair):
  """The spacing of looks and the step of the next one carry from call to call: looks at 4
  iterations' spacing that never pay (3 nodes for 2.9 plain steps: a look pays only if the
  batch's rows accept both drafts, which this pair's drafter does not manage) come at steps 0 and 8 of the
  first 16-token call (15 iterations), then 16 apart: step 9 of the next; 32 apart: the one
  after holds none and runs the target-only program, whose 15 iterations bring the next look to
  step 11 of the fourth. Every call emits target-only decoding's tokens."""
  target, drafter = pair
  gen = _auto(target, drafter, (1.0, 2.9, 6.5), explore_every=4, explore_overhead=100.0)
  prompts = random_models.prompts(4, ARCH.vocab, 2)
  want = Generator(target, None, method="ar", max_new_tokens=16).generate(prompts)
  looks = []
  for _ in range(4):
    program = gen.next_spec(prompts).method    # what the call will run, asked beforehand
    got = gen.generate(prompts)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    looks.append([t for t, s in enumerate(got[0].stats) if s["budget"] > 1])
    assert (program == "ar") == (looks[-1] == [])
    for t in looks[-1]:   # the batch's tokens at a look: fewer than 2.9 plain steps' worth
      assert sum(r.stats[t]["accept_lengths"] for r in got) < 2.9 * len(got)
    assert all(s["budget"] == (0 if looks[-1] == [] else 1)
               for r in got for t, s in enumerate(r.stats) if t not in looks[-1])
  assert looks == [[0, 8], [9], [], [11]], looks


@pytest.mark.parametrize("costs, drafts", [((1.0, 3.5, 6.5), False), ((1.0, 2.9, 6.5), True),
                                           ((1.0, 3.5, 5.9), True), ((1.0, 50.0, 60.0), False)])
def test_auto_decodes_target_only_where_no_budget_can_pay(pair, costs, drafts):
  """n nodes give at most n tokens: where C(n) >= n C(1) for every drafting budget n (3 and 6
  here) auto runs the ar program (the same tokens as ar, no budget chosen); where one budget
  could pay it runs the controlled loop."""
  target, drafter = pair
  batch = random_models.prompts(5, ARCH.vocab, 2)
  gen = _auto(target, drafter, costs)
  assert (gen.spec(64, batch=2).method == "auto") == drafts
  assert controller.can_pay(controller.Settings(budgets=BUDGETS, costs=costs)) == drafts
  got = gen.generate(batch)
  want = Generator(target, None, method="ar", max_new_tokens=16).generate(batch)
  assert [r.output_ids for r in got] == [r.output_ids for r in want]
  assert any(s["budget"] for r in got for s in r.stats) == drafts


def test_cost_curve_is_timed_once_and_cached(pair, tmp_path, monkeypatch):
  """Costs C(n) = verify(n) + one drafter pass for n > 1, read back from the cache file. No
  fallback: whether this machine's timings let a budget pay (tiny models: often not) is not what
  is tested here."""
  monkeypatch.setenv("CURE_JAX_CACHE", str(tmp_path))
  target, drafter = pair
  gen = _auto(target, drafter, fallback=False)
  spec = gen.spec(64, batch=2)
  files = list((tmp_path / "costs").glob("*.json"))
  assert len(files) == 1
  curve = json.loads(files[0].read_text())
  assert curve["budgets"] == list(BUDGETS) and curve["batch"] == 2
  # timed directly: the plain step and the drafter pass; a drafted budget's rest of an iteration
  # is its whole iteration less the drafter pass, clamped at 0 (on tiny models under load the
  # difference of two timings can fall below 0)
  assert curve["verify_s"][0] > 0 and curve["draft_s"] > 0
  assert all(t >= 0 for t in curve["verify_s"][1:])
  want = [curve["verify_s"][0]] + [v + curve["draft_s"] for v in curve["verify_s"][1:]]
  assert spec.auto.costs == pytest.approx(want)
  # A second Generator reads the cache (a changed file proves it is read, not re-timed).
  curve["verify_s"] = [1.0, 2.0, 3.0]
  curve["draft_s"] = 0.5
  files[0].write_text(json.dumps(curve))
  assert _auto(target, drafter, fallback=False).spec(64, batch=2).auto.costs == (1.0, 2.5, 3.5)
  # Another batch size is another curve.
  _auto(target, drafter, fallback=False).spec(64, batch=3)
  assert len(list((tmp_path / "costs").glob("*.json"))) == 2
  assert cost_curve.REPEATS >= 3


def _curve_key(target, drafter) -> str:
  """The cost-curve cache key of this pair's auto run at batch 2 (costs given: none timed)."""
  gen = _auto(target, drafter, (1.0, 2.0, 3.0))
  return cost_curve._key(gen.graphdef, gen.params, gen.spec(64, batch=2), 2)


def test_the_cached_curve_is_found_by_another_process(pair):
  """The cache file's name is the same in a fresh process (the graphdef's text holds function
  addresses, which differ per process: a key with them made every run re-time its curve)."""
  code = ("from cure_jax.analysis import random_models; from tests import test_auto as t; "
          "print(t._curve_key(*random_models.pair(t.ARCH, 4)))")
  child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         cwd=Path(__file__).parents[1])
  assert child.returncode == 0, child.stderr[-2000:]
  assert child.stdout.split()[-1] == _curve_key(*pair)


def test_config_errors_name_the_field():
  from cure_jax.runtime import pipeline
  from configs import smollm2_135m
  config = smollm2_135m.get_config()
  config.auto.budgets = "1,4,x"
  with pytest.raises(ValueError, match="auto.budgets"):
    pipeline.auto_settings(config)
  config.auto.budgets = "8,4"
  with pytest.raises(ValueError, match="increasing"):
    pipeline.auto_settings(config)
  config.auto.budgets, config.auto.costs = "1,4", "1.0"
  with pytest.raises(ValueError, match="one positive cost per budget"):
    pipeline.auto_settings(config)
  config.auto.costs = "0.03,0.05"
  assert pipeline.auto_settings(config).costs == (0.03, 0.05)


def test_plain_steps_leave_the_drafter_as_a_fresh_prefill_would(pair):
  """Plain steps keep their rows' features and the drafter takes them in together when the
  plain loop ends (decoding.resync_pending, up to PENDING rows at once): after a run of plain
  steps broken by looks, the drafter's context cache holds what a drafter prefilled on every
  committed token holds, slot for slot (float32; one product over several rows against one
  per row: 1e-5). Taking the rows in at the wrong positions, or not at all, breaks it."""
  import jax.numpy as jnp
  import numpy as np
  from cure_jax.runtime import decoding
  target, drafter = pair
  gen = _auto(target, drafter, (1.0, 50.0, 60.0), explore_every=5, explore_overhead=100.0,
              fallback=False)
  gen.max_new_tokens = 3 * decoding.PENDING
  prompt = random_models.prompts(6, ARCH.vocab, 1)[0]
  spec = gen.spec(128)
  ids = jnp.asarray([prompt], jnp.int32)
  state = decoding.prefill(gen.graphdef, gen.params, ids, jnp.asarray([len(prompt)]), spec=spec)
  state = decoding.decode(gen.graphdef, gen.params, state, spec=spec)
  budgets = np.asarray(state.stats.budget[0, :int(state.iterations[0])])
  assert (budgets == 1).sum() > decoding.PENDING and (budgets > 1).any()   # a full buffer too
  committed = prompt + [int(t) for t in state.tokens[0, :int(state.produced[0]) - 1]]
  fresh = decoding.prefill(gen.graphdef, gen.params, jnp.asarray([committed], jnp.int32),
                           jnp.asarray([len(committed)]), spec=spec)
  n = len(committed)
  assert int(state.dcache.lengths[0]) == int(fresh.dcache.lengths[0]) == n
  for got, want in zip(state.dcache.k + state.dcache.v, fresh.dcache.k + fresh.dcache.v):
    np.testing.assert_allclose(np.asarray(got)[0, :, :n], np.asarray(want)[0, :, :n], atol=1e-5)
