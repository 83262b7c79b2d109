"""Functional KV caches with a static maximum length.

A cache holds keys and values of *committed* tokens only, in slots 0..length-1 of each
sequence: one [B, KVH, S, D] array per layer, heads before slots, the order attention reads them
in (with slots before heads, XLA's TPU compiler relaid and copied whole caches every iteration).
One array per layer, not one stacked [L, ...] array: a layer's slice of a stacked cache is a copy
when it feeds a kernel (tpu_attention), which XLA made in every layer and iteration.
New tokens (a prompt, a verification block, a whole candidate tree) are attended to
beside the cache, never written speculatively; afterwards the caller writes the tokens it keeps
into their final slots. Writes past `max_len` are dropped, which is how a tree near the end of
the cache shrinks instead of overflowing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]   # L x [B, KVH, S, D]
  v: tuple[jax.Array, ...]   # L x [B, KVH, S, D]
  lengths: jax.Array  # [B] int32: committed slots per sequence

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]

  @classmethod
  def zeros(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
            dtype) -> "KVCache":
    shape = (batch, kv_heads, max_len, head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))  # noqa: E731
    return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))

  def visible(self) -> jax.Array:
    """[B, S] True for committed slots."""
    return jnp.arange(self.max_len)[None, :] < self.lengths[:, None]

  def write(self, k_new, v_new, slots) -> "KVCache":
    """Scatters k_new/v_new (L x [B, T, KVH, D]) into slots [B, T]; slots >= max_len are
    dropped. Layer by layer: a stacked [L, ...] input would be one buffer that every layer's
    scatter reads whole (XLA fuses the stacking into each; on a GPU 2 GB an iteration)."""
    batch = jnp.arange(slots.shape[0])[:, None, None]               # [B, 1, 1]
    heads = jnp.arange(self.k[0].shape[1])[None, :, None]           # [1, KVH, 1]
    at = (batch, heads, slots[:, None, :])                          # a layer's [B, KVH, T]

    def put(cache, new):                                            # new: L x [B, T, KVH, D]
      return tuple(c.at[at].set(n.swapaxes(1, 2).astype(c.dtype), mode="drop")
                   for c, n in zip(cache, new))

    return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))

  def append(self, k_new, v_new, count) -> "KVCache":
    """Commits the first count[b] of T new tokens after each sequence's current length."""
    t = k_new[0].shape[1]
    offs = jnp.arange(t)[None, :]                                    # [1, T]
    slots = jnp.where(offs < count[:, None], self.lengths[:, None] + offs, self.max_len)
    cache = self.write(k_new, v_new, slots)
    return cache.replace(lengths=jnp.minimum(self.lengths + count, self.max_len))


def take_tokens(x, index):
  """Gathers each layer of x (L x [B, T, ...]) along T with index [B, K] -> L x [B, K, ...]."""
  return tuple(jax.vmap(lambda xb, ib: xb[ib])(layer, index) for layer in x)
