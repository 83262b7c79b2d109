"""ddtree: a best-first tree from the one DFlash pass's per-depth top-k (no second pass)."""

import jax.numpy as jnp

from cure_jax.methods import block
from cure_jax.methods.base import Proposal, log_q
from cure_jax.tree import best_first, repair


class DDTree(block.TreeBlockDrafter):
  name = "ddtree"
  counted_settings = ("b_max", "topk")

  def max_children(self, spec):
    return spec.cure.topk

  def propose(self, target, drafter, dcache, spec, key, anchor, lengths, limit, want_tree=None):
    """The best-first tree over the main draft's per-depth top-k. Every node is placed by rank,
    so under sampling each is tested as a one-hot q (sampling without replacement from the
    residual), which is lossless whichever tokens were chosen."""
    del key, want_tree
    logits = block.main_logits(target, drafter, dcache, spec, anchor, lengths, limit,
                               compact=True)                                # [B, K-1, N]
    logq = log_q(spec, logits)
    logp, index = repair.top_k(logq, spec.cure.topk)                        # [B, K-1, k]
    tokens = block.token_ids(spec, index)
    t = best_first.ddtree(anchor, tokens, logp, limit, v_max=spec.cure.v_max)
    rows = jnp.arange(t.tokens.shape[0])[:, None]
    vocab = target.cfg.vocab_size
    at = block.vocab_index(spec, vocab, t.tokens)                           # [B, V]
    own = logq[rows, jnp.maximum(t.depth - 1, 0), at]                       # [B, V]
    proposal = Proposal(t, block_margins=repair.margins(logits),
                        path_logp=best_first.cumulative(t, own))
    if spec.sampling.greedy:
      return proposal, dcache
    b, v = t.tokens.shape
    return proposal.replace(q=jnp.zeros((b, v, vocab)),
                            deterministic=jnp.ones((b, v), bool)), dcache
