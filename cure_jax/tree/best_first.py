"""Best-first trees from a drafter's own marginals: DDTree, and leaf filling for the hybrid.

A one-pass block drafter gives at every depth d a distribution q_d over the token there. DDTree
keeps the v_max - 1 token sequences t_1..t_d (t_i among the top-k of q_i) with the highest
cumulative log-probability sum_i log q_i(t_i): no second drafter pass. Scores only fall along a
path, so the best N sequences are closed under prefixes, and every one of them lies in the best
N of its own depth, whose parents lie in the best N of theirs: a beam of N per depth, then the
best N over all depths, finds them exactly with static shapes.

`add_leaves` fills what a tree leaves free of its node budget with sibling leaves, best first:
candidate i of node n is the i-th best other token of the distribution n was drawn from, hung
under n's parent and scored by the parent's cumulative log-probability plus its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cure_jax.tree.candidates import PAD, Tree, ancestor_mask

MAIN, OFF_MAIN = 0, 1  # Tree.branch of ddtree nodes: on the all-top-1 path, or anywhere else


def _top(score, n: int):
  """Best n of score [B, C] (padded with -inf when C < n): values and indices [B, n]."""
  if score.shape[1] < n:
    score = jnp.pad(score, ((0, 0), (0, n - score.shape[1])), constant_values=-jnp.inf)
  return jax.lax.top_k(score, n)


def ddtree(anchor, top_tokens, top_logp, depth_limit, *, v_max: int) -> Tree:
  """The best-first tree of v_max nodes (root included) over per-depth top-k candidates.

  anchor [B]; top_tokens, top_logp [B, D, k]: the k best tokens at depths 1..D with their log
  probabilities, best first (-inf marks no candidate); depth_limit [B]: deepest usable depth.
  Nodes are ordered best first (ties: shallower first), so every parent precedes its children.
  """
  b, d_max, k = top_tokens.shape
  n = v_max - 1

  def expand(beam, xs):
    score, main = beam                                                      # [B, N]
    tokens, logp, depth = xs                                                # [B, k], [B, k], []
    cand = score[:, :, None] + logp[:, None, :]                             # [B, N, k]
    cand = jnp.where(depth <= depth_limit[:, None, None], cand, -jnp.inf)
    best, flat = _top(cand.reshape(b, -1), n)                               # [B, N]
    parent, rank = flat // k, flat % k
    token = jnp.take_along_axis(tokens, rank, axis=1)
    on_main = jnp.take_along_axis(main, parent, axis=1) & (rank == 0)
    return (best, on_main), (best, token, parent, on_main)

  root = (jnp.full((b, n), -jnp.inf).at[:, 0].set(0.0), jnp.zeros((b, n), bool).at[:, 0].set(True))
  xs = (jnp.moveaxis(top_tokens, 1, 0), jnp.moveaxis(top_logp, 1, 0), jnp.arange(1, d_max + 1))
  _, (score, token, parent, on_main) = jax.lax.scan(expand, root, xs)      # each [D, B, N]

  flat = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, d_max * n)             # [B, D*N], by depth
  score, token, on_main = flat(score), flat(token), flat(on_main)
  depth = jnp.repeat(jnp.arange(1, d_max + 1), n)[None]                     # [1, D*N]
  parent_flat = jnp.where(depth > 1, flat(parent) + (depth - 2) * n, -1)   # -1: the root
  order = jnp.argsort(-score, axis=1, stable=True)[:, :n]                   # [B, N] best first
  slot = jnp.zeros((b, d_max * n), jnp.int32).at[jnp.arange(b)[:, None], order].set(
      jnp.arange(1, n + 1, dtype=jnp.int32))                               # flat index -> slot
  kept = jnp.take_along_axis(score, order, axis=1) > -jnp.inf               # [B, N]
  par = jnp.take_along_axis(parent_flat, order, axis=1)
  par_slot = jnp.where(par >= 0, jnp.take_along_axis(slot, jnp.maximum(par, 0), axis=1), 0)

  def with_root(root_value, x, pad):
    return jnp.concatenate([jnp.full((b, 1), root_value, x.dtype), jnp.where(kept, x, pad)], 1)

  parent = with_root(PAD, par_slot, PAD)
  valid = jnp.concatenate([jnp.ones((b, 1), bool), kept], axis=1)
  return Tree(
      tokens=with_root(0, jnp.take_along_axis(token, order, axis=1), 0).at[:, 0].set(anchor),
      parent=parent,
      depth=with_root(0, jnp.take_along_axis(jnp.broadcast_to(depth, score.shape), order, 1), 0),
      valid=valid,
      branch=with_root(MAIN, jnp.where(jnp.take_along_axis(on_main, order, 1), MAIN, OFF_MAIN),
                       PAD),
      source=with_root(0, order.astype(jnp.int32) + 1, PAD),
      ancestors=ancestor_mask(parent, valid, d_max))


def cumulative(tree: Tree, node_logp):
  """Cumulative log-probability [B, V] of each node's path from its own log-probability [B, V]
  (the root's is ignored)."""
  own = jnp.where(tree.valid & (tree.parent >= 0), node_logp, 0.0)
  return jnp.sum(jnp.where(tree.ancestors, own[:, None, :], 0.0), axis=-1)


def add_leaves(tree: Tree, cum, alt_tokens, alt_logp, *, branch: int, max_depth: int) -> Tree:
  """Fills the free slots of `tree` with its best sibling leaves.

  tree: valid nodes packed first; cum [B, V]: cumulative log-probability of each node;
  alt_tokens, alt_logp [B, V, A]: other tokens of the distribution each node was drawn from,
  with their log-probabilities (-inf: none; give each parent at most one node with
  alternatives, or two of its children could propose the same token). A candidate already among
  the parent's children is skipped. New leaves get Tree.branch = `branch`; max_depth bounds
  the tree's depth (for the ancestor closure).
  """
  b, v = tree.tokens.shape
  a = alt_tokens.shape[-1]
  parent = tree.parent
  has_parent = tree.valid & (parent >= 0)
  base = jnp.take_along_axis(cum, jnp.maximum(parent, 0), axis=1)           # [B, V]
  score = jnp.where(has_parent[..., None], base[..., None] + alt_logp, -jnp.inf)   # [B, V, A]
  siblings = has_parent[:, None, :] & (parent[:, :, None] == parent[:, None, :])    # [B, V, V]
  taken = jnp.any(siblings[..., None] & (tree.tokens[:, None, :, None] ==
                                         alt_tokens[:, :, None, :]), axis=2)        # [B, V, A]
  score = jnp.where(taken, -jnp.inf, score)
  best, flat = _top(score.reshape(b, v * a), v)                             # [B, V]
  node = flat // a
  used = jnp.sum(tree.valid, axis=1)                                        # [B]
  rank = jnp.arange(v)[None]
  new = (best > -jnp.inf) & (rank < v - used[:, None])
  slot = jnp.where(new, used[:, None] + rank, v)                            # v: dropped
  rows = jnp.arange(b)[:, None]

  def put(x, value):
    return x.at[rows, slot].set(value.astype(x.dtype), mode="drop")

  parent_of_new = jnp.take_along_axis(parent, node, axis=1)
  parent = put(parent, parent_of_new)
  valid = put(tree.valid, jnp.ones_like(new))
  return tree.replace(
      tokens=put(tree.tokens, jnp.take_along_axis(alt_tokens.reshape(b, v * a), flat, axis=1)),
      parent=parent,
      depth=put(tree.depth, jnp.take_along_axis(tree.depth, node, axis=1)),
      valid=valid,
      branch=put(tree.branch, jnp.full_like(node, branch)),
      source=put(tree.source, jnp.zeros_like(node)),
      ancestors=ancestor_mask(parent, valid, max_depth))
