"""The goodput controller's rule (cure_jax/tree/controller.py) against a plain-Python model of it:
expected tokens per second over the batch, exploration, running means, predicted acceptance."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from cure_jax.tree import controller

BUDGETS = (1, 3, 5, 9)


def _py_choose(mass, observed, predicted, active, costs, budgets, step, explore_every,
               overhead=0.02, horizon=10 ** 9):
  rates = []
  for a in range(len(budgets)):
    total = 0.0
    for b in range(len(active)):
      if active[b]:
        c = observed[b] / predicted[b] if predicted[b] > 0 else 1.0
        total += 1.0 + c * mass[b][a]
    rates.append(total / costs[a])
  best = max(range(len(rates)), key=lambda a: (rates[a], -a))
  interval = max(explore_every, math.ceil((costs[1] / costs[0] - 1) / overhead))
  if budgets[best] == 1 and step % interval == 0 and budgets[-1] > 1 and \
      horizon - step >= interval:
    best = next(a for a, n in enumerate(budgets) if n > 1)
  return best, sorted(rates)


def _py_masses(valid, path_logp, budgets):
  return [[sum(math.exp(path_logp[b][i]) for i in range(1, n) if valid[b][i]) for n in budgets]
          for b in range(len(valid))]


def _state(rng, batch):
  mass = rng.uniform(0, 4, (batch, len(BUDGETS))) * (np.array(BUDGETS) > 1)
  return controller.Controller(mass=jnp.asarray(mass, jnp.float32),
                               observed=jnp.asarray(rng.uniform(0, 3, batch), jnp.float32),
                               predicted=jnp.asarray(rng.uniform(0, 3, batch) *
                                                     (rng.random(batch) > 0.2), jnp.float32),
                               seen=jnp.asarray(rng.random(batch) > 0.3))


def test_choice_equals_the_plain_python_rule():
  rng = np.random.default_rng(0)
  checked = set()
  for trial in range(120):
    batch = int(rng.integers(1, 6))
    ctrl = _state(rng, batch)
    active = rng.random(batch) > 0.2
    costs = tuple(float(c) for c in rng.uniform(0.5, 4, len(BUDGETS)))
    cfg = controller.Settings(budgets=BUDGETS, costs=costs, explore_every=3,
                              explore_overhead=0.05)
    step = int(rng.integers(0, 200))
    horizon = int(rng.choice([150, 10 ** 6]))   # a short run takes no look it cannot repay
    want, rates = _py_choose(np.asarray(ctrl.mass, np.float64), np.asarray(ctrl.observed),
                             np.asarray(ctrl.predicted), active, costs, BUDGETS, step, 3, 0.05,
                             horizon)
    if len(rates) > 1 and rates[-1] - rates[-2] < 1e-4 * rates[-1]:
      continue  # a near-tie: float32 may order it either way
    got = int(controller.choose(ctrl, cfg, jnp.asarray(active), step, horizon))
    assert got == want, trial
    checked.add(want)
  assert checked == set(range(len(BUDGETS)))  # every budget was the answer somewhere


def test_masses_and_update_equal_the_plain_python_rule():
  rng = np.random.default_rng(1)
  cfg = controller.Settings(budgets=BUDGETS, costs=(1.0,) * 4, decay=0.75)
  for trial in range(15):
    batch, v = 3, 9
    valid = rng.random((batch, v)) > 0.3
    valid[:, 0] = True
    logp = -rng.uniform(0, 3, (batch, v))
    mass = controller.masses(cfg, jnp.asarray(valid), jnp.asarray(logp, jnp.float32))
    want = _py_masses(valid, logp, BUDGETS)
    np.testing.assert_allclose(mass, want, rtol=1e-5, atol=1e-6)

    ctrl = _state(rng, batch)
    active = rng.random(batch) > 0.3
    arm = int(rng.integers(0, len(BUDGETS)))
    accepted = rng.integers(0, 5, batch)
    new = controller.update(ctrl, cfg, arm, jnp.asarray(active), mass, jnp.asarray(accepted))
    for b in range(batch):
      drafted = active[b] and BUDGETS[arm] > 1
      a = 0.75 if ctrl.seen[b] else 0.0
      blend = lambda old, x: a * old + (1 - a) * x if drafted else old
      np.testing.assert_allclose(new.mass[b], [blend(float(ctrl.mass[b, i]), want[b][i])
                                               for i in range(len(BUDGETS))], rtol=1e-5)
      assert new.observed[b] == pytest.approx(blend(float(ctrl.observed[b]), accepted[b]),
                                              rel=1e-5)
      assert new.predicted[b] == pytest.approx(blend(float(ctrl.predicted[b]), want[b][arm]),
                                               rel=1e-5, abs=1e-6)
      assert bool(new.seen[b]) == (bool(ctrl.seen[b]) or drafted)


def test_a_calibrated_drafter_is_followed_to_the_budget_that_pays():
  """A stationary text: the drafter predicts m(n), the target accepts half of it. Once seen,
  the controller picks the budget with the most true tokens per cost, and a plain target
  step when no draft pays."""
  m = np.array([[0.0, 1.6, 2.4, 3.0]])                       # predicted accepted drafts
  for costs, best in (((1.0, 1.2, 1.4, 1.8), 2), ((1.0, 2.5, 2.6, 2.9), 0)):
    cfg = controller.Settings(budgets=BUDGETS, costs=costs, explore_every=1000)
    ctrl = controller.init(1, len(BUDGETS))
    active = jnp.ones((1,), bool)
    picks = []
    for step in range(1, 30):
      arm = int(controller.choose(ctrl, cfg, active, step, 10 ** 6))
      arm = 1 if step == 1 else arm                            # one look at the drafter
      picks.append(arm)
      ctrl = controller.update(ctrl, cfg, arm, active, jnp.asarray(m, jnp.float32),
                               jnp.asarray([m[0, arm] / 2]))
    true_rate = (1 + m[0] / 2) / np.array(costs)
    assert int(np.argmax(true_rate)) == best
    assert picks[-10:] == [best] * 10, picks


@pytest.mark.parametrize("bad, match", [
    (dict(budgets=(4, 1)), "increasing"), (dict(budgets=()), "increasing"),
    (dict(budgets=(0, 4)), "increasing"), (dict(costs=(1.0, 2.0)), "one positive cost"),
    (dict(costs=(1.0, 0.0, 1.0, 1.0)), "one positive cost"), (dict(decay=1.0), "decay"),
    (dict(explore_every=0), "explore_every"), (dict(explore_overhead=0.0), "explore_overhead")])
def test_bad_settings_name_the_field(bad, match):
  with pytest.raises(ValueError, match=match):
    controller.Settings(**bad).validate()
