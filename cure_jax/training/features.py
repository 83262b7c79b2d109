"""Online target features: the frozen target runs inside the training step, so the data is
tokens and their labels only (8 bytes a token instead of n x hidden x 2: 40 KiB for Qwen3-8B's
five layers).

The target reads each sequence in chunks, as decoding's prefill does (models/kernels/prefix.py):
every chunk attends to the cache written so far and causally to itself, so nothing [T, T] is
built and the work grows with T, not T^2. Only the layers up to the deepest feature layer run.
Features leave in bfloat16, as the stored mode keeps them, so both modes feed the drafter the
same numbers; with the target's numerics "invariant" they are bitwise the stored ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cure_jax.models.cache import KVCache
from cure_jax.models.kernels.prefix import Prefix

FEATURE_DTYPE = jnp.bfloat16


def target_features(target, tokens, lengths, feature_layers: tuple[int, ...], chunk: int):
  """Features [B, T, F] (bfloat16) of right-padded sequences tokens [B, T] with lengths [B]:
  hidden_states[i] for i in feature_layers, concatenated. Rows past a length are unspecified."""
  b, t = tokens.shape
  c = min(chunk, t)
  tokens = jnp.pad(tokens, ((0, 0), (0, -t % c)))                        # [B, chunks * C]
  depth = max(feature_layers)
  cfg = target.cfg
  cache = KVCache.zeros(depth, b, tokens.shape[1], cfg.num_kv_heads, cfg.head_dim, target.dtype)

  def step(cache, start):
    piece = jax.lax.dynamic_slice_in_dim(tokens, start, c, axis=1)        # [B, C]
    positions = jnp.broadcast_to(start + jnp.arange(c), (b, c))
    prefix = Prefix(lengths=cache.lengths, count=jnp.clip(lengths - start, 0, c))
    out = target(piece, positions, cache, prefix, feature_layers, depth=depth)
    cache = cache.replace(k=out.k, v=out.v).advance(prefix.count)
    return cache, out.features.astype(FEATURE_DTYPE)                      # [B, C, F]

  _, feats = jax.lax.scan(step, cache, jnp.arange(0, tokens.shape[1], c))  # [n, B, C, F]
  return feats.swapaxes(0, 1).reshape(b, -1, feats.shape[-1])[:, :t]
