"""Best-first trees: DDTree keeps exactly the best sequences (checked against brute-force
enumeration), and the hybrid's leaf fill adds the best new siblings and nothing else."""

import itertools

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from cure_jax.tree import best_first, candidates as tree_lib


def _paths(t, b):
  """{node: token path from the root (root excluded)} of valid nodes of sequence b."""
  tokens, parent, valid = (np.asarray(x[b]) for x in (t.tokens, t.parent, t.valid))
  out = {}
  for i in np.flatnonzero(valid):
    seq, j = [], i
    while parent[j] >= 0:
      seq.append(int(tokens[j]))
      j = parent[j]
    out[int(i)] = tuple(reversed(seq))
  return out


def _check_shape(t, b, max_depth):
  parent, depth, valid = (np.asarray(x[b]) for x in (t.parent, t.depth, t.valid))
  anc = np.asarray(t.ancestors[b])
  n = int(valid.sum())
  assert valid[:n].all() and not valid[n:].any()             # valid nodes packed first
  assert parent[0] == tree_lib.PAD and depth[0] == 0
  for i in range(1, n):
    assert 0 <= parent[i] < i                                # parents first
    assert depth[i] == depth[parent[i]] + 1 <= max_depth
  for i in range(n):                                         # ancestor mask = closure
    want, j = {i}, i
    while parent[j] >= 0:
      j = parent[j]
      want.add(int(j))
    assert set(np.flatnonzero(anc[i])) == want
  paths = _paths(t, b)
  assert len(set(paths.values())) == len(paths)              # no duplicate sequences


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 3), depth=st.integers(1, 4),
       v_max=st.integers(2, 20), limit=st.integers(0, 4))
def test_ddtree_keeps_exactly_the_best_sequences(seed, k, depth, v_max, limit):
  rng = np.random.default_rng(seed)
  vocab = 7
  logp = -np.sort(rng.exponential(1.0, (2, depth, k)), axis=-1)           # best first
  tokens = np.stack([np.stack([rng.permutation(vocab)[:k] for _ in range(depth)])
                     for _ in range(2)])
  limit = np.array([min(limit, depth), depth])
  t = best_first.ddtree(jnp.array([3, 5]), jnp.asarray(tokens, jnp.int32), jnp.asarray(logp),
                        jnp.asarray(limit, jnp.int32), v_max=v_max)
  for b in range(2):
    _check_shape(t, b, depth)
    assert int(t.tokens[b, 0]) == [3, 5][b]
    # Brute force: every rank sequence within the depth limit, best v_max - 1 by score.
    cands = [(sum(logp[b, d, r] for d, r in enumerate(ranks)), ranks)
             for n in range(1, limit[b] + 1) for ranks in itertools.product(range(k), repeat=n)]
    best = sorted(cands, key=lambda c: -c[0])[:v_max - 1]
    want = {tuple(int(tokens[b, d, r]) for d, r in enumerate(ranks)) for _, ranks in best}
    got = _paths(t, b)
    assert set(got.values()) - {()} == want
    for node, seq in got.items():  # branch 0 (MAIN) = the all-top-1 path
      on_main = all(tok == tokens[b, d, 0] for d, tok in enumerate(seq))
      assert (int(t.branch[b, node]) == best_first.MAIN) == on_main


def _chain(tokens, v_max):
  """A chain tree [B, v_max] over draft tokens [B, D] (root 0)."""
  b, d = tokens.shape
  return tree_lib.build(jnp.zeros((b,), jnp.int32), jnp.asarray(tokens, jnp.int32),
                        jnp.full((b,), d, jnp.int32), v_max=v_max)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), a=st.integers(1, 3), v_max=st.integers(5, 16))
def test_leaf_fill_adds_the_best_new_siblings(seed, a, v_max):
  rng = np.random.default_rng(seed)
  depth, vocab = 4, 6
  draft = rng.integers(0, vocab, (1, depth))
  t = _chain(draft, v_max)
  v = t.size
  own = jnp.where(t.valid, jnp.asarray(-rng.exponential(1.0, (1, v))), 0.0)
  cum = best_first.cumulative(t, own)
  alt_tokens = np.stack([rng.permutation(vocab)[:a] for _ in range(v)])[None]  # may hit a child
  alt_logp = -rng.exponential(1.0, (1, v, a))
  alt_logp[0, 0] = -np.inf                                    # the root offers nothing
  out = best_first.add_leaves(t, cum, jnp.asarray(alt_tokens, jnp.int32),
                              jnp.asarray(alt_logp), branch=7, max_depth=depth)
  _check_shape(out, 0, depth)
  n0 = int(t.valid.sum())
  assert np.array_equal(np.asarray(out.tokens[0, :n0]), np.asarray(t.tokens[0, :n0]))
  assert np.array_equal(np.asarray(out.parent[0, :n0]), np.asarray(t.parent[0, :n0]))
  # Every distinct (parent, token) candidate not already a child, with its best score.
  parent = np.asarray(t.parent[0])
  children = {(int(parent[i]), int(t.tokens[0, i])) for i in range(1, n0)}
  cums = np.asarray(cum[0])
  cand = {}
  for n in range(1, n0):
    for i in range(a):
      key = (int(parent[n]), int(alt_tokens[0, n, i]))
      if key not in children:
        cand[key] = max(cand.get(key, -np.inf), cums[parent[n]] + alt_logp[0, n, i])
  added = {(int(out.parent[0, i]), int(out.tokens[0, i])) for i in range(n0, int(out.valid.sum()))}
  assert added <= set(cand)
  assert all(int(out.branch[0, i]) == 7 for i in range(n0, int(out.valid.sum())))
  free = v - n0
  assert len(added) == min(free, len(cand))
  if added and len(added) < len(cand):                       # best first
    assert min(cand[x] for x in added) >= max(cand[x] for x in set(cand) - added)
