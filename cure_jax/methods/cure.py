"""cure: chain plus repair paths at uncertainty focal points, each suffix re-drafted by DFlash.

Branch 0 is the main draft. The gate picks focal points from the draft's margins; each gets the
best alternative tokens, and one more DFlash pass (all paths in one batch) re-drafts the suffix
below every substituted token. The drafter resyncs on the winning path's features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cure_jax.methods import block
from cure_jax.methods.base import Proposal, branch0_rows, choose, log_q
from cure_jax.tree import candidates as tree_lib, repair, sampling


class Cure(block.TreeBlockDrafter):
  name = "cure"

  def max_children(self, spec):
    return 1 + spec.cure.num_paths

  def online(self, spec):
    return spec.cure.online

  def resync_nodes(self, spec, tree, path):
    """The winning path; under the no-resync ablation, branch 0's own nodes wherever branch 0
    has one (stale after a repair)."""
    if spec.cure.resync:
      return path
    slots = jnp.arange(path.shape[1])[None]
    is_b0 = (jnp.take_along_axis(tree.branch, jnp.minimum(slots, tree.size - 1), axis=1) == 0) & (
        slots < tree.size)
    return jnp.where(is_b0, slots, path)

  def leaf_alternatives(self, spec) -> int:
    """Alternatives kept per re-drafted node for `fill` (none: cure adds no leaves)."""
    del spec
    return 0

  def fill(self, spec, t, logits, draft, drafted, placed, suffix_alts, want_tree):
    """Hook after the repair paths: (tree, nodes placed by rank). Cure leaves the tree as is."""
    del spec, logits, draft, drafted, suffix_alts, want_tree
    return t, placed

  def propose(self, target, drafter, dcache, spec, key, anchor, lengths, limit, want_tree=None):
    """Branch 0 plus repair paths: alternatives at the gate's UFPs, suffixes re-drafted by DFlash
    with the substituted token (and the shared prefix) filled into the block; then `fill`.

    The tree's shape does not depend on the re-drafted tokens, so it is built first and the
    drafter's head runs only on the suffix nodes it kept (at most v_max rows instead of every
    path's K-1 positions: most of a repair suffix falls outside a small tree).
    """
    key_main, key_repair = sampling.split(key)
    logits = block.main_logits(target, drafter, dcache, spec, anchor, lengths, limit)
    cfg = spec.cure
    # one top-k of the logits gives the greedy draft, the margins and the alternatives (on a
    # GPU each top-k or argmax reads the [B, K-1, V] logits again: 0.2 GB at batch 8)
    top = repair.top_k(logits, cfg.b_max + 1)                                # [B, K-1, b_max+1]
    draft, q_main = choose(spec, key_main, logits, top[1][..., 0])           # [B, K-1(, V)]
    k = spec.block_size
    gate, alts = repair.select(logits, draft, limit, cfg, top)
    if want_tree is not None:
      gate = gate.only(want_tree)
    depth, alt, valid = repair.repair_paths(gate, alts, cfg.num_paths)
    d = jnp.arange(1, k)[None, None]                                        # [1, 1, K-1]
    j = depth[..., None]
    known = jnp.where(d < j, draft[:, None], jnp.where(d == j, alt[..., None], spec.mask_token_id))
    t = tree_lib.build(anchor, draft, limit, v_max=cfg.v_max, keep_branch0=cfg.keep_branch0,
                       path_tokens=known, path_depth=depth, path_valid=valid)
    on_path = t.valid & (t.source >= k)                                     # [B, V] repair nodes
    path = jnp.where(on_path, (t.source - k) // (k - 1), 0)                # [B, V] their path
    focal = jnp.take_along_axis(depth, path, axis=1)
    drafted = on_path & (t.depth > focal)                                   # re-drafted suffix
    b, v = t.tokens.shape
    n_vocab = logits.shape[-1]
    empty_q = jnp.zeros((b, v, 0 if spec.sampling.greedy else n_vocab))
    a = self.leaf_alternatives(spec)
    no_alts = (jnp.zeros((b, v)), jnp.zeros((b, v, a), jnp.int32), jnp.full((b, v, a), -jnp.inf))

    def redraft():
      hidden = block.hidden(target, drafter, dcache, spec, anchor, lengths, limit, known)
      rows = hidden[jnp.arange(b)[:, None], path, t.depth]                  # [B, V, H]
      if spec.sampling.greedy and not a:                   # the tokens alone: no logits written
        return drafter.draft_argmax(rows, target, spec.draft_vocab), empty_q, no_alts
      row_logits = drafter.draft_logits(rows, target, spec.draft_vocab)    # [B, V, N]
      tokens, q = choose(spec, key_repair, row_logits)
      row_alts = (block.alternatives(spec, log_q(spec, row_logits), tokens) if a else no_alts)
      return tokens, empty_q if q is None else q, row_alts

    suffix, q_suffix, suffix_alts = jax.lax.cond(
        jnp.any(valid), redraft, lambda: (jnp.zeros((b, v), jnp.int32), empty_q, no_alts))
    t = t.replace(tokens=jnp.where(drafted, suffix, t.tokens))
    placed = on_path & (t.depth == focal)                                   # by rank: one-hot q
    t, placed = self.fill(spec, t, logits, draft, drafted, placed, suffix_alts, want_tree)
    proposal = Proposal(t, gate=gate, block_margins=repair.gap(top[0]))
    if spec.sampling.greedy:
      return proposal, dcache
    q = branch0_rows(t, jnp.zeros_like(q_main[:, :1]), q_main)
    return proposal.replace(q=jnp.where(drafted[..., None], q_suffix, q),
                            deterministic=placed), dcache
