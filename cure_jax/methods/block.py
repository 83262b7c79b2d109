"""What every method on a DFlash block drafter shares: one bidirectional pass drafts the whole
block from the target's features, and the drafter resyncs on the features of the committed path.

`BlockDrafter` is such a method without a tree of its own; `TreeBlockDrafter` adds the tree
settings (`cure.*`: node budget, depth, alternatives) that cure, ddtree and hybrid read.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cure_jax.methods.base import Method, Spec
from cure_jax.models.dflash import DFlash, vocab_positions
from cure_jax.tree import repair


class BlockDrafter(Method):
  drafter_kind = "block"

  def block_size(self, drafter, requested, gamma=None):
    del gamma
    return requested or drafter.cfg.block_size

  def check(self, target, drafter):
    if not isinstance(drafter, DFlash):
      raise ValueError(f"method={self.name!r} needs a DFlash block drafter")
    drafter.cfg.check_against(target.cfg)

  def spec_fields(self, drafter):
    return dict(mask_token_id=drafter.cfg.mask_token_id,
                feature_layers=drafter.cfg.feature_layers)

  def init_drafter(self, drafter, spec, batch):
    return drafter.init_cache(batch, spec.max_len)

  def prefill_drafter(self, drafter, dcache, spec, target_out, tokens, positions, chunk):
    del spec, tokens
    k, v = drafter.context_kv(target_out.features, positions)
    return dcache.append(k, v, chunk.count)

  def resync_nodes(self, spec: Spec, tree, path):
    """Tree nodes [B, K] whose target features the drafter takes in: the winning path."""
    del spec, tree
    return path

  def features(self, spec, tree, out, path):
    nodes = self.resync_nodes(spec, tree, path)
    return jnp.take_along_axis(out.features, nodes[..., None], axis=1)     # [B, K, n*H]

  def resync(self, drafter, dcache, spec, verified, lengths, count):
    """The kept rows' context keys/values appended (rows past count are not committed)."""
    del spec
    positions = lengths[:, None] + jnp.arange(verified.features.shape[1])[None]  # [B, K]
    k, v = drafter.context_kv(verified.features, positions)
    return dcache.append(k, v, count)


class TreeBlockDrafter(BlockDrafter):
  """A block-drafter method whose tree is shaped by the cure.* settings."""

  tree_config = True
  counted_settings: tuple[str, ...] = ("b_max",)  # alternatives that need a bigger vocabulary

  def tree_settings(self, target, block_size, cure, draft_vocab=0):
    """Also checks that the drafter's vocabulary holds every alternative a position offers, so
    that top-k and margins never rank a token it cannot propose (-inf)."""
    cure = cure or repair.RepairConfig(max_depth=block_size - 1)
    cure.validate(block_size)
    size = draft_vocab or target.cfg.vocab_size
    where = (f"drafter.vocab={draft_vocab}: raise it" if draft_vocab
             else f"target has {target.cfg.vocab_size}")
    for name in self.counted_settings:
      if getattr(cure, name) >= size:
        raise ValueError(f"cure.{name}={getattr(cure, name)} alternatives need a vocabulary of "
                         f"more than {getattr(cure, name)} tokens ({where})")
    return cure

  def max_depth(self, spec):
    return spec.cure.max_depth


def hidden(target, drafter, dcache, spec: Spec, anchor, lengths, limit, known=None):
  """One DFlash pass; known [B, A, K-1] tokens at block positions 1.. (mask id = unknown).

  Returns the block hidden states [B, A, K, H]: position d drafts the token at depth d.
  """
  k = spec.block_size
  b = anchor.shape[0]
  if known is None:
    known = jnp.full((b, 1, k - 1), spec.mask_token_id, jnp.int32)
  blocks = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], known.shape[:2] + (1,)),
                            known], axis=-1)                                # [B, A, K]
  positions = lengths[:, None] + jnp.arange(k)[None]                       # [B, K]
  return drafter(target.embed(blocks), positions, dcache, limit + 1, spec.drafter_window,
                 kernels=target.layer_kernels)


def main_logits(target, drafter, dcache, spec: Spec, anchor, lengths, limit,
                compact: bool = False):
  """The main draft block's float32 logits [B, K-1, V]; compact: over the draft vocabulary's N
  tokens alone, [B, K-1, N] (DFlash.draft_rows; token_ids maps a position to its token)."""
  out = hidden(target, drafter, dcache, spec, anchor, lengths, limit)
  logits = drafter.draft_rows if compact else drafter.draft_logits
  return logits(out[:, 0, 1:], target, spec.draft_vocab)


def token_ids(spec: Spec, index):
  """The tokens at positions index [...] of the compact logits' last axis."""
  return jnp.asarray(np.asarray(spec.draft_vocab, np.int32))[index] if spec.draft_vocab else index


def vocab_index(spec: Spec, vocab_size: int, tokens):
  """The positions of tokens [...] on the compact logits' last axis (0 for one outside the draft
  vocabulary)."""
  if not spec.draft_vocab:
    return tokens
  return jnp.asarray(vocab_positions(spec.draft_vocab, vocab_size))[tokens]


def alternatives(spec: Spec, logq, drafted):
  """log q of each drafted token [...] and its topk best alternatives [..., A] with their log q
  (logq [..., N]: the distribution it was drawn from)."""
  own = jnp.take_along_axis(logq, drafted[..., None], axis=-1)[..., 0]
  logp, idx = repair.top_k(logq, spec.cure.topk + 1)
  keep = repair.excluding(idx, drafted, spec.cure.topk)
  return (own, jnp.take_along_axis(idx, keep, axis=-1),
          jnp.take_along_axis(logp, keep, axis=-1))
