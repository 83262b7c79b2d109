"""The paper's efficiency model: tokens/s ∝ (E[a] + 1) / (C_d + C_v(tree)).

Measured here on the current JAX device:
  C_v(n)  one jitted target forward over n tree nodes after a committed context (with logits),
  C_d     one jitted DFlash block pass (A = 1 block, or A = R alternatives re-drafted at once),
          or one AR-drafter single-token step.
Projected from them: the speedup over target-only AR of a method that verifies n̄ nodes per
iteration and emits τ = E[a] + 1 tokens per iteration,

  speedup = τ · C_v(1) / (C_d + C_v(n̄))      (AR emits one token per C_v(1)),

for (a) the measured curve and (b) a GPU-like flat curve C_v(n) = C_v(1) for n <= 64, with the
drafter priced at its measured cost relative to the target at equal token count. Both are
projections: measured TPOTs are reported separately.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NODES = (1, 2, 4, 8, 16, 32, 48, 64)


def best_ms(fn, *args, repeats: int) -> float:
  """Best-of-`repeats` ms of fn(*args) after one warm-up call (which also compiles); the minimum
  is the least disturbed by other work on a shared machine."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1000.0 * float(np.min(times))


def _context_cache(model, context: int, extra: int):
  cache = model.init_cache(1, context + extra)
  return cache.replace(lengths=jnp.full((1,), context, jnp.int32))


def verify_cost(target, nodes: Sequence[int] = NODES, context: int = 256,
                feature_layers: tuple[int, ...] = (), repeats: int = 5) -> dict[int, float]:
  """ms per target forward over n chain-shaped tree nodes (with logits), for each n."""
  graphdef, params = nnx.split(target)
  cache = _context_cache(target, context, max(nodes))

  @jax.jit
  def forward(params, tokens, positions, mask, cache):
    model = nnx.merge(graphdef, params)
    out = model(tokens, positions, cache, mask, feature_layers)
    return jnp.argmax(model.logits(out.hidden), axis=-1)

  costs = {}
  for n in nodes:
    tokens = jnp.zeros((1, n), jnp.int32)
    positions = context + jnp.arange(n)[None]
    old = jnp.broadcast_to(cache.visible()[:, None, :], (1, n, cache.max_len))
    mask = jnp.concatenate([old, jnp.tril(jnp.ones((n, n), bool))[None]], axis=-1)
    costs[int(n)] = best_ms(forward, params, tokens, positions, mask, cache, repeats=repeats)
  return costs


def draft_cost(target, drafter, alternatives: Sequence[int] = (1,), context: int = 256,
               repeats: int = 5) -> dict[int, float]:
  """ms per DFlash block pass drafting A blocks at once (A = 1: the main draft; A = R: the
  repair re-draft), including the draft logits through the target's head."""
  graphdef, params = nnx.split((target, drafter))
  k = drafter.cfg.block_size
  cache = _context_cache(drafter, context, k)

  @jax.jit
  def block(params, blocks, positions, cache):
    t, d = nnx.merge(graphdef, params)
    hidden = d(t.embed(blocks), positions, cache, jnp.full((1,), k, jnp.int32))
    return jnp.argmax(d.draft_logits(hidden[:, :, 1:], t), axis=-1)

  costs = {}
  for a in alternatives:
    blocks = jnp.zeros((1, a, k), jnp.int32)
    positions = context + jnp.arange(k)[None]
    costs[int(a)] = best_ms(block, params, blocks, positions, cache, repeats=repeats)
  return costs


def ar_draft_cost(drafter, context: int = 256, repeats: int = 5) -> float:
  """ms per single-token step of an autoregressive drafter."""
  return verify_cost(drafter, (1,), context, (), repeats)[1]


def interpolate(curve: dict[int, float], n: float) -> float:
  xs = np.array(sorted(curve))
  ys = np.array([curve[x] for x in xs])
  if n > xs[-1]:  # extrapolate linearly from the last two points
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return float(ys[-1] + slope * (n - xs[-1]))
  return float(np.interp(n, xs, ys))


def flat_curve(curve: dict[int, float]) -> dict[int, float]:
  """GPU-like: verifying up to 64 nodes costs what one token costs."""
  return {n: curve[min(curve)] for n in curve}


def projected_speedup(tau: float, nodes: Sequence[float] | float, draft_ms: float,
                      curve: dict[int, float]) -> float:
  """τ · C_v(1) / (C_d + mean C_v(n_t)); nodes: per-iteration node counts or their mean."""
  nodes = np.atleast_1d(np.asarray(nodes, np.float64))
  verify_ms = float(np.mean([interpolate(curve, n) for n in nodes])) if nodes.size else 0.0
  return tau * curve[min(curve)] / (draft_ms + verify_ms)


def method_draft_ms(method: str, costs: dict, gate_rate: float = 0.0, num_paths: int = 1,
                    gamma: int = 0, flat: bool = False) -> float:
  """Draft cost per iteration of a method from the measured costs dict (see `measure`).

  chain: one block pass. cure: one block pass plus, when the gate fires (share gate_rate of
  iterations), one re-draft pass over num_paths blocks. ar_draft: gamma + 1 drafter steps.
  flat=True prices the drafter on the GPU-like flat scale: its measured cost relative to the
  target at equal token count, times C_v(1).
  """
  if method == "ar":
    return 0.0
  if method == "ar_draft":
    # one token wide: its ratio to C_v(1) is the same on the flat scale
    return (gamma + 1) * costs["ar_draft_step_ms"]
  block = costs["draft_ms"]
  ms = block[1] + gate_rate * block.get(num_paths, block[1])
  if flat:
    ratio = ms / interpolate(costs["verify_ms"], costs["block_size"])
    return ratio * costs["verify_ms"][min(costs["verify_ms"])]
  return ms


def measure(target, drafter=None, ar_drafter=None, *, num_paths: int = 5, context: int = 256,
            nodes: Sequence[int] = NODES, feature_layers: tuple[int, ...] = (),
            repeats: int = 5) -> dict:
  """All measured costs (ms); int keys (json turns them into strings)."""
  out = dict(device=str(jax.devices()[0]), context=context,
             verify_ms=verify_cost(target, nodes, context, feature_layers, repeats))
  if drafter is not None:
    out["block_size"] = drafter.cfg.block_size
    out["draft_ms"] = draft_cost(target, drafter, sorted({1, num_paths}), context, repeats)
  if ar_drafter is not None:
    out["ar_draft_step_ms"] = ar_draft_cost(ar_drafter, context, repeats)
  return out


def machine_peaks(size: int = 2048, read_mib: int = 512, repeats: int = 5) -> dict[str, float]:
  """Best-of-`repeats` float32 speeds here: matmul GFLOP/s; streaming-read GB/s (a sum over an
  array far larger than the caches, as a forward streams its weights; no output to allocate);
  and the GB/s of weights that jitted matrix-vector products read (one token through 1024 x 4096
  weights, read_mib in all), i.e. what a single-token decode step can reach through XLA's dot."""
  a = jnp.ones((size, size), jnp.float32)
  x = jnp.ones((read_mib * 2**20 // 4,), jnp.float32)
  weights = [jnp.ones((1024, 4096), jnp.float32) for _ in range(read_mib // 16)]
  token = jnp.ones((1, 1024), jnp.float32)
  matmul_ms = best_ms(jax.jit(lambda a: a @ a), a, repeats=repeats)
  read_ms = best_ms(jax.jit(jnp.sum), x, repeats=repeats)
  gemv_ms = best_ms(jax.jit(lambda t, ws: sum(t @ w for w in ws)), token, weights, repeats=repeats)
  return dict(gflops=2 * size**3 / matmul_ms / 1e6, gbytes_per_s=x.nbytes / read_ms / 1e6,
              gemv_gbytes_per_s=x.nbytes / gemv_ms / 1e6)


def _param_count(module) -> int:
  return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(module, nnx.Param)))


def floors_ms(target, drafter, peaks: dict, nodes: dict[str, float], repair_paths: float = 0,
              repair_rows: float = 0, bytes_per_param: int = 4) -> dict[str, dict[str, float]]:
  """Roofline floor (ms) of each phase of one iteration per method: the larger of its FLOPs at
  peak matmul speed and its weight bytes at copy speed (activations and caches are small here).

  nodes: method -> mean verified nodes per iteration. The target costs 2 FLOPs per parameter per
  token outside the embedding plus the vocabulary head per node; a DFlash pass costs its layers
  per block token and the head per drafted position. CURE adds, per iteration, repair_paths more
  blocks through the layers and repair_rows more rows through the head (the re-drafted nodes
  its trees keep; both are means over iterations, so they include the gate rate).
  """
  h, vocab = target.cfg.hidden_size, target.cfg.vocab_size
  head = vocab * h
  body = _param_count(target) - head * (1 if target.cfg.tie_embeddings else 2)

  def floor(flops, params):
    return 1000 * max(flops / (peaks["gflops"] * 1e9),
                      params * bytes_per_param / (peaks["gbytes_per_s"] * 1e9))

  out = {}
  for method, n in nodes.items():
    verify = floor(2 * n * (body + head), body + head)
    draft = 0.0
    if method in ("chain", "cure") and drafter is not None:
      k = drafter.cfg.block_size
      blocks = 1 + (repair_paths if method == "cure" else 0)
      rows = k - 1 + (repair_rows if method == "cure" else 0)
      layers = _param_count(drafter.layers)  # fc / hidden_norm run once per committed token
      draft = floor(2 * (blocks * k * layers + rows * head), _param_count(drafter) + head)
    out[method] = dict(draft_ms=draft, verify_ms=verify, total_ms=draft + verify)
  return out
