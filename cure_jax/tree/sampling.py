"""Temperature / top-k / top-p warping shared by every method, target and drafter alike, and
the per-sequence random keys every draw takes.

Speculative sampling is exact only if the drafter's proposal q and the target's p are warped
exactly as plain sampling warps p, so there is one function for it.

Each sequence of a batch carries its own key (keys [B]: `row_keys`, from the run's key and the
sequence's index in the whole request), and every draw is made row by row from it. A sequence's
random numbers then do not depend on the batch it is decoded in, its place there or the other
rows: with numerics=invariant, sampling with a fixed seed emits the same tokens at any batch size.

`Rows` carries the settings per row instead (a server's requests, each with its own): one
compiled program then serves every mix of them, and a row at temperature 0 takes the argmax,
so it decodes as a greedy program would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def validate(self) -> None:
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must lie in (0, 1] (1 = off)")


@struct.dataclass
class Rows:
  """Sampling settings per row: temperature [B] (0 = argmax), top_k [B] (0 = off), top_p [B]
  (1 = off). Always a sampled program's: rows at temperature 0 decode greedily inside it."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  greedy = False

  @classmethod
  def of(cls, s: Sampling, rows: int = 1) -> "Rows":
    full = lambda v, dtype: jnp.full((rows,), v, dtype)   # noqa: E731
    return cls(full(s.temperature, jnp.float32), full(s.top_k, jnp.int32),
               full(s.top_p, jnp.float32))

  def per_row(self, x, like):
    """x [B] shaped to broadcast against like [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (like.ndim - 1))

  def argmax_rows(self, like):
    """[B, 1, ..., 1] rows at temperature 0."""
    return self.per_row(self.temperature == 0, like)


def _nucleus(probs, top_p):
  """probs [..., V] cut to the smallest set of top tokens whose mass reaches top_p, renormalized."""
  order = jnp.argsort(-probs, axis=-1)
  sorted_p = jnp.take_along_axis(probs, order, axis=-1)
  keep_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p < top_p
  keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                            inplace=False)
  probs = jnp.where(keep, probs, 0.0)
  return probs / jnp.sum(probs, axis=-1, keepdims=True)


def warp(logits, s: Sampling | Rows):
  """Float32 probabilities [..., V] after temperature, then top-k, then top-p (nucleus)."""
  if isinstance(s, Rows):
    return _warp_rows(logits, s)
  scores = logits.astype(jnp.float32) / s.temperature
  if 0 < s.top_k < scores.shape[-1]:
    kth = jax.lax.top_k(scores, s.top_k)[0][..., -1:]
    scores = jnp.where(scores < kth, -jnp.inf, scores)
  probs = jax.nn.softmax(scores, axis=-1)
  if s.top_p < 1.0:
    probs = _nucleus(probs, s.top_p)
  return probs


def _warp_rows(logits, s: Rows):
  """warp with each row's own settings: the same operations, so a row's probabilities are
  bitwise those of warp with its settings as a Sampling; one-hot at the argmax at temperature 0.
  The sorts top-k and top-p need run only when a row asks for them."""
  logits = logits.astype(jnp.float32)
  t, k, p = (s.per_row(x, logits) for x in (s.temperature, s.top_k, s.top_p))
  scores = logits / jnp.where(t > 0, t, 1.0)
  v = scores.shape[-1]
  cut = (k > 0) & (k < v)

  def top_k(scores):
    ranked = -jnp.sort(-scores, axis=-1)
    kth = jnp.take_along_axis(ranked, jnp.clip(k - 1, 0, v - 1), axis=-1)
    return jnp.where(cut & (scores < kth), -jnp.inf, scores)

  scores = jax.lax.cond(jnp.any(cut), top_k, lambda x: x, scores)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jax.lax.cond(jnp.any(p < 1.0),
                       lambda x: jnp.where(p < 1.0, _nucleus(x, p), x), lambda x: x, probs)
  argmax = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
  return jnp.where(s.argmax_rows(logits), argmax, probs)


def row_keys(key, first_row, rows: int):
  """Keys [rows] of sequences first_row, first_row + 1, ...: fold_in(key, index)."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(first_row + jnp.arange(rows))


def split(keys):
  """Two new keys [B] from each of keys [B]."""
  both = jax.vmap(jax.random.split)(keys)                                  # [B, 2]
  return both[:, 0], both[:, 1]


def fold(keys, data: int):
  """fold_in(key, data) for each of keys [B]."""
  return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def uniform(keys):
  """One uniform number in [0, 1) per key of keys [B]."""
  return jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)


def draw(keys, probs):
  """One sample per row of probs [B, ..., V] -> int32 [B, ...], row b from keys[b]."""
  return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p), axis=-1))(
      keys, probs).astype(jnp.int32)
