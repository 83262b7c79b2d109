"""Exact sums inside the exact-attention kernels (GPU and TPU), in int32 alone.

Each term is cut toward zero to a grid, t = trunc(x 2^(GRID - e)) for a bound |x| < 2^e, as
numerics' exact sums do (the same integers), and the integers are added exactly: a term below
2^44 is split into high and low 22-bit halves, a block's halves are summed (below 2^31 for up
to 2^8 terms a block), and the running sum is kept as three 22-bit limbs with carries. So a sum
is one integer whatever the order or split of its terms, and its float32 one fixed sequence of
roundings of that integer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GRID = 44    # numerics._GRID: a sum's terms are cut to 2^-GRID of its bound
HALF = 22    # bits per limb


def halves(t):
  """t (float32, |t| < 2^44, its fraction to be dropped) as int32 (high, low): trunc(t) =
  high 2^22 + low, both of t's sign. t - high 2^22 is exact (the low bits of t)."""
  high = (t * 2.0 ** -HALF).astype(jnp.int32)
  return high, (t - high.astype(jnp.float32) * 2.0 ** HALF).astype(jnp.int32)


def add(limbs, high, low):
  """limbs (l0, l1, l2) of an integer l2 2^44 + l1 2^22 + l0 with l0, l1 in [0, 2^22), plus
  high 2^22 + low; |high|, |low| < 2^30."""
  l0, l1, l2 = limbs
  l0 = l0 + low
  carry = jax.lax.shift_right_arithmetic(l0, HALF)
  l0 = l0 - (carry << HALF)
  l1 = l1 + high + carry
  carry = jax.lax.shift_right_arithmetic(l1, HALF)
  return l0, l1 - (carry << HALF), l2 + carry


def value(limbs, unit):
  """The limbs' integer times unit (float32), one fixed sequence of roundings."""
  l0, l1, l2 = (x.astype(jnp.float32) for x in limbs)
  return ((l2 * 2.0 ** HALF + l1) * 2.0 ** HALF + l0) * unit
