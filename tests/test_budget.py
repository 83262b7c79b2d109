"""The online budget: the repair tree runs exactly when the efficiency model says it pays (or on
an exploration step), per sequence, inside the compiled loop."""

import jax.numpy as jnp
import numpy as np

from cure_jax.tree import budget, repair
from cure_jax.analysis import random_models
from cure_jax.runtime.generation import Generator

ARCH = random_models.Arch()


def test_the_rule_is_the_efficiency_model():
  cfg = repair.RepairConfig(v_max=24, max_depth=5, cost_draft=2.0, cost_redraft=1.5,
                            cost_verify_base=4.0, cost_verify_per_node=0.25, explore_every=5)
  k = ARCH.block_size
  rng = np.random.default_rng(0)
  tau0 = rng.uniform(1.0, 4.0, 64)
  gain = rng.uniform(0.0, 2.0, 64)
  for step in (1, 5):
    got = np.asarray(budget.want_tree(budget.Budget(jnp.asarray(tau0), jnp.asarray(gain)),
                                      jnp.asarray(step), cfg, k))
    rate_tree = (tau0 + gain) / (2.0 + 1.5 + 4.0 + 0.25 * 24)
    rate_chain = tau0 / (2.0 + 4.0 + 0.25 * k)
    want = (rate_tree > rate_chain) | (step % 5 == 0)
    assert np.array_equal(got, want)
    assert 0 < want.sum() < 64 or step == 5                  # both answers occur


def test_running_means_follow_what_each_sequence_saw():
  cfg = repair.RepairConfig(max_depth=5, online_decay=0.5)
  b = budget.Budget(tau0=jnp.array([2.0, 2.0, 2.0]), gain=jnp.array([1.0, 1.0, 1.0]))
  out = budget.update(b, cfg, active=jnp.array([True, True, False]),
                      tried=jnp.array([True, False, True]), accepted=jnp.array([5, 2, 9]),
                      branch0_accepted=jnp.array([3, 2, 0]))
  np.testing.assert_allclose(out.tau0, [(2 + 4) / 2, (2 + 3) / 2, 2.0])  # inactive: frozen
  np.testing.assert_allclose(out.gain, [(1 + 2) / 2, 1.0, 1.0])          # only where a tree ran


def _tree_iterations(result):
  """Per iteration: did the gate place repair paths (the tree was built)."""
  return [bool(s["ufp_positions"]) for s in result.stats]


def test_in_the_loop_the_tree_runs_only_when_it_pays():
  target, drafter = random_models.pair(ARCH, 1)
  prompts = random_models.prompts(1, ARCH.vocab, 2)
  k = ARCH.block_size
  base = dict(tau_margin=1e9, v_max=24, max_depth=k - 1)
  never = repair.RepairConfig(online=True, cost_verify_per_node=100.0, explore_every=4, **base)
  free = repair.RepairConfig(online=True, cost_redraft=0.0, cost_verify_per_node=0.0,
                             online_decay=0.99, **base)
  plain = Generator(target, drafter, method="cure", max_new_tokens=24,
                    cure=repair.RepairConfig(**base)).generate(prompts)
  for r in Generator(target, drafter, method="cure", max_new_tokens=24,
                     cure=never).generate(prompts):
    ran = _tree_iterations(r)
    assert all(ran[t] == (t % 4 == 0) for t in range(len(ran))), ran
  for r, p in zip(Generator(target, drafter, method="cure", max_new_tokens=24,
                            cure=free).generate(prompts), plain):
    # A free tree with a positive prior gain runs like plain cure (same trees, same tokens).
    assert r.output_ids == p.output_ids
    assert [s["nodes_verified"] for s in r.stats] == [s["nodes_verified"] for s in p.stats]


def test_unset_online_costs_are_timed_on_the_device_and_cached(tmp_path, monkeypatch):
  """All four costs 0: the Spec carries C_d, C_r and the line through the measured C_v(K) and
  C_v(v_max), read back from the cache file (a changed file proves it is read); decoding with
  them is still target-only decoding."""
  import json
  monkeypatch.setenv("CURE_JAX_CACHE", str(tmp_path))
  target, drafter = random_models.pair(ARCH, 2)
  k = ARCH.block_size
  cure = repair.RepairConfig(tau_margin=1e9, v_max=24, max_depth=k - 1, online=True,
                             cost_draft=0.0, cost_redraft=0.0, cost_verify_base=0.0,
                             cost_verify_per_node=0.0)
  gen = Generator(target, drafter, method="cure", max_new_tokens=16, cure=cure)
  spec = gen.spec(64, batch=2)
  (path,) = (tmp_path / "costs").glob("online-*.json")
  got = json.loads(path.read_text())
  assert got["nodes"] == [k, 24] and got["batch"] == 2
  assert min(got["verify_s"]) > 0 and got["draft_repair_s"] > 0 and got["draft_s"] > 0
  path.write_text(json.dumps(dict(got, draft_s=2.0, draft_repair_s=5.0, verify_s=[4.0, 13.0])))
  spec = Generator(target, drafter, method="cure", max_new_tokens=16, cure=cure).spec(64, 2)
  slope = (13.0 - 4.0) / (24 - k)
  assert spec.cure.costs == (2.0, 3.0, 4.0 - slope * k, slope)
  prompts = random_models.prompts(2, ARCH.vocab, 2)
  want = [r.output_ids for r in Generator(target, method="ar", max_new_tokens=16).generate(prompts)]
  assert [r.output_ids for r in gen.generate(prompts)] == want
  assert spec.cure.costs != gen.spec(64, 1).cure.costs   # batch 1 is timed on its own
