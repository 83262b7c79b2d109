"""hybrid: cure, with the node budget it leaves free filled by sibling leaves, best first, from
the main draft's and the re-draft's own marginals."""

from __future__ import annotations

import jax.numpy as jnp

from cure_jax.methods import block
from cure_jax.methods.base import branch0_rows, log_q
from cure_jax.methods.cure import Cure
from cure_jax.tree import best_first, repair


def leaf_branch(cfg: repair.RepairConfig) -> int:
  """Tree.branch of the hybrid's sibling leaves (after the repair paths' 1..num_paths)."""
  return cfg.num_paths + 1


class Hybrid(Cure):
  name = "hybrid"
  counted_settings = ("b_max", "topk")

  def max_children(self, spec):
    return 1 + spec.cure.num_paths + spec.cure.topk

  def leaf_alternatives(self, spec):
    return spec.cure.topk

  def fill(self, spec, t, logits, draft, drafted, placed, suffix_alts, want_tree):
    """Each branch-0 node offers the other top tokens of the main draft at its depth, each
    re-drafted node those of its re-draft row (focal nodes offer none: branch 0's node at their
    depth already does, so every parent has one node offering); cumulative log q ranks them.
    The leaves are placed by rank too."""
    b, v = t.tokens.shape
    logq = log_q(spec, logits)                                              # [B, K-1, N]
    _, alt_main, alt_logp_main = block.alternatives(spec, logq, draft)     # [B, K-1, A]
    own_suffix, alt_suffix, alt_logp_suffix = suffix_alts                   # [B, V(, A)]
    rows = jnp.arange(b)[:, None]
    own_rank = logq[rows, jnp.maximum(t.depth - 1, 0), t.tokens]           # focal: main q
    node_logp = jnp.where(drafted, own_suffix, own_rank)
    on_b0 = t.valid & (t.branch == 0) & (t.depth > 0)
    b0_alts = branch0_rows(t, jnp.zeros_like(alt_main[:, :1]), alt_main)
    b0_logp = branch0_rows(t, jnp.zeros_like(alt_logp_main[:, :1]), alt_logp_main)
    alt_tokens = jnp.where(drafted[..., None], alt_suffix, b0_alts)
    offers = (on_b0 | drafted) & ~placed
    if want_tree is not None:  # the online budget said chain: no leaves either
      offers = offers & want_tree[:, None]
    alt_logp = jnp.where(offers[..., None], jnp.where(drafted[..., None], alt_logp_suffix,
                                                      b0_logp), -jnp.inf)
    cum = best_first.cumulative(t, node_logp)
    t = best_first.add_leaves(t, cum, alt_tokens, alt_logp, branch=leaf_branch(spec.cure),
                              max_depth=spec.max_depth)
    return t, placed | (t.branch == leaf_branch(spec.cure))
