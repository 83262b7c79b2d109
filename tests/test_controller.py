"""The goodput controller's rule (cure_jax/tree/controller.py) against a plain-Python model of it:
expected tokens per second over the batch, exploration, running means, predicted acceptance."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from cure_jax.tree import controller

BUDGETS = (1, 3, 5, 9)


def _py_choose(mass, observed, predicted, active, costs, budgets, step, explore_every,
               overhead=0.02, horizon=10 ** 9, next_look=None, pay=1.0):
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
  next_look = step - step % interval if next_look is None else next_look
  if budgets[best] == 1 and step >= next_look and budgets[-1] > 1 and \
      horizon - step >= interval:
    best = next(a for a, n in enumerate(budgets) if n > 1)
  elif budgets[0] == 1 and pay < 1 and step < next_look:
    best = 0   # drafting realised less than plain steps: plain until the next look
  return best, sorted(rates)


def _py_masses(valid, path_logp, budgets):
  return [[sum(math.exp(path_logp[b][i]) for i in range(1, n) if valid[b][i]) for n in budgets]
          for b in range(len(valid))]


def _state(rng, batch, next_look=0):
  mass = rng.uniform(0, 4, (batch, len(BUDGETS))) * (np.array(BUDGETS) > 1)
  return controller.Controller(mass=jnp.asarray(mass, jnp.float32),
                               observed=jnp.asarray(rng.uniform(0, 3, batch), jnp.float32),
                               predicted=jnp.asarray(rng.uniform(0, 3, batch) *
                                                     (rng.random(batch) > 0.2), jnp.float32),
                               seen=jnp.asarray(rng.random(batch) > 0.3),
                               interval=jnp.asarray(int(rng.integers(1, 300)), jnp.int32),
                               next_look=jnp.asarray(next_look, jnp.int32),
                               pay=jnp.asarray(rng.uniform(0.5, 1.5), jnp.float32))


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
    next_look = int(rng.choice([0, step, step + 1, 10 ** 4]))
    ctrl = ctrl.replace(next_look=jnp.asarray(next_look, jnp.int32))
    want, rates = _py_choose(np.asarray(ctrl.mass, np.float64), np.asarray(ctrl.observed),
                             np.asarray(ctrl.predicted), active, costs, BUDGETS, step, 3, 0.05,
                             horizon, next_look, float(ctrl.pay))
    if len(rates) > 1 and rates[-1] - rates[-2] < 1e-4 * rates[-1]:
      continue  # a near-tie: float32 may order it either way
    got = int(controller.choose(ctrl, cfg, jnp.asarray(active), step, horizon))
    assert got == want, trial
    checked.add(want)
  assert checked == set(range(len(BUDGETS)))  # every budget was the answer somewhere


def test_masses_and_update_equal_the_plain_python_rule():
  rng = np.random.default_rng(1)
  cfg = controller.Settings(budgets=BUDGETS, costs=(1.0, 2.0, 2.5, 4.0), decay=0.75)
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
    step = int(rng.integers(0, 100))
    new = controller.update(ctrl, cfg, arm, jnp.asarray(active), mass, jnp.asarray(accepted),
                            step)
    drafted_any = BUDGETS[arm] > 1 and active.any()
    ratio = (sum(1 + accepted[b] for b in range(batch) if active[b]) * cfg.costs[0] /
             (max(active.sum(), 1) * cfg.costs[arm]))
    pays = ratio >= 1
    interval = ((cfg.explore_interval if pays else 2 * int(ctrl.interval)) if drafted_any
                else int(ctrl.interval))
    assert int(new.interval) == interval
    assert int(new.next_look) == (step + interval if drafted_any else int(ctrl.next_look))
    kept = 0.75 if ctrl.seen.any() else 0.0
    assert float(new.pay) == pytest.approx(kept * float(ctrl.pay) + (1 - kept) * ratio
                                           if drafted_any else float(ctrl.pay), rel=1e-5)
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
    ctrl = controller.init(1, cfg, next_look=10 ** 6)
    active = jnp.ones((1,), bool)
    picks = []
    for step in range(1, 30):
      arm = int(controller.choose(ctrl, cfg, active, step, 10 ** 6))
      arm = 1 if step == 1 else arm                            # one look at the drafter
      picks.append(arm)
      ctrl = controller.update(ctrl, cfg, arm, active, jnp.asarray(m, jnp.float32),
                               jnp.asarray([m[0, arm] / 2]), step)
    true_rate = (1 + m[0] / 2) / np.array(costs)
    assert int(np.argmax(true_rate)) == best
    assert picks[-10:] == [best] * 10, picks


def _py_looks(pays, base: int, steps: int) -> list[int]:
  """The steps at which a run of plain steps looks at the drafter, in the plain-Python rule:
  the first at step 0; after a look that fails to pay the spacing doubles, after one that pays
  it is the base again. pays(i): whether the i-th look pays (one that pays is followed by plain
  steps here too: the drafter's means are kept low)."""
  looks, interval, next_look = [], base, 0
  for step in range(steps):
    if step >= next_look:
      interval = base if pays(len(looks)) else 2 * interval
      looks.append(step)
      next_look = step + interval
  return looks


@pytest.mark.parametrize("pays", [lambda i: False, lambda i: True, lambda i: i % 3 == 2],
                         ids=["never", "always", "every_third"])
def test_looks_back_off_while_they_fail_to_pay(pays):
  """The loop's spacing of looks against the plain-Python rule: with looks that never pay,
  a 2,000-step run looks 6 times where a fixed spacing of 20 would look 100 times."""
  budgets, costs, base = (1, 4, 8), (1.0, 2.0, 3.0), 20
  cfg = controller.Settings(budgets=budgets, costs=costs, explore_every=base,
                            explore_overhead=1.0)
  assert cfg.explore_interval == base
  ctrl = controller.init(1, cfg)
  active = jnp.ones((1,), bool)
  zero = jnp.zeros((1, len(budgets)), jnp.float32)   # the drafter predicts nothing: plain wins
  looks = []
  for step in range(2000):
    arm = int(controller.choose(ctrl, cfg, active, step, 10 ** 6))
    if budgets[arm] > 1:
      accepted = 1.0 if pays(len(looks)) else 0.0    # 2 tokens for twice a plain step's cost
      looks.append(step)
      ctrl = controller.update(ctrl, cfg, arm, active, zero, jnp.asarray([accepted]), step)
  assert looks == _py_looks(pays, base, 2000)
  if not any(pays(i) for i in range(len(looks))):
    assert looks == [0, 40, 120, 280, 600, 1240]


def _py_run(draws, mass, costs, budgets, base, decay):
  """The budgets a batch-1 run takes in the plain-Python rule, choice and update together:
  draws[t] the drafts the target would accept at step t (at most n - 1 of n nodes), mass the
  drafter's m(n) each iteration. Returns the budget index per step and the steps at which the
  means chose drafting and the realised pay held it back."""
  means, obs, pred, seen, interval, next_look, pay, out, held = [0.0] * len(budgets), 0.0, 0.0, \
      False, base, 0, 1.0, [], []
  for step, draw in enumerate(draws):
    c = obs / pred if pred > 0 else 1.0
    rates = [(1.0 + c * means[a]) / costs[a] for a in range(len(budgets))]
    arm = max(range(len(rates)), key=lambda a: (rates[a], -a))
    due = step >= next_look
    if budgets[arm] == 1 and due:
      arm = 1                                    # a look (the horizon is far)
    elif pay < 1 and not due:
      held += [step] if budgets[arm] > 1 else []
      arm = 0                                    # drafting realised a loss: wait for a look
    out.append(arm)
    if budgets[arm] == 1:
      continue
    accepted = min(draw, budgets[arm] - 1)
    a = decay if seen else 0.0
    ratio = (1 + accepted) * costs[0] / costs[arm]
    means = [a * old + (1 - a) * x for old, x in zip(means, mass)]
    obs, pred, pay = a * obs + (1 - a) * accepted, a * pred + (1 - a) * mass[arm], \
        a * pay + (1 - a) * ratio
    seen = True
    interval = base if ratio >= 1 else min(2 * interval, controller.LONGEST)
    next_look = step + interval
  return out, held


@pytest.mark.parametrize("p, mass", [([0.55, 0.25, 0.12, 0.08], [0.0, 0.5, 2.5, 3.0]),
                                     ([0.15, 0.15, 0.2, 0.5], [0.0, 0.8, 2.0, 3.5])],
                         ids=["overpredicted", "drafting_pays"])
def test_drafting_waits_for_a_look_while_it_realises_a_loss(p, mass):
  """A drafter whose own prediction may promise more of the larger budgets than the target
  accepts: the loop's budgets over 600 steps equal the plain-Python rule's, in which drafting
  chosen on merit stops, until the next look, once the running mean of what drafted iterations
  realised (tokens per second over plain steps') is below 1."""
  costs = (1.0, 1.3, 1.7, 2.3)
  rng = np.random.default_rng(3)
  draws = [int(x) for x in rng.choice(4, 600, p=p)]
  cfg = controller.Settings(budgets=BUDGETS, costs=costs, decay=0.8, explore_every=4,
                            explore_overhead=0.05)
  ctrl = controller.init(1, cfg)
  active = jnp.ones((1,), bool)
  got = []
  for step, draw in enumerate(draws):
    arm = int(controller.choose(ctrl, cfg, active, step, 10 ** 6))
    got.append(arm)
    if BUDGETS[arm] > 1:
      accepted = min(draw, BUDGETS[arm] - 1)
      ctrl = controller.update(ctrl, cfg, arm, active, jnp.asarray([mass], jnp.float32),
                               jnp.asarray([accepted], jnp.float32), step)
  want, held = _py_run(draws, mass, costs, BUDGETS, cfg.explore_interval, 0.8)
  assert got == want
  merit = [t for t in range(1, 600) if BUDGETS[got[t]] > 1 and BUDGETS[got[t - 1]] > 1]
  assert merit                           # the means chose drafting right after a draft
  assert held                            # and held it back after stretches that lost


@pytest.mark.parametrize("bad, match", [
    (dict(budgets=(4, 1)), "increasing"), (dict(budgets=()), "increasing"),
    (dict(budgets=(0, 4)), "increasing"), (dict(costs=(1.0, 2.0)), "one positive cost"),
    (dict(costs=(1.0, 0.0, 1.0, 1.0)), "one positive cost"), (dict(decay=1.0), "decay"),
    (dict(explore_every=0), "explore_every"), (dict(explore_overhead=0.0), "explore_overhead")])
def test_bad_settings_name_the_field(bad, match):
  with pytest.raises(ValueError, match=match):
    controller.Settings(**bad).validate()
