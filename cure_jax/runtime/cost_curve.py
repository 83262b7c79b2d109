"""The device's costs, timed on the running device: the goodput controller's curve C(B, n) and
the online budget's four terms.

auto: for each node budget n, the target's forward over the first n nodes of a tree at batch
B, plus one drafter pass when n > 1. online (cure, hybrid): the drafter pass without and with
the repair re-draft, and the target over the block and over the whole tree. Each is timed from
its own compiled program (median of a few runs after a warm-up). The loop's attention reads the
whole static cache whatever the context, so one short prompt stands for every length. Results
are cached per device kind, model pair, method, batch and max_len in the project's cache
(`<cure_jax cache>/costs/`), so a second run starts at once; delete the folder to re-measure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
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
  """The same in every process for the same device, models, Spec and batch: the graphdef's
  text names functions by their address in this process, which is left out."""
  shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), params)
  auto = spec.auto and dataclasses.replace(spec.auto, costs=())   # what is being measured
  structure = re.sub(r" at 0x[0-9a-fA-F]+", "", str(graphdef))
  what = repr((jax.devices()[0].device_kind, jax.default_backend(), structure, shapes,
               dataclasses.replace(spec, auto=auto), batch))
  return hashlib.sha1(what.encode()).hexdigest()[:16]


def seconds(fn, *args) -> float:
  """Median seconds of fn(*args) over REPEATS runs after one to compile and warm up."""
  jax.block_until_ready(fn(*args))  # compile and warm up
  runs = []
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    runs.append(time.perf_counter() - t0)
  return statistics.median(runs)


def _start(graphdef, params, spec: Spec, batch: int):
  """The state after an 8-token prompt (the attention reads the whole static cache anyway)."""
  prompt = jnp.ones((batch, 8), jnp.int32)
  return decoding.prefill(graphdef, params, prompt, jnp.full((batch,), 8, jnp.int32), spec=spec)


def _drafting(graphdef, params, spec: Spec, want: bool | None = None):
  """A jitted drafter pass, called as f(params, st); with `want`, the online budget's choice for
  every row. A draft vocabulary's head rows are gathered once beforehand, as decoding.decode
  gathers them before its loop, so that the pass costs what it costs in the loop."""
  held = None
  if spec.draft_vocab:
    target, _ = nnx.merge(graphdef, params)
    held = target.head_rows(np.asarray(spec.draft_vocab, np.int32))

  @jax.jit
  def draft(params, st, held):
    target, drafter = nnx.merge(graphdef, params)
    if held is not None:
      drafter.hold_head_rows(target, spec.draft_vocab, held)
    rows = None if want is None else jnp.full(st.anchor.shape, want)
    return decoding.propose(target, drafter, spec, st, rows)[0]
  return lambda params, st: draft(params, st, held)


def _verifying(graphdef, spec: Spec, n: int):
  """A jitted target pass over the first n nodes of a proposal, with its verification."""
  @jax.jit
  def run(params, st, proposal):
    target, _ = nnx.merge(graphdef, params)
    return decoding.verify_budget(target, spec, st, proposal, n)[0].next_token
  return run


def draft_seconds(graphdef, params, spec: Spec, batch: int) -> float:
  """Seconds of one drafter pass, the draft logits through the head included (median); a draft
  vocabulary's head rows are gathered beforehand, as in the decoding loop."""
  return seconds(_drafting(graphdef, params, spec), params, _start(graphdef, params, spec, batch))


def time_budgets(graphdef, params, spec: Spec, batch: int) -> dict:
  """Seconds of one drafter pass and of the target's pass over each budget's nodes."""
  st = _start(graphdef, params, spec, batch)
  draft = _drafting(graphdef, params, spec)
  proposal = draft(params, st)
  return dict(draft_s=seconds(draft, params, st), budgets=list(spec.auto.budgets),
              verify_s=[seconds(_verifying(graphdef, spec, n), params, st, proposal)
                        for n in spec.auto.budgets])


def time_online(graphdef, params, spec: Spec, batch: int) -> dict:
  """Seconds of the online budget's terms: the drafter pass without and with the repair
  re-draft, and the target over the block (branch 0) and over the whole tree (v_max)."""
  st = _start(graphdef, params, spec, batch)
  chain, tree = _drafting(graphdef, params, spec, False), _drafting(graphdef, params, spec, True)
  proposal = tree(params, st)
  k, v = spec.block_size, spec.cure.v_max
  return dict(draft_s=seconds(chain, params, st), draft_repair_s=seconds(tree, params, st),
              nodes=[k, v], verify_s=[seconds(_verifying(graphdef, spec, n), params, st,
                                               proposal) for n in (k, v)])


def _cached(kind: str, graphdef, params, spec: Spec, batch: int, timer, log) -> dict:
  """timer's result from the cache, or timed now and cached (one process times, all read)."""
  path = cache_root() / "costs" / f"{kind}-{_key(graphdef, params, spec, batch)}.json"
  if path.exists():
    return json.loads(path.read_text())
  log(f"cure_jax: timing the {kind} costs for batch {batch} (once per device, model pair and "
      "batch; kept in the cure_jax cache's costs/)")
  curve = timer(graphdef, params, spec, batch)
  curve.update(device=jax.devices()[0].device_kind, batch=batch)
  files.write_json(str(path), curve)
  return curve


def _same_everywhere(values) -> tuple[float, ...]:
  if jax.process_count() > 1:  # every process must compile the same loop: process 0's numbers
    values = multihost_utils.broadcast_one_to_all(np.asarray(values))
  return tuple(float(x) for x in values)


def costs(graphdef, params, spec: Spec, batch: int, log=print) -> tuple[float, ...]:
  """C(B, n) per budget in seconds, from the cache or timed now (and cached)."""
  curve = _cached("auto", graphdef, params, spec, batch, time_budgets, log)
  return _same_everywhere([v + (curve["draft_s"] if n > 1 else 0.0)
                           for n, v in zip(spec.auto.budgets, curve["verify_s"])])


def online_costs(graphdef, params, spec: Spec, batch: int, log=print) -> tuple[float, ...]:
  """The online budget's (C_d, C_r, C_v base, C_v per node) in seconds: C_v(n) is the line
  through the block's and the tree's measured costs (an MoE's is steep, a dense GPU's flat)."""
  c = _cached("online", graphdef, params, spec, batch, time_online, log)
  (k, v), (cv_k, cv_v) = c["nodes"], c["verify_s"]
  per_node = max(cv_v - cv_k, 0.0) / max(v - k, 1)
  return _same_everywhere([c["draft_s"], max(c["draft_repair_s"] - c["draft_s"], 0.0),
                           cv_k - per_node * k, per_node])
