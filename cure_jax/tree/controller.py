"""The goodput controller: each iteration, one compiled node budget for the whole batch.

The paper's efficiency model says tokens/s ∝ (E[a] + 1) / (C_d + C_v(n)). The controller
applies it to a few statically compiled budgets n (root included; n = 1 is a plain target step
with no drafter pass) and picks, for the batch, the one with the most expected tokens per second

    Σ_b E[tokens_b | n] / C(B, n),      E[tokens_b | n] = 1 + c_b · m_b(n),

where m_b(n) is the drafter's own prediction of the drafts accepted within the first n nodes of
a best-first tree (Σ over those nodes of the probability of their whole path: at most one node
per depth can match the target's greedy token, so this is the expected accepted depth), kept as
a running mean per sequence, and c_b is the sequence's calibration: accepted drafts over
predicted ones, running means over the iterations that drafted. C(B, n) is the device's cost
curve (cure_jax/costs/curve.py), drafter pass included for n > 1.

A plain target step tells nothing about the drafter, so now and then an iteration that would
take one drafts with the smallest drafting budget instead (the cheapest look at the text). Looks
start `explore_every` iterations apart, or further where drafting costs so much more than a plain
step that looking more often would cost over `explore_overhead` of the plain steps' time; each
drafted iteration that fails to pay (fewer tokens per second than plain steps would have given,
at the curve's costs) doubles the spacing, one that pays restores it. Drafting chosen on merit
also answers to what drafting realised: a running mean of the drafted iterations' pay (their
tokens per second over plain steps', at the curve's costs); while it is below 1 no iteration
drafts before the next look. The means extrapolate (the looks verify the smallest budget, the
means may pick a larger one) and pick drafting after a lucky look, so drafting chosen on merit
can lose iteration after iteration while the prediction still says it pays (a winner's curse);
what it realised says so first. Where drafts never pay they soon stop costing anything; the
spacing and the next look's step carry over to the next call (Generator), which runs the
target-only program when no look falls inside it (a call's means start unseen, so only a look
starts drafting).
Everything is loop state: no host round-trip. The budget only cuts a tree to its first n nodes,
which best-first trees keep closed under parents, so any choice is lossless.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class Settings:
  budgets: tuple[int, ...] = (1, 4, 8, 16)  # node budgets, root included; 1 = a target step
  costs: tuple[float, ...] = ()             # C(B, n) per budget (any one unit); () = measure
  decay: float = 0.8                        # running means: new = decay * old + (1-decay) * seen
  explore_every: int = 16                   # a plain target step becomes a draft this often,
  explore_overhead: float = 0.02            # or rarer: looking costs at most this fraction
  fallback: bool = True                     # target-only where no budget can pay (can_pay)
                                            # or no look falls inside a call (Generator)

  def validate(self) -> None:
    b = self.budgets
    if not b or b[0] < 1 or any(x >= y for x, y in zip(b, b[1:])):
      raise ValueError(f"auto.budgets={b}: give increasing node counts >= 1 (1 = a plain "
                       "target step), e.g. 1,4,8,16")
    if self.costs and (len(self.costs) != len(b) or min(self.costs) <= 0):
      raise ValueError(f"auto.costs={self.costs}: give one positive cost per budget {b}, or "
                       "none to measure them on this device")
    if not 0 <= self.decay < 1:
      raise ValueError(f"auto.decay={self.decay} must be in [0, 1)")
    if self.explore_every < 1:
      raise ValueError(f"auto.explore_every={self.explore_every} must be >= 1")
    if self.explore_overhead <= 0:
      raise ValueError(f"auto.explore_overhead={self.explore_overhead} must be > 0")

  @property
  def explore_interval(self) -> int:
    """Iterations between looks at the drafter while plain steps win (static)."""
    drafting = [c for n, c in zip(self.budgets, self.costs) if n > 1]
    if self.budgets[0] > 1 or not drafting:
      return self.explore_every
    extra = drafting[0] / self.costs[0] - 1.0       # a look's cost beyond the plain step's
    return max(self.explore_every, math.ceil(extra / self.explore_overhead))


def can_pay(cfg: Settings) -> bool:
  """Whether some drafting budget could beat plain target steps on these costs even if every
  draft were accepted: n nodes yield at most n tokens for C(B, n), a plain step one for C(B, 1).
  Where none can (a verifier compute-bound at a large batch), the controlled loop could only
  lose its looks and its larger step, so auto decodes target-only (Generator.spec)."""
  if not cfg.costs or cfg.budgets[0] != 1:
    return True
  return any(n * cfg.costs[0] > c for n, c in zip(cfg.budgets[1:], cfg.costs[1:]))


@struct.dataclass
class Controller:
  mass: jax.Array       # [B, A] running mean of m_b(n) per budget
  observed: jax.Array   # [B] running mean of accepted drafts, iterations that drafted
  predicted: jax.Array  # [B] running mean of m_b(n) of the budget verified then
  seen: jax.Array       # [B] a drafting iteration has been observed
  interval: jax.Array   # [] iterations from a drafted iteration to the next look
  next_look: jax.Array  # [] the step of the next look while plain steps win
  pay: jax.Array        # [] running mean of drafted iterations' pay (paid: ratio to plain steps)


# the longest spacing of looks (iterations): doubling stops here, far past any run's length
LONGEST = 1 << 24


def init(batch: int, cfg: Settings, interval=None, next_look=0) -> Controller:
  """A fresh controller; interval / next_look: the spacing a previous call learned (default
  the settings' explore_interval, a look at once)."""
  z = jnp.zeros((batch,))
  interval = cfg.explore_interval if interval is None else interval
  return Controller(mass=jnp.zeros((batch, len(cfg.budgets))), observed=z, predicted=z,
                    seen=jnp.zeros((batch,), bool), interval=jnp.asarray(interval, jnp.int32),
                    next_look=jnp.asarray(next_look, jnp.int32), pay=jnp.ones(()))


def expected_tokens(ctrl: Controller):
  """E[tokens_b | n] [B, A]: accepted drafts predicted and calibrated, plus the bonus token."""
  calibration = jnp.where(ctrl.predicted > 0, ctrl.observed / jnp.maximum(ctrl.predicted, 1e-9),
                          1.0)
  return 1.0 + calibration[:, None] * ctrl.mass


def choose(ctrl: Controller, cfg: Settings, active, step, horizon: int):
  """The budget index [] for this iteration; active [B] sequences still decoding. A look at
  the drafter is taken at ctrl.next_look or later, and only where the run can repay it: at
  least an explore interval of iterations left of the `horizon` (max_new_tokens; each iteration
  emits a token or more), so a short run on a device where drafting is dear never pays for
  one. While drafting's realised pay (ctrl.pay) is below plain steps', no iteration drafts
  before ctrl.next_look."""
  budgets = jnp.asarray(cfg.budgets)
  rate = jnp.sum(jnp.where(active[:, None], expected_tokens(ctrl), 0.0), axis=0)
  arm = jnp.argmax(rate / jnp.asarray(cfg.costs, jnp.float32)).astype(jnp.int32)
  drafting = jnp.argmax(budgets > 1).astype(jnp.int32)     # the smallest drafting budget
  due = step >= ctrl.next_look
  explore = ((budgets[arm] == 1) & due & (horizon - step >= cfg.explore_interval) &
             (budgets[-1] > 1))
  held = (budgets[0] == 1) & (ctrl.pay < 1.0) & ~due      # drafting realised a loss
  return jnp.where(explore, drafting, jnp.where(held, 0, arm))


def masses(cfg: Settings, valid, path_logp):
  """m_b(n) [B, A] from a best-first tree: valid [B, V], path_logp [B, V] the cumulative log
  probability of each node's path (the root, node 0, is not a draft)."""
  v = valid.shape[1]
  node = jnp.arange(v)[None]
  p = jnp.where(valid & (node > 0), jnp.exp(path_logp), 0.0)               # [B, V]
  within = node[:, None, :] < jnp.asarray(cfg.budgets)[None, :, None]      # [1, A, V]
  return jnp.sum(jnp.where(within, p[:, None, :], 0.0), axis=-1)


def pay(cfg: Settings, arm, active, accepted):
  """[] the tokens per second an iteration at budget index `arm` gave the active sequences,
  over what plain steps would have: Σ (1 + accepted) C(1) / (Σ 1 · C(n)); >= 1: it paid."""
  costs = jnp.asarray(cfg.costs, jnp.float32)
  tokens = jnp.sum(jnp.where(active, 1.0 + accepted, 0.0))
  return tokens * costs[0] / (jnp.maximum(jnp.sum(active), 1) * costs[arm])


def update(ctrl: Controller, cfg: Settings, arm, active, mass, accepted, step) -> Controller:
  """After an iteration at budget index `arm` [] and loop step `step` []: mass [B, A] this
  iteration's m_b(n) (ignored unless it drafted), accepted [B] drafts accepted. A sequence's
  first draft sets its means; a drafted iteration sets the spacing of looks (restored when it
  paid, doubled when it did not), the next look's step and the running mean of pay."""
  drafted = active & (jnp.asarray(cfg.budgets)[arm] > 1)
  a = jnp.where(ctrl.seen, cfg.decay, 0.0)

  def mean(old, new):
    a_ = a.reshape(a.shape + (1,) * (new.ndim - 1))
    keep = drafted.reshape(a_.shape)
    return jnp.where(keep, a_ * old + (1 - a_) * new, old)

  any_drafted = jnp.any(drafted)
  ratio = pay(cfg, arm, active, accepted)
  kept = jnp.where(jnp.any(ctrl.seen), cfg.decay, 0.0)     # the run's first draft sets it
  interval = jnp.where(ratio >= 1.0, cfg.explore_interval,
                       jnp.minimum(2 * ctrl.interval, LONGEST))
  interval = jnp.where(any_drafted, interval, ctrl.interval)
  return Controller(mass=mean(ctrl.mass, mass),
                    observed=mean(ctrl.observed, accepted.astype(jnp.float32)),
                    predicted=mean(ctrl.predicted, mass[:, arm]),
                    seen=ctrl.seen | drafted, interval=interval,
                    next_look=jnp.where(any_drafted, step + interval, ctrl.next_look),
                    pay=jnp.where(any_drafted, kept * ctrl.pay + (1 - kept) * ratio, ctrl.pay))
