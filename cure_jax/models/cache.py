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

import functools

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
    put = functools.partial(write_layer, slots=slots)
    return self.replace(k=tuple(map(put, self.k, k_new)), v=tuple(map(put, self.v, v_new)))

  def append(self, k_new, v_new, count) -> "KVCache":
    """Commits the first count[b] of T new tokens after each sequence's current length."""
    cache = self.write(k_new, v_new, append_slots(self.lengths, count, k_new[0].shape[1],
                                                  self.max_len))
    return cache.advance(count)

  def advance(self, count) -> "KVCache":
    """count[b] more slots committed: for caches a prompt chunk's forward wrote itself
    (kernels/prefix.attend)."""
    return self.replace(lengths=jnp.minimum(self.lengths + count, self.max_len))


def append_slots(lengths, count, t: int, max_len: int):
  """[B, T] the slots of T new tokens after each row's `lengths`; tokens past count[b] go to
  max_len (dropped by write_layer)."""
  offs = jnp.arange(t)[None, :]                                      # [1, T]
  return jnp.where(offs < count[:, None], lengths[:, None] + offs, max_len)


def write_layer(cache, new, slots):
  """One layer's cache [B, KVH, S, D] with new [B, T, KVH, D] scattered to slots [B, T]
  (slots >= S dropped)."""
  batch = jnp.arange(slots.shape[0])[:, None, None]                 # [B, 1, 1]
  heads = jnp.arange(cache.shape[1])[None, :, None]                 # [1, KVH, 1]
  return cache.at[batch, heads, slots[:, None, :]].set(new.swapaxes(1, 2).astype(cache.dtype),
                                                       mode="drop")


def take_tokens(x, index):
  """Gathers each layer of x (L x [B, T, ...]) along T with index [B, K] -> L x [B, K, ...]."""
  return tuple(jax.vmap(lambda xb, ib: xb[ib])(layer, index) for layer in x)
