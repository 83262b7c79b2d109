"""The device's cost curve C(B, n) for the goodput controller, timed on the running device.

For each node budget n: the target's forward over the first n nodes of a tree at batch B, plus
one drafter pass when n > 1, each timed from its own compiled program (median of a few runs
after a warm-up). The loop's attention reads the whole static cache whatever the context, so
one short prompt stands for every length. Results are cached per device kind, model pair,
method, batch and max_len in the project's cache (`<cure_jax cache>/costs/`), so a second run
starts at once; delete the folder to re-measure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from cure_jax.methods.base import Spec
from cure_jax.runtime import decoding, files
from cure_jax.runtime.default_model import cache_root

REPEATS = 5


def _key(graphdef, params, spec: Spec, batch: int) -> str:
  shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), params)
  what = repr((jax.devices()[0].device_kind, jax.default_backend(), str(graphdef), shapes,
               dataclasses.replace(spec, auto=dataclasses.replace(spec.auto, costs=())), batch))
  return hashlib.sha1(what.encode()).hexdigest()[:16]


def _seconds(fn, *args) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  runs = []
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    runs.append(time.perf_counter() - t0)
  return statistics.median(runs)


def time_budgets(graphdef, params, spec: Spec, batch: int) -> dict:
  """Seconds of one drafter pass and of the target's pass over each budget's nodes."""
  prompt = jnp.ones((batch, 8), jnp.int32)
  st = decoding.prefill(graphdef, params, prompt, jnp.full((batch,), 8, jnp.int32), spec=spec)

  @jax.jit
  def draft(params, st):
    target, drafter = nnx.merge(graphdef, params)
    return decoding.propose(target, drafter, spec, st)[0]

  def verify(n):
    @jax.jit
    def run(params, st, proposal):
      target, _ = nnx.merge(graphdef, params)
      return decoding.verify_budget(target, spec, st, proposal, n)[0].next_token
    return run

  proposal = draft(params, st)
  return dict(draft_s=_seconds(draft, params, st),
              verify_s=[_seconds(verify(n), params, st, proposal) for n in spec.auto.budgets])


def costs(graphdef, params, spec: Spec, batch: int, log=print) -> tuple[float, ...]:
  """C(B, n) per budget in seconds, from the cache or timed now (and cached)."""
  path = cache_root() / "costs" / f"{_key(graphdef, params, spec, batch)}.json"
  if path.exists():
    curve = json.loads(path.read_text())
  else:
    log(f"cure_jax: timing the cost curve for batch {batch}, budgets {spec.auto.budgets} "
        "(once per device, model pair and batch; kept in the cure_jax cache's costs/)")
    curve = time_budgets(graphdef, params, spec, batch)
    curve.update(device=jax.devices()[0].device_kind, batch=batch,
                 budgets=list(spec.auto.budgets))
    files.write_json(str(path), curve)
  seconds = [v + (curve["draft_s"] if n > 1 else 0.0)
             for n, v in zip(spec.auto.budgets, curve["verify_s"])]
  if jax.process_count() > 1:  # every process must compile the same loop: process 0's curve
    seconds = multihost_utils.broadcast_one_to_all(np.asarray(seconds))
  return tuple(float(x) for x in seconds)

