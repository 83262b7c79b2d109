"""Greedy tree verification: which candidate path does the target accept, and what comes next.

A node is correct when its token is the target's argmax at its parent; a path is accepted up to
its first incorrect node. The winner is the deepest accepted node (lowest index on ties, which
is branch 0 by the tree's layout); the bonus token is the target's argmax at the winner.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from cure_jax.tree import sampling
from cure_jax.tree.candidates import Tree


@struct.dataclass
class Verdict:
  accepted: jax.Array          # [B] accepted draft tokens a (the root not counted)
  path: jax.Array              # [B, K] node index at depth 0..K-1 along the winner (0 past a)
  next_token: jax.Array        # [B] the bonus token
  winner: jax.Array            # [B] winning node index
  branch0_accepted: jax.Array  # [B] what branch 0 alone would have accepted


def path_to(tree: Tree, node, length: int):
  """Node indices [B, length] of the ancestors of node [B] by depth (0 past its depth)."""
  anc = jnp.take_along_axis(tree.ancestors, node[:, None, None], axis=1)[:, 0]   # [B, V]
  at_depth = anc[:, None, :] & (tree.depth[:, None, :] == jnp.arange(length)[None, :, None])
  return jnp.argmax(at_depth, axis=-1).astype(jnp.int32)


def accepted_nodes(tree: Tree, correct):
  """Nodes whose whole root path is correct; correct [B, V] (the root counts as correct)."""
  ok = correct & tree.valid
  return tree.valid & ~jnp.any(tree.ancestors & ~ok[:, None, :], axis=-1)


def greedy(tree: Tree, target_argmax, length: int) -> Verdict:
  """target_argmax [B, V]: the target's greedy token after each node."""
  chex.assert_equal_shape([target_argmax, tree.tokens, tree.parent, tree.depth, tree.valid])
  chex.assert_type([target_argmax, tree.tokens, tree.parent], int)
  at_parent = jnp.take_along_axis(target_argmax, jnp.maximum(tree.parent, 0), axis=1)
  correct = (tree.parent < 0) | (tree.tokens == at_parent)
  ok = accepted_nodes(tree, correct)
  reach = jnp.where(ok, tree.depth, -1)
  winner = jnp.argmax(reach, axis=1).astype(jnp.int32)
  b0 = jnp.max(jnp.where(ok & (tree.branch == 0), tree.depth, 0), axis=1)
  path = path_to(tree, winner, length)
  chex.assert_shape(path, (tree.tokens.shape[0], length))
  return Verdict(
      accepted=jnp.max(reach, axis=1),
      path=path,
      next_token=jnp.take_along_axis(target_argmax, winner[:, None], axis=1)[:, 0],
      winner=winner,
      branch0_accepted=b0,
  )


def _children(tree: Tree, node, slots: int):
  """The first `slots` children of node [B] in index order (branch 0 first): [B, C], valid."""
  is_child = tree.valid & (tree.parent == node[:, None])
  idx = jnp.arange(tree.size)[None]
  kids = jnp.argsort(jnp.where(is_child, idx, tree.size + idx), axis=1)[:, :slots]
  return kids.astype(jnp.int32), jnp.take_along_axis(is_child, kids, axis=1)


def _row(x, index):
  """x [B, V, N], index [B] -> [B, N]."""
  return jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]


def stochastic(tree: Tree, p, q, deterministic, key, length: int, max_children: int) -> Verdict:
  """Lossless verification of a tree built from drafter outputs under sampling.

  p: [B, V, N] the target's warped distribution after each node; q: [B, V, N] the drafter's
  distribution each node's token was drawn from; deterministic: [B, V] nodes placed by rank (a
  one-hot q). Walking from the root, the children of the current node are tested in index order:
  a child x is accepted with probability min(1, r(x) / q(x)); on rejection the residual becomes
  r <- normalize(max(r - q, 0)). When no child is accepted the bonus token is drawn from r.
  """
  b, v = tree.tokens.shape
  chex.assert_shape(p, (b, v, None))
  chex.assert_type(p, float)
  if q is not None:  # None where no node is ever tested (a root-only tree)
    chex.assert_equal_shape([p, q])
    chex.assert_shape(deterministic, (b, v))
  n_vocab = p.shape[-1]
  node = jnp.zeros((b,), jnp.int32)
  alive = jnp.ones((b,), bool)
  accepted = jnp.zeros((b,), jnp.int32)
  final = _row(p, node)
  for depth in range(length - 1):
    r = _row(p, node)
    chosen = jnp.full((b,), -1, jnp.int32)
    kids, kid_ok = _children(tree, node, max_children)
    for c in range(max_children):
      key, sub = sampling.split(key)
      kid = kids[:, c]
      test = alive & kid_ok[:, c] & (chosen < 0)
      x = jnp.take_along_axis(tree.tokens, kid[:, None], axis=1)[:, 0]
      det = jnp.take_along_axis(deterministic, kid[:, None], axis=1)[:, 0]
      q_row = jnp.where(det[:, None], jax.nn.one_hot(x, n_vocab), _row(q, kid))
      qx = jnp.take_along_axis(q_row, x[:, None], axis=1)[:, 0]
      rx = jnp.take_along_axis(r, x[:, None], axis=1)[:, 0]
      take = test & (sampling.uniform(sub) * qx < rx)
      chosen = jnp.where(take, kid, chosen)
      residual = jnp.maximum(r - q_row, 0.0)
      total = jnp.sum(residual, axis=-1, keepdims=True)
      residual = jnp.where(total > 0, residual / jnp.maximum(total, 1e-30), r)
      r = jnp.where((test & ~take)[:, None], residual, r)
    stop = alive & (chosen < 0)
    final = jnp.where(stop[:, None], r, final)
    descend = alive & (chosen >= 0)
    node = jnp.where(descend, chosen, node)
    accepted = accepted + descend
    alive = descend
  final = jnp.where(alive[:, None], _row(p, node), final)
  path = path_to(tree, node, length)
  on_b0 = jnp.take_along_axis(tree.branch, path, axis=1) == 0
  steps = jnp.arange(length)[None]
  return Verdict(
      accepted=accepted,
      path=path,
      next_token=sampling.draw(key, final),
      winner=node,
      branch0_accepted=jnp.sum(on_b0 & (steps >= 1) & (steps <= accepted[:, None]), axis=1),
  )
