"""ar_draft: naive speculative decoding. A small autoregressive Qwen3/Llama drafter that shares
the target's tokenizer drafts gamma tokens one at a time; the tree is that single path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cure_jax.methods.base import Method, Spec, choose, path_proposal
from cure_jax.tree import sampling

DEFAULT_GAMMA = 4


class ArDraft(Method):
  name = "ar_draft"
  drafter_kind = "autoregressive"

  def block_size(self, drafter, requested, gamma=None):
    del drafter
    return requested or (gamma or DEFAULT_GAMMA) + 1

  def check(self, target, drafter):
    if drafter.cfg.vocab_size != target.cfg.vocab_size:
      raise ValueError(f"ar_draft drafter vocab {drafter.cfg.vocab_size} != target vocab "
                       f"{target.cfg.vocab_size}: it must share the target's tokenizer")

  def init_drafter(self, drafter, spec, batch):
    return drafter.init_cache(batch, spec.max_len)

  def prefill_drafter(self, drafter, dcache, spec, target_out, tokens, positions, chunk):
    del spec, target_out
    out = drafter(tokens, positions, dcache, chunk)
    return dcache.replace(k=out.k, v=out.v).advance(chunk.count)

  def propose(self, target, drafter, dcache, spec, key, anchor, lengths, limit, want_tree=None):
    del target, want_tree
    key_main, _ = sampling.split(key)
    draft, q_main, dcache = draft_tokens(drafter, dcache, spec, key_main, anchor, lengths)
    return path_proposal(spec, anchor, draft, q_main, limit), dcache

  def resync(self, drafter, dcache, spec, verified, lengths, count):
    """Its cache already holds the drafts; keep the accepted ones."""
    del drafter, spec, verified
    return dcache.replace(lengths=lengths + count)


def draft_tokens(model, cache, spec: Spec, key, anchor, lengths):
  """gamma tokens from the AR drafter, which also consumes the last draft so that every accepted
  token is in its cache. Returns drafts [B, gamma], their q [B, gamma, V] (None when greedy) and
  the extended drafter cache."""
  gamma = spec.block_size - 1

  def step(carry, i):
    cache, token = carry
    mask = jnp.concatenate([cache.visible()[:, None, :], jnp.ones((token.shape[0], 1, 1), bool)],
                           axis=-1)
    out = model(token[:, None], (lengths + i)[:, None], cache, mask)
    nxt, q = choose(spec, sampling.fold(key, i), model.logits(out.hidden[:, 0]))
    q = jnp.zeros((token.shape[0], 0)) if q is None else q
    return (cache.append(out.k, out.v, jnp.ones_like(lengths)), nxt), (nxt, q)

  (cache, _), (drafts, qs) = jax.lax.scan(step, (cache, anchor), jnp.arange(gamma + 1))
  q_main = None if spec.sampling.greedy else jnp.moveaxis(qs[:gamma], 0, 1)
  return drafts[:gamma].T, q_main, cache
