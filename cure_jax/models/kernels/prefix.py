"""Attention for one chunk of a prompt: a causal run of new tokens after each row's cache prefix.

Chunked prefill (runtime/decoding.prefill) feeds the prompt T tokens at a time; a chunk's queries
see the row's first `lengths` cache slots (the chunks before it) and, causally, the chunk itself.
This is flash attention written in XLA: the cache is read in blocks of T slots by a loop whose
count is the filled part of the cache (a loop count, not a shape), each block folded into an
online softmax, so no score tensor larger than [B, H, T, T] exists and the work per chunk grows
with the prompt so far, not with `max_len`. This form runs on every platform.

On NVIDIA GPUs the same contract is gpu_prefix's Triton flash kernel (the scores stay on
chip); on TPUs it is the decode kernel (tpu_attention) for chunks of up to TPU_ROWS tokens, its
rows in VMEM (its masks are int8 [T, S] and [T, T] a row); elsewhere, and for shapes the
kernels do not tile, this module's XLA form. Why not the kernels
JAX ships: Pallas flash attention (GPU mha, TPU flash) aligns its causal mask at slot 0 of one
key array and splash attention's masks are static arrays, while a chunk follows a cache prefix
whose length is a loop variable; cuDNN's fused attention (jax.nn.dot_product_attention) has not
been tried here (this project measures GPUs through compile-only targets, with no GPU to build a
cuDNN graph on). The GPU decode kernel (gpu_attention) keeps all of a block's new tokens on
chip in each 16-row program, which a chunk of hundreds of tokens does not fit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from cure_jax.models import cache as cache_lib, numerics
from cure_jax.models.kernels import gpu_prefix, tpu_attention
from cure_jax.models.layers import einsum_f32

_NEG = float(jnp.finfo(jnp.float32).min)
# Chunks the TPU kernel takes: at 2048 rows Qwen3-8B's call asked 24.3 MB of v5e's 16 MB of
# scoped VMEM (experiments.aot, results/long_prompts/v5e_2x2_prefill_32k_chunk2048.json)
TPU_ROWS = 512


@struct.dataclass
class Prefix:
  """The mask of a prompt chunk, in place of a boolean [B, T, S + T] one: each row's new tokens
  follow its first `lengths` cache slots, of which they see all; the first `count` new tokens
  are real (the rest pad the chunk past the prompt's end)."""

  lengths: jax.Array   # [B] cache slots filled before this chunk
  count: jax.Array     # [B] real tokens in this chunk


def attend(q, k_cache, v_cache, k_new, v_new, prefix: Prefix, exponents=None):
  """q [B, T, H, D]; k_cache/v_cache [B, KVH, S, D]; k_new/v_new [B, T, KVH, D] -> the output
  [B, T, H, D] (rows past prefix.count are padding: what they hold is unspecified) and the
  caches with the chunk's real tokens written after each row's prefix.

  The caches go through the attention and come out written, never read after a write to them:
  XLA then updates them in place, where a cache read inside a loop and written after it was
  copied whole, each layer and chunk (363 of a 6,000-token CPU prefill's 444 MiB of
  temporaries)."""
  args = (q, k_cache, v_cache, k_new, v_new, prefix.lengths, prefix.count)
  if numerics.invariant():
    return _written(numerics_attend(*args, exponents), k_cache, v_cache, k_new, v_new, prefix)
  platforms = {}
  if gpu_prefix.tiles(k_cache.shape[2], q.shape[1], q.shape[3]):
    platforms["cuda"] = lambda *a: (gpu_prefix.attend(*a[:-1]), a[1], a[2])
  if tpu_attention.tiles(k_cache.shape[2]) and q.shape[1] <= TPU_ROWS:
    platforms["tpu"] = lambda *a: (tpu_attend(*a), a[1], a[2])
  if platforms:
    out, k_cache, v_cache = jax.lax.platform_dependent(*args, **platforms, default=xla_attend)
  else:
    out, k_cache, v_cache = xla_attend(*args)
  return _written(out, k_cache, v_cache, k_new, v_new, prefix)


def _written(out, k_cache, v_cache, k_new, v_new, prefix: Prefix):
  """attend's result: the output and the caches with the chunk's real tokens written."""
  slots = cache_lib.append_slots(prefix.lengths, prefix.count, k_new.shape[1], k_cache.shape[2])
  return (out, cache_lib.write_layer(k_cache, k_new, slots),
          cache_lib.write_layer(v_cache, v_new, slots))


def tpu_attend(q, k_cache, v_cache, k_new, v_new, lengths, count, *, interpret: bool = False):
  """attend through tpu_attention's kernel: the chunk's rows are one block's, the cache's
  visible slots and the chunk's causal mask as int8 masks ([T, S] and [T, T] a row)."""
  return _as_block(tpu_attention.attend, q, k_cache, v_cache, k_new, v_new, lengths, count,
                   interpret=interpret)


def numerics_attend(q, k_cache, v_cache, k_new, v_new, lengths, count, exponents):
  """attend in the invariant numerics mode: the chunk as one block of numerics.attend."""
  return _as_block(numerics.attend, q, k_cache, v_cache, k_new, v_new, lengths, count,
                   exponents=exponents)


def _as_block(attend_block, q, k_cache, v_cache, k_new, v_new, lengths, count, **kwargs):
  """A chunk through layers.attend's contract: one block (A = 1) whose rows see the row's
  filled cache slots and, causally, the chunk's real tokens."""
  t = q.shape[1]
  i = jnp.arange(t)
  mask_old = (jnp.arange(k_cache.shape[2])[None] < lengths[:, None])[:, None, None]  # [B,1,1,S]
  mask_new = (i[:, None] >= i[None]) & (i[None, None] < count[:, None, None])       # [B, T, T]
  return attend_block(q[:, None], k_cache, v_cache, k_new[:, None], v_new[:, None],
                      mask_old, mask_new[:, None], **kwargs)[:, 0]


def xla_attend(q, k_cache, v_cache, k_new, v_new, lengths, count):
  """attend in XLA: the cache in blocks of T slots, then the chunk, through an online softmax.
  Returns the output and the caches, unchanged, as they come out of the loop over blocks (the
  loop's own copies, so that a write after it needs no other)."""
  b, t, h, d = q.shape
  kvh, s = k_cache.shape[1], k_cache.shape[2]
  block = min(t, s)
  qg = q.reshape(b, t, kvh, h // kvh, d)
  scale = 1.0 / math.sqrt(d)

  def update(carry, k, v, visible):           # k, v [B, KVH, N, D]; visible [B, T or 1, N]
    acc, top, total = carry                   # [B, KVH, G, T, D], [B, KVH, G, T] x 2
    sc = einsum_f32("btkgd,bknd->bkgtn", qg, k) * scale
    visible = visible[:, None, None]
    sc = jnp.where(visible, sc, _NEG)
    new_top = jnp.maximum(top, sc.max(-1))
    p = jnp.where(visible, jnp.exp(sc - new_top[..., None]), 0.0)
    alpha = jnp.exp(top - new_top)
    acc = alpha[..., None] * acc + einsum_f32("bkgtn,bknd->bkgtd", p.astype(v.dtype), v)
    return acc, new_top, alpha * total + p.sum(-1)

  def cache_block(j, carry):
    softmax, caches = carry
    start = jnp.minimum(j * block, s - block)  # the last block may overlap the one before it
    k, v = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=2) for x in caches)
    slot = start + jnp.arange(block)
    visible = (slot[None] >= j * block) & (slot[None] < lengths[:, None])    # [B, N]
    return update(softmax, k, v, visible[:, None]), jax.lax.optimization_barrier(caches)

  init = (jnp.zeros((b, kvh, h // kvh, t, d), jnp.float32),
          jnp.full((b, kvh, h // kvh, t), _NEG, jnp.float32),
          jnp.zeros((b, kvh, h // kvh, t), jnp.float32))
  steps = (jnp.max(lengths) + block - 1) // block
  carry, (k_cache, v_cache) = jax.lax.fori_loop(0, steps, cache_block, (init, (k_cache, v_cache)))
  i = jnp.arange(t)
  own = (i[:, None] >= i[None, :])[None] & (i[None, None, :] < count[:, None, None])
  acc, _, total = update(carry, k_new.swapaxes(1, 2), v_new.swapaxes(1, 2), own)   # [B, T, T]
  out = acc / jnp.where(total > 0, total, 1.0)[..., None]                 # [B, KVH, G, T, D]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype), k_cache, v_cache
