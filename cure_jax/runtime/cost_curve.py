"""The device's costs, timed on the running device: the goodput controller's curve C(B, n) and
the online budget's four terms.

auto: for each node budget n, the target's forward over the first n nodes of a tree at batch
B, plus one drafter pass when n > 1 (a whole iteration at n). online (cure, hybrid): the
drafter pass without and with the repair re-draft, and the target over the block and over the
whole tree. Each is timed as the decoding loop runs it: in a compiled while loop over the
donated state (loop_seconds). The loop's attention reads the
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
from jax.experimental import multihost_utils

from cure_jax.methods.base import Spec
from cure_jax.runtime import decoding, files, xla_options
from cure_jax.runtime.default_model import cache_root

REPEATS = 5
ITERATIONS = 8   # trips of a timed loop
# what the cached curves measure: bumped when the timing changes, so that older files are not read
VERSION = 2


def _key(graphdef, params, spec: Spec, batch: int) -> str:
  """The same in every process for the same device, models, Spec and batch: the graphdef's
  text names functions by their address in this process, which is left out."""
  shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), params)
  auto = spec.auto and dataclasses.replace(spec.auto, costs=())   # what is being measured
  structure = re.sub(r" at 0x[0-9a-fA-F]+", "", str(graphdef))
  what = repr((VERSION, jax.devices()[0].device_kind, jax.default_backend(), structure, shapes,
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


def loop_seconds(graphdef, params, spec: Spec, batch: int, body, *consts) -> float:
  """Seconds per trip of body(target, drafter, state, *consts) -> state as the decoding loop
  runs it: inside a lax.while_loop, the state donated, the head rows of a draft vocabulary held
  once per call, compiled with the platform's XLA options; per trip (trip_seconds). Timed as a
  program of its own, a plain step cost 24.5 ms on XLA:CPU against 17.0 in the loop (SmolLM2,
  2026-12-07)."""
  def run(params, st, trips, consts):
    target, drafter = decoding.models(graphdef, params, spec)
    return jax.lax.fori_loop(0, trips, lambda _, s: body(target, drafter, s, *consts), st)

  st = _start(graphdef, params, spec, batch)
  options = xla_options.platform_options(jax.default_backend())
  # the state leaves as it came (on a mesh the compiler may pick other shardings for a leaf)
  keep = jax.tree.map(lambda x: x.sharding, st)
  compiled = xla_options.compile_with(
      jax.jit(run, donate_argnums=1, out_shardings=keep).lower(params, st, jnp.int32(1), consts),
      options)
  state = [st]

  def call(trips):   # each call takes the state the last one left
    state[0] = compiled(params, state[0], jnp.int32(trips), consts)
    return state[0]
  return trip_seconds(call)


def trip_seconds(call) -> float:
  """Seconds per trip of call(trips), a compiled loop: the median of REPEATS calls of
  ITERATIONS trips each, after a warm-up, over ITERATIONS. The call's own costs are spread over
  its trips (on the embedded default ~0.15 ms a trip; a difference of two trip counts leaves
  them out but can come out negative where a trip costs less than the noise)."""
  return seconds(lambda: call(ITERATIONS)) / ITERATIONS


def drafting(spec: Spec, want: bool | None = None):
  """A loop body that runs the drafter pass (with `want`, the online budget's choice for every
  row) and carries its drafter state and first drafted token, so that no trip is loop-invariant."""
  def body(target, drafter, st):
    rows = None if want is None else jnp.full(st.anchor.shape, want)
    proposal, dcache = decoding.propose(target, drafter, spec, st, rows)
    drafted = proposal.tree.tokens[:, min(1, proposal.tree.size - 1)]               # [B]
    return st.replace(dcache=dcache, anchor=drafted)
  return body


def verifying(spec: Spec, n: int):
  """A loop body that verifies the first n nodes of a fixed proposal and commits the accepted
  keys/values to the target cache (no drafter resync), as an iteration does."""
  def body(target, drafter, st, proposal):
    verdict, verified = decoding.verify_budget(target, spec, st, proposal, n)
    return decoding.commit(drafter, spec, st, proposal, st.dcache, verdict, verified,
                           resync=False)
  return body


def plain(spec: Spec):
  """auto's plain step (budget 1) as its inner loop runs it."""
  def body(target, drafter, st):
    return decoding.plain_iteration(target, spec, st, jnp.zeros(st.anchor.shape))[0]
  return body


def drafted(spec: Spec, arm: int):
  """auto's whole iteration at budget index `arm`: drafter pass, verification, commit, resync
  and the controller's update (its costs, while they are being timed, placeholders)."""
  if not spec.auto.costs:
    spec = dataclasses.replace(spec, auto=dataclasses.replace(
        spec.auto, costs=(1.0,) * len(spec.auto.budgets)))

  def body(target, drafter, st):
    return decoding.drafted_iteration(target, drafter, spec, st, jnp.int32(arm))
  return body


def proposal_of(graphdef, params, spec: Spec, batch: int, want: bool | None = None):
  """A proposal after the timers' prompt, for the verification loop to verify."""
  @jax.jit
  def run(params, st):
    target, drafter = decoding.models(graphdef, params, spec)
    rows = None if want is None else jnp.full(st.anchor.shape, want)
    return decoding.propose(target, drafter, spec, st, rows)[0]
  return run(params, _start(graphdef, params, spec, batch))


def draft_seconds(graphdef, params, spec: Spec, batch: int) -> float:
  """Seconds of one drafter pass in the loop, the draft logits through the head included."""
  return loop_seconds(graphdef, params, spec, batch, drafting(spec))


def time_budgets(graphdef, params, spec: Spec, batch: int) -> dict:
  """Seconds of one drafter pass and, per budget, of the rest of an iteration at that budget
  (verification, commit, resync, the controller's update; budget 1: a plain step), each timed
  in the loop: C(n) = draft_s + verify_s[n] is a whole iteration at n."""
  draft = draft_seconds(graphdef, params, spec, batch)
  verify = [loop_seconds(graphdef, params, spec, batch, plain(spec)) if n == 1 else
            loop_seconds(graphdef, params, spec, batch, drafted(spec, i)) - draft
            for i, n in enumerate(spec.auto.budgets)]
  return dict(draft_s=draft, budgets=list(spec.auto.budgets),
              verify_s=[max(v, 0.0) for v in verify])


def time_online(graphdef, params, spec: Spec, batch: int) -> dict:
  """Seconds of the online budget's terms: the drafter pass without and with the repair
  re-draft, and the target over the block (branch 0) and over the whole tree (v_max), each
  verification with its commit, in the loop."""
  proposal = proposal_of(graphdef, params, spec, batch, True)
  k, v = spec.block_size, spec.cure.v_max
  timed = lambda body, *consts: loop_seconds(graphdef, params, spec, batch, body, *consts)
  return dict(draft_s=timed(drafting(spec, False)), draft_repair_s=timed(drafting(spec, True)),
              nodes=[k, v], verify_s=[timed(verifying(spec, n), proposal) for n in (k, v)])


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
