"""chain: DFlash drafts K-1 tokens in one pass; the tree is that single path."""

from cure_jax.methods import block
from cure_jax.methods.base import choose, path_proposal
from cure_jax.tree import sampling


class Chain(block.BlockDrafter):
  name = "chain"

  def propose(self, target, drafter, dcache, spec, key, anchor, lengths, limit, want_tree=None):
    del want_tree
    key_main, _ = sampling.split(key)
    logits = block.main_logits(target, drafter, dcache, spec, anchor, lengths, limit)
    draft, q_main = choose(spec, key_main, logits)                           # [B, K-1(, V)]
    return path_proposal(spec, anchor, draft, q_main, limit, logits), dcache
