"""Greedy tree verification: which candidate path does the target accept, and what comes next.

A node is correct when its token is the target's argmax at its parent; a path is accepted up to
its first incorrect node. The winner is the deepest accepted node (lowest index on ties, which
is branch 0 by the tree's layout); the bonus token is the target's argmax at the winner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from cure_jax.tree import Tree


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
  at_parent = jnp.take_along_axis(target_argmax, jnp.maximum(tree.parent, 0), axis=1)
  correct = (tree.parent < 0) | (tree.tokens == at_parent)
  ok = accepted_nodes(tree, correct)
  reach = jnp.where(ok, tree.depth, -1)
  winner = jnp.argmax(reach, axis=1).astype(jnp.int32)
  b0 = jnp.max(jnp.where(ok & (tree.branch == 0), tree.depth, 0), axis=1)
  return Verdict(
      accepted=jnp.max(reach, axis=1),
      path=path_to(tree, winner, length),
      next_token=jnp.take_along_axis(target_argmax, winner[:, None], axis=1)[:, 0],
      winner=winner,
      branch0_accepted=b0,
  )
