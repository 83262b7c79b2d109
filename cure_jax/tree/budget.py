"""The online budget: per sequence, repair only while the paper's efficiency model says it pays.

tokens/s ∝ (E[a] + 1) / (C_d + C_v(n)). Each sequence keeps running means of what branch 0
emits per iteration (τ_0, observed every iteration, since branch 0 is in every tree) and of
the extra tokens a repair tree earned over branch 0 when one ran (g). The tree runs when

    (τ_0 + g) / (C_d + C_r + C_v(v_max))  >  τ_0 / (C_d + C_v(K)),

with the device's costs from the config (C_r: the re-draft pass); at least once in every
`explore_every` iterations it runs anyway, so that g follows the text. All of it lives in the
loop state: no host round-trip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from cure_jax.tree.repair import RepairConfig

PRIOR_GAIN = 1.0  # optimistic start: the first iterations repair and measure g


@struct.dataclass
class Budget:
  tau0: jax.Array  # [B] running mean of branch 0's emitted tokens per iteration (accepted + 1)
  gain: jax.Array  # [B] running mean of (winner accepted - branch 0 accepted) when a tree ran


def init(batch: int) -> Budget:
  return Budget(tau0=jnp.ones((batch,)), gain=jnp.full((batch,), PRIOR_GAIN))


def verify_cost(cfg: RepairConfig, nodes: int) -> float:
  return cfg.cost_verify_base + cfg.cost_verify_per_node * nodes


def want_tree(budget: Budget, step, cfg: RepairConfig, block_size: int):
  """[B] bool: build the repair tree this iteration."""
  chain = cfg.cost_draft + verify_cost(cfg, block_size)
  tree = cfg.cost_draft + cfg.cost_redraft + verify_cost(cfg, cfg.v_max)
  pays = (budget.tau0 + budget.gain) * chain > budget.tau0 * tree
  return pays | (step % cfg.explore_every == 0)


def update(budget: Budget, cfg: RepairConfig, active, tried, accepted, branch0_accepted) -> Budget:
  """After an iteration: active [B] sequences still decoding, tried [B] those whose tree held
  more than branch 0;
  accepted / branch0_accepted [B] draft tokens the winner / branch 0 got accepted."""
  a = cfg.online_decay
  tau0 = jnp.where(active, a * budget.tau0 + (1 - a) * (branch0_accepted + 1), budget.tau0)
  gain = jnp.where(active & tried, a * budget.gain + (1 - a) * (accepted - branch0_accepted),
                   budget.gain)
  return Budget(tau0=tau0, gain=gain)
