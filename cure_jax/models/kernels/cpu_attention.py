"""Attention over the KV cache on XLA:CPU: the cache read in its own layout, over the whole cache
or in blocks up to the context in use, picked at run time.

XLA:CPU's matmul library is fast on [M, K] x [K, N] in row-major order. The cache is
[B, KVH, S, D], so a head's keys are [S, D]: the scores are computed slot-major, K x q^T
([S, D] x [D, rows], reading the cache in place), and transposed after (rows x S, a small
tensor); the values are p x V ([rows, S] x [S, D]), again the cache as it lies. Written as
q x K^T or with the value product's output heads-first, XLA copies the whole cache transposed
every layer, which costs more than the products (one layer, 9 heads over 3 KV heads of 64,
4,608 slots, float32, 2-core CPU: 0.55-0.70 ms as `layers.xla_attend` writes it, 0.24 ms here).
An optimisation barrier keeps the scores slot-major: without it XLA folds the transpose back
into the product (q x K^T, and the copy).

Two ways over the cache, both the same online softmax (a running maximum m, sum l and value
accumulator acc per query row, then the new tokens):
- whole: one pass over all S slots; its cost follows the cache's size;
- blocked: a loop over BLOCK-slot blocks up to the last slot any row sees; its cost follows the
  context held, plus a copy of each block's keys and values (XLA:CPU slices are copies).
attend takes the blocked loop while the context fills at most 1 / BLOCKED_SHARE of the cache
(measured as above: a block costs about as much as three blocks of the whole pass). A block past
a row's last visible slot adds exactly nothing to that row, so within either way a row's result
does not depend on the other rows; which way runs depends on the longest row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

BLOCK = 512         # cache slots per step of the blocked loop; caches of one block are read whole
BLOCKED_SHARE = 3   # the loop runs while the slots in use are at most 1 / BLOCKED_SHARE of S
NEG = float(jnp.finfo(jnp.float32).min)


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new):
  """layers.attend on CPU: [B, A, T, H, D] queries over [cache ; new tokens] (shapes there)."""
  s = k_old.shape[2]
  qx, state = _start(q, k_old)
  if s > BLOCK:
    blocked = _last_seen(mask_old) * BLOCKED_SHARE <= s
    state = jax.lax.cond(blocked, _blocked, _update, state, qx, k_old, v_old, mask_old)
  else:
    state = _update(state, qx, k_old, v_old, mask_old)
  return _finish(state, qx, q, k_new, v_new, mask_new)


def blocked(q, k_old, v_old, k_new, v_new, mask_old, mask_new):
  """attend with the cache read by the blocked loop alone, whatever the context."""
  qx, state = _start(q, k_old)
  state = _blocked(state, qx, k_old, v_old, mask_old)
  return _finish(state, qx, q, k_new, v_new, mask_new)


def _start(q, k_old):
  """The queries as K x q^T takes them, [B, KVH, D, A, T, G] float32, and the online softmax's
  empty state: m, l [B, KVH, A, T, G] and acc [B, KVH, A, T, G, D]."""
  b, a, t, h, d = q.shape
  kvh = k_old.shape[1]
  qx = _f32(q).reshape(b, a, t, kvh, h // kvh, d).transpose(0, 3, 5, 1, 2, 4)
  m = jnp.full((b, kvh, a, t, h // kvh), NEG, jnp.float32)
  return qx, (m, jnp.zeros_like(m), jnp.zeros(m.shape + (d,), jnp.float32))


def _blocked(state, qx, k_old, v_old, mask_old):
  s = k_old.shape[2]
  c = min(BLOCK, s)

  def block(j, state):
    start = jnp.minimum(j * c, s - c)        # the last block may overlap the one before it:
    slots = start + jnp.arange(c)            # its slots already counted are masked off
    visible = jax.lax.dynamic_slice_in_dim(mask_old, start, c, axis=3) & (slots >= j * c)
    k = jax.lax.dynamic_slice_in_dim(k_old, start, c, axis=2)                # [B, KVH, C, D]
    v = jax.lax.dynamic_slice_in_dim(v_old, start, c, axis=2)
    return _update(state, qx, k, v, visible)

  return jax.lax.fori_loop(0, (_last_seen(mask_old) + c - 1) // c, block, state)


def _update(state, qx, k, v, visible):
  """The online softmax over N more cache slots: k, v [B, KVH, N, D], visible [B, A, T, N]."""
  m, l, acc = state
  scores = jnp.einsum("bknd,bkdatg->bknatg", _f32(k), qx)               # slot-major: K x q^T
  scores = jax.lax.optimization_barrier(scores).transpose(0, 1, 3, 4, 5, 2)
  return _softmax_step(m, l, acc, scores, visible, lambda p: jnp.einsum(
      "bkatgn,bknd->bkatgd", p, _f32(v)))


def _finish(state, qx, q, k_new, v_new, mask_new):
  """The new tokens' step, then the normalised output [B, A, T, H, D]."""
  b, a, t, h, d = q.shape
  scores = jnp.einsum("baukd,bkdatg->bkatgu", _f32(k_new), qx)
  _, l, acc = _softmax_step(*state, scores, mask_new, lambda p: jnp.einsum(
      "bkatgu,baukd->bkatgd", p, _f32(v_new)))
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]     # a row that sees nothing gives zeros
  return out.transpose(0, 2, 3, 1, 4, 5).reshape(b, a, t, h, d).astype(q.dtype)


def _softmax_step(m, l, acc, scores, visible, values):
  """scores [B, KVH, A, T, G, N] of N slots, visible [B, A, T, N], values(p) = p x V."""
  scale = 1.0 / math.sqrt(acc.shape[-1])
  seen = visible[:, None, :, :, None]
  scores = jnp.where(seen, scores * scale, NEG)
  m_new = jnp.maximum(m, scores.max(-1, initial=NEG))      # initial: an empty cache
  p = jnp.where(seen, jnp.exp(scores - m_new[..., None]), 0.0)
  alpha = jnp.exp(m - m_new)
  return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + values(p)


def _last_seen(mask_old):
  """The last cache slot any row sees, plus one (0 for an empty context)."""
  s = mask_old.shape[-1]
  return jnp.max(jnp.where(mask_old.any(axis=(1, 2)), jnp.arange(s) + 1, 0))


def _f32(x):
  """XLA:CPU runs bfloat16 x bfloat16 -> float32 products through a dot that fails at run time
  for some layouts (see layers.einsum_f32): products here take float32 operands (exact)."""
  return x.astype(jnp.float32)
