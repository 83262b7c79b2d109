"""Temperature / top-k / top-p warping shared by every method, target and drafter alike, and
the per-sequence random keys every draw takes.

Speculative sampling is exact only if the drafter's proposal q and the target's p are warped
exactly as plain sampling warps p, so there is one function for it.

Each sequence of a batch carries its own key (keys [B]: `row_keys`, from the run's key and the
sequence's index in the whole request), and every draw is made row by row from it. A sequence's
random numbers then do not depend on the batch it is decoded in, its place there or the other
rows: with numerics=invariant, sampling with a fixed seed emits the same tokens at any batch size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


def warp(logits, s: Sampling):
  """Float32 probabilities [..., V] after temperature, then top-k, then top-p (nucleus)."""
  scores = logits.astype(jnp.float32) / s.temperature
  if 0 < s.top_k < scores.shape[-1]:
    kth = jax.lax.top_k(scores, s.top_k)[0][..., -1:]
    scores = jnp.where(scores < kth, -jnp.inf, scores)
  probs = jax.nn.softmax(scores, axis=-1)
  if s.top_p < 1.0:
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p < s.top_p
    keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                              inplace=False)
    probs = jnp.where(keep, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


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
