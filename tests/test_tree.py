"""Invariants of the gate and the static-shape repair tree over many random drafts and budgets."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from cure_jax.tree import repair, candidates as tree_lib

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def cases(draw):
  k = draw(st.sampled_from([3, 6]))
  vocab = 8
  b_max = draw(st.integers(1, 5))
  cfg = repair.RepairConfig(
      tau_margin=draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, 1e9])),
      margin_scale=draw(st.sampled_from([0.5, 2.0, 8.0])),
      b_min=draw(st.integers(1, b_max)), b_max=b_max,
      dynamic=draw(st.booleans()),
      select=draw(st.sampled_from(repair.SELECT_RULES)),
      max_repair_positions=draw(st.integers(1, 3)),
      max_depth=draw(st.integers(1, k - 1)),
      v_max=draw(st.integers(k, 3 * k)),
      beam_width=draw(st.integers(1, 6)),
      keep_branch0=draw(st.booleans()))
  seed = draw(st.integers(0, 2**31 - 1))
  return k, vocab, cfg, seed


def _random_block(k, vocab, seed, batch=3):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(batch, k - 1, vocab)) * rng.uniform(0.3, 4.0), jnp.float32)
  anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
  limit = jnp.asarray(rng.integers(0, k, batch), jnp.int32)
  lengths = jnp.asarray(rng.integers(0, 50, batch), jnp.int32)
  redraft = jnp.asarray(rng.integers(0, vocab, (batch, 8, k - 1)), jnp.int32)
  return logits, anchor, limit, lengths, redraft


def _tree(k, vocab, cfg, seed):
  logits, anchor, limit, lengths, redraft = _random_block(k, vocab, seed)
  limit = jnp.minimum(limit, cfg.max_depth)
  draft = jnp.argmax(logits, -1).astype(jnp.int32)
  gate, alts = repair.select(logits, draft, limit, cfg)
  depth, alt, valid = repair.repair_paths(gate, alts, cfg.num_paths)
  d = jnp.arange(1, k)[None, None]
  j = depth[..., None]
  rows = jnp.where(d < j, draft[:, None], jnp.where(d == j, alt[..., None],
                                                    redraft[:, :depth.shape[1]]))
  t = tree_lib.build(anchor, draft, limit, v_max=cfg.v_max, keep_branch0=cfg.keep_branch0,
                     path_tokens=rows, path_depth=depth, path_valid=valid)
  return logits, draft, limit, lengths, gate, t


@SETTINGS
@given(cases())
def test_tree_invariants(case):
  k, vocab, cfg, seed = case
  logits, draft, limit, lengths, gate, t = _tree(k, vocab, cfg, seed)
  tokens, parent, depth, valid, branch, anc = map(np.asarray, (t.tokens, t.parent, t.depth,
                                                               t.valid, t.branch, t.ancestors))
  draft, limit = np.asarray(draft), np.asarray(limit)
  assert t.size <= cfg.v_max
  for b in range(tokens.shape[0]):
    assert valid[b, 0] and parent[b, 0] == -1 and depth[b, 0] == 0 and branch[b, 0] == 0
    for i in np.flatnonzero(valid[b])[1:]:
      p = parent[b, i]
      assert 0 <= p < i and valid[b, p]
      assert depth[b, i] == depth[b, p] + 1 <= limit[b]
    # Ancestor closure including self, computed by walking parents in Python.
    for i in range(t.size):
      expect = np.zeros(t.size, bool)
      node = i
      while node >= 0:
        expect[node] = True
        node = parent[b, node] if valid[b, i] else -1
      np.testing.assert_array_equal(anc[b, i], expect)
    # Padding is invisible to every valid node.
    assert not anc[b][np.ix_(valid[b], ~valid[b])].any()
    # Branch 0 is the draft; with keep_branch0 it is whole up to the depth limit.
    b0 = valid[b] & (branch[b] == 0)
    for i in np.flatnonzero(b0)[1:]:
      assert tokens[b, i] == draft[b, depth[b, i] - 1]
    if cfg.keep_branch0:
      assert sorted(depth[b][b0]) == list(range(limit[b] + 1))
    # Siblings carry distinct tokens.
    for p in np.unique(parent[b][valid[b]]):
      kids = tokens[b][valid[b] & (parent[b] == p)]
      assert len(set(kids.tolist())) == len(kids)
  old, new = map(np.asarray, t.attention_mask(jnp.arange(60)[None] < lengths[:, None]))
  np.testing.assert_array_equal(np.asarray(t.positions(lengths)),
                                np.asarray(lengths)[:, None] + depth)
  np.testing.assert_array_equal(old[:, 0], np.arange(60)[None] < np.asarray(lengths)[:, None])
  assert not new[np.asarray(valid)[:, :, None] & ~np.asarray(valid)[:, None, :]].any()


@SETTINGS
@given(cases())
def test_gate_picks_low_margins_with_the_budget_rule(case):
  k, vocab, cfg, seed = case
  logits, _, limit, _, gate, _ = _tree(k, vocab, cfg, seed)
  top = np.sort(np.asarray(logits), -1)
  margins = top[..., -1] - top[..., -2]
  pos, marg, br = map(np.asarray, (gate.positions, gate.margins, gate.branches))
  limit = np.asarray(limit)
  for b in range(pos.shape[0]):
    eligible = [j for j in range(k - 1) if margins[b, j] < cfg.tau_margin and j < limit[b]]
    chosen = [p - 1 for p in pos[b] if p > 0]
    assert len(chosen) == min(len(eligible), cfg.max_repair_positions)
    assert set(chosen) <= set(eligible)
    if cfg.select == "margin":
      best = sorted(eligible, key=lambda j: (margins[b, j], j))[:len(chosen)]
      np.testing.assert_allclose(margins[b, chosen], margins[b, best], rtol=1e-6)
    if cfg.select == "earliest":
      assert chosen == eligible[:len(chosen)]
    for slot, j in enumerate(chosen):
      np.testing.assert_allclose(marg[b, slot], margins[b, j], rtol=1e-5, atol=1e-6)
      u = np.clip(1 - margins[b, j] / cfg.margin_scale, 0, 1)
      want = cfg.b_min + np.round(u * (cfg.b_max - cfg.b_min)) if cfg.dynamic else cfg.b_max
      assert br[b, slot] == want


def test_invalid_settings_are_refused_with_the_fix():
  import pytest
  for bad, match in [(dict(tau_margin=-1.0), "tau_margin"), (dict(b_min=4, b_max=2), "b_min"),
                     (dict(v_max=4), "v_max"), (dict(select="best"), "select"),
                     (dict(max_depth=20), "max_depth")]:
    with pytest.raises(ValueError, match=match):
      repair.RepairConfig(**bad).validate(block_size=16)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6))
def test_top_k_passes_equal_lax_top_k_ties_included(seed, k):
  """The passes repair.top_k takes off NVIDIA GPUs against jax.lax.top_k (what it takes on
  them): the same values and indices, equal values to the lower index first. Values drawn from
  a few levels, with -inf among them, so ties are everywhere; each row has k finite values at
  least (a draft vocabulary of k tokens or more: past them the passes would repeat an index)."""
  rng = np.random.default_rng(seed)
  x = rng.choice(np.array([-np.inf, -1.0, 0.0, 0.5, 2.0], np.float32), size=(3, 4, 40))
  x[..., rng.permutation(40)[:k]] = rng.choice(np.array([-1.0, 0.5], np.float32), (3, 4, k))
  values, indices = repair._top_k_passes(jnp.asarray(x), k)
  want_values, want_indices = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
  np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_max_argmax_is_numpys_max_and_argmax(seed):
  """layers.max_argmax (the target's greedy token, each top-k pass; on CPU two plain
  reductions) against numpy: the maximum and its first index, over few levels so that ties are
  everywhere, rows all -inf, and a NaN taken as the maximum at its first place, as np.argmax
  takes it."""
  from cure_jax.models.layers import max_argmax
  rng = np.random.default_rng(seed)
  x = rng.choice(np.array([-np.inf, -1.0, 0.0, 0.5, 2.0], np.float32), size=(3, 5, 33))
  x[0, 0] = -np.inf
  x[1, 2, rng.integers(33, size=2)] = np.nan
  values, indices = jax.jit(max_argmax)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(indices), x.argmax(-1))
  np.testing.assert_array_equal(np.asarray(values), x.max(-1))
  assert indices.dtype == jnp.int32
