"""The static-shape candidate tree verified by the target in one forward pass.

Layout before compaction ("raw" nodes): node 0 is the root (the anchor, the last committed
token, not yet in the target cache); nodes 1..K-1 are branch 0, the unmodified draft; then R
repair paths of K-1 depth slots each. A repair path r starts at its focal depth j_r, hangs off
branch 0's node at depth j_r - 1, and holds K-1-j_r+1 nodes. Kept nodes are ordered branch 0
first (by depth), then repair nodes breadth first (by depth, then path rank), cut to `v_max`,
and packed to the front: so every parent sits before its children, and ties between equally
long accepted paths resolve to branch 0 by taking the lowest index.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

PAD = -1


@struct.dataclass
class Tree:
  tokens: jax.Array     # [B, V] int32
  parent: jax.Array     # [B, V] int32, PAD for the root and for padding
  depth: jax.Array      # [B, V] int32, 0 for the root
  valid: jax.Array      # [B, V] bool
  branch: jax.Array     # [B, V] int32: 0 = branch 0 (and root), r + 1 = repair path r, PAD = padding
  source: jax.Array     # [B, V] int32: raw node index (root 0, branch 0 1..K-1, path r depth d
                        # at K + r * (K-1) + d - 1), to look up what each node was drawn from
  ancestors: jax.Array  # [B, V, V] bool: row i = ancestors of i including i; padding sees itself

  @property
  def size(self) -> int:
    return self.tokens.shape[1]

  def positions(self, lengths):
    """Absolute positions [B, V]: committed length + depth."""
    return lengths[:, None] + self.depth

  def attention_mask(self, cache_visible):
    """The tree attention mask as Qwen3 takes it: over the cache, the committed slots of each
    sequence [B, 1, S], one row for all its nodes; over the nodes, each node's own ancestors
    [B, V, V]. A padding node sees the committed slots too (its output is never read): one
    row per sequence is what the attention kernels then read (per node, 1 MB a layer at 256
    nodes of Qwen3-8B)."""
    return cache_visible[:, None, :], self.ancestors

  def prefix(self, n: int) -> "Tree":
    """The first n nodes (a subtree when no node among them has a parent beyond them)."""
    return jax.tree.map(lambda x: x[:, :n], self).replace(ancestors=self.ancestors[:, :n, :n])


def _gather(x, index):
  """x [B, N], index [B, M] (PAD allowed) -> [B, M] (PAD positions read slot 0)."""
  return jnp.take_along_axis(x, jnp.maximum(index, 0), axis=1)


def ancestor_mask(parent, valid, max_depth: int):
  """Ancestor closure by walking parent pointers max_depth times: [B, V, V]."""
  v = parent.shape[1]
  eye = jnp.eye(v, dtype=bool)[None]
  anc = eye & valid[:, :, None]
  hop = parent
  for _ in range(max_depth):
    anc = anc | (jax.nn.one_hot(hop, v, dtype=bool) & (hop >= 0)[:, :, None])
    hop = jnp.where(hop >= 0, _gather(parent, hop), PAD)
  return anc | (eye & ~valid[:, :, None])


def build(anchor, draft, depth_limit, *, v_max: int, keep_branch0: bool = True,
          path_tokens=None, path_depth=None, path_valid=None) -> Tree:
  """Merges branch 0 and optional repair paths into one padded tree of v_max nodes.

  anchor: [B]; draft: [B, K-1] branch 0; depth_limit: [B] deepest usable depth (nodes deeper
  than it are dropped: they could not be committed). path_tokens: [B, R, K-1] the full token
  row of each repair path (only depths >= path_depth are used); path_depth: [B, R] focal depth
  j_r in 1..K-1; path_valid: [B, R].
  """
  chex.assert_rank(draft, 2)
  b, km1 = draft.shape
  k = km1 + 1
  chex.assert_shape([anchor, depth_limit], (b,))
  chex.assert_type([anchor, draft, depth_limit], int)
  if path_tokens is None:
    path_tokens = jnp.zeros((b, 0, km1), draft.dtype)
    path_depth = jnp.zeros((b, 0), jnp.int32)
    path_valid = jnp.zeros((b, 0), bool)
  chex.assert_shape(path_tokens, (b, None, km1))
  r = path_tokens.shape[1]
  chex.assert_shape([path_depth, path_valid], (b, r))
  chex.assert_type([path_tokens, path_depth, path_valid], [int, int, bool])
  d = jnp.arange(1, k)                                                      # [K-1]

  # Branch 0 (with the root first).
  any_path = jnp.any(path_valid, axis=1)                                    # [B]
  deepest_parent = jnp.max(jnp.where(path_valid, path_depth - 1, -1), axis=1, initial=-1)
  b0_keep = keep_branch0 | ~any_path[:, None] | (d[None] <= deepest_parent[:, None])
  b0_tokens = jnp.concatenate([anchor[:, None], draft], axis=1)            # [B, K]
  b0_depth = jnp.broadcast_to(jnp.arange(k), (b, k))
  b0_parent = jnp.broadcast_to(jnp.arange(k) - 1, (b, k))
  b0_valid = jnp.concatenate([jnp.ones((b, 1), bool), b0_keep], axis=1)
  b0_branch = jnp.zeros((b, k), jnp.int32)

  # Repair paths: raw index of (path p, depth dd) is K + p * (K-1) + dd - 1.
  p_idx = jnp.arange(r)[:, None]                                            # [R, 1]
  raw = k + p_idx * km1 + d[None] - 1                                       # [R, K-1]
  p_depth = jnp.broadcast_to(d, (b, r, km1))
  j = path_depth[:, :, None]                                                # [B, R, 1]
  p_parent = jnp.where(d[None, None] == j, j - 1, raw[None] - 1)
  p_valid = path_valid[:, :, None] & (d[None, None] >= j)
  p_branch = jnp.broadcast_to(p_idx[None] + 1, (b, r, km1))

  tokens = jnp.concatenate([b0_tokens, path_tokens.reshape(b, -1)], axis=1)
  parent = jnp.concatenate([b0_parent, p_parent.reshape(b, -1)], axis=1)
  depth = jnp.concatenate([b0_depth, p_depth.reshape(b, -1)], axis=1)
  valid = jnp.concatenate([b0_valid, p_valid.reshape(b, -1)], axis=1)
  branch = jnp.concatenate([b0_branch, p_branch.reshape(b, -1)], axis=1)
  valid = valid & (depth <= depth_limit[:, None])
  repair_key = k + (p_depth * max(r, 1) + p_idx[None]).reshape(b, -1)
  key = jnp.concatenate([b0_depth, repair_key], axis=1)
  short = max(v_max - tokens.shape[1], 0)  # fewer candidates than slots: pad to v_max
  tokens, parent, depth, branch, key = (jnp.pad(x, ((0, 0), (0, short))) for x in
                                        (tokens, parent, depth, branch, key))
  valid = jnp.pad(valid, ((0, 0), (0, short)))

  # Priority: branch 0 by depth, then repair nodes breadth first; invalid nodes last.
  n_raw = tokens.shape[1]
  key = jnp.where(valid, key, n_raw * n_raw + jnp.arange(n_raw))
  order = jnp.argsort(key, axis=1)[:, :v_max]                               # [B, V]
  slot_of_raw = jnp.argsort(jnp.argsort(key, axis=1), axis=1)               # [B, N]

  valid = _gather(valid, order)
  raw_parent = _gather(parent, order)
  parent = jnp.where(valid & (raw_parent >= 0), _gather(slot_of_raw, raw_parent), PAD)
  tokens = jnp.where(valid, _gather(tokens, order), 0)
  depth = jnp.where(valid, _gather(depth, order), 0)
  branch = jnp.where(valid, _gather(branch, order), PAD)
  v = min(v_max, n_raw)
  chex.assert_shape([tokens, parent, depth, valid, branch, order], (b, v))
  return Tree(tokens=tokens, parent=parent, depth=depth, valid=valid, branch=branch,
              source=order.astype(jnp.int32), ancestors=ancestor_mask(parent, valid, km1))
