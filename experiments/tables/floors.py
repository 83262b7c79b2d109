"""Each part of auto's loop beside its floor, both timed in one run on this device, so that a
regression shows: the plain step and the verification of each budget's nodes against the
target's matmuls alone over as many rows, the drafter pass against its layers' matmuls over
the block with the head it reads (the draft vocabulary's rows, or the whole head), and a whole
drafted iteration (drafter pass, verification, commit, resync) against the two floors' sum.

A floor is the model's own weights multiplied in sequence as a layer uses them (q/k/v/o, then
gate/up/down, every layer, then the head), jitted; no attention, norms or cache. The loop's
parts are timed as auto's cost curve times them, in a compiled loop over the donated state
(cure_jax/runtime/cost_curve.py; a verification with its commit), each floor by the median of
its calls, at batch 1.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.analysis.report import md_table, num
from cure_jax.runtime import cost_curve, pipeline
from experiments.tables.bench import Bench, write_outputs

ROWS = (1, 2, 4, 8, 16, 32)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_weights(model) -> list[dict]:
  """Per layer, its projections' kernels [in, out] by name."""
  flat = nnx.to_flat_state(nnx.state(model.layers))
  layers = {}
  for path, value in flat:
    if path[-1] == "kernel" and path[-2] in PROJECTIONS:
      layers.setdefault(path[0], {})[path[-2]] = value.get_value()
  return [layers[i] for i in sorted(layers)]


def matmul_floor(layers: list[dict], head, rows: int):
  """A jitted f(layers, head, x) of x [rows, H] through every layer's seven products (each
  output feeds the next as in the layer; k and v feed it through their means) and the head
  [N, H]: what a pass over `rows` rows cannot do without. Returns (f, its arguments)."""
  hidden = head.shape[1]

  @jax.jit
  def run(layers, head, x):
    for w in layers:
      q, k, v = x @ w["q_proj"], x @ w["k_proj"], x @ w["v_proj"]
      x = x + q @ w["o_proj"] + jnp.mean(k) + jnp.mean(v)
      x = x + (jax.nn.silu(x @ w["gate_proj"]) * (x @ w["up_proj"])) @ w["down_proj"]
    return x @ head.T

  x = jnp.asarray(np.random.default_rng(0).normal(size=(rows, hidden)) * 0.01, head.dtype)
  return run, (layers, head, x)


def floor_seconds(layers: list[dict], head, rows: int) -> float:
  """Seconds per trip of the floor in a compiled loop (each trip's logits feed the next's
  rows), timed as the loop's parts are (cost_curve.trip_seconds)."""
  fn, (layers, head, x) = matmul_floor(layers, head, rows)

  @jax.jit
  def loop(layers, head, x, trips):
    return jax.lax.fori_loop(0, trips, lambda _, x: x + 1e-6 * fn(layers, head, x)[:, :1], x)
  return cost_curve.trip_seconds(lambda trips: loop(layers, head, x, jnp.int32(trips)))


def table_floors(bench: Bench) -> dict:
  config = copy.deepcopy(bench.config)
  with config.unlocked():
    config.auto.fallback = False          # auto's loop and curve whatever the costs say
    # placeholder costs, so that the Spec is built without timing: the curve is timed below,
    # beside the floors
    config.auto.costs = ",".join("1" for _ in str(config.auto.budgets).split(","))
  gen = pipeline.make_generator(config, bench.target, bench.drafter, bench.stops, "auto")
  spec = gen.spec(gen.cache_len(len(bench.ids[0])), 1)
  g, p = gen.graphdef, gen.params
  loop = cost_curve.time_budgets(g, p, spec, 1)
  proposal = cost_curve.proposal_of(g, p, spec, 1)
  verify = {n: cost_curve.loop_seconds(g, p, spec, 1, cost_curve.verifying(spec, n), proposal)
            for n in loop["budgets"][1:]}
  target, drafter = bench.target, bench.drafter
  head = target.head_rows(np.arange(target.cfg.vocab_size, dtype=np.int32))
  head = head if head.shape[0] == target.cfg.vocab_size else head.T          # [V, H]
  target_layers = layer_weights(target)
  floors = {r: floor_seconds(target_layers, head, r) for r in ROWS}
  for n in verify:
    floors[n] = floors.get(n) or floor_seconds(target_layers, head, n)
  block = spec.block_size                                     # the block: anchor and drafts
  vocab = np.asarray(spec.draft_vocab or np.arange(target.cfg.vocab_size), np.int32)
  draft_floor = floor_seconds(layer_weights(drafter), head[vocab], block)
  draft_whole = floor_seconds(layer_weights(drafter), head, block)
  rows = [dict(part="plain step (1 row)", loop_ms=1e3 * loop["verify_s"][0],
               floor_ms=1e3 * floors[1])]
  rows += [dict(part=f"verify {n} nodes", loop_ms=1e3 * s, floor_ms=1e3 * floors[n])
           for n, s in verify.items()]
  rows.append(dict(part=f"drafter pass ({block} rows, {len(vocab)}-token head)",
                   loop_ms=1e3 * loop["draft_s"], floor_ms=1e3 * draft_floor))
  rows += [dict(part=f"iteration at {n} nodes", loop_ms=1e3 * (loop["draft_s"] + s),
                floor_ms=1e3 * (draft_floor + floors[n]))
           for n, s in zip(loop["budgets"][1:], loop["verify_s"][1:])]
  for r in rows:
    r["ratio"] = r["loop_ms"] / r["floor_ms"]
  payload = dict(rows=rows, matmul_floor_ms={r: 1e3 * s for r, s in floors.items()},
                 drafter_floor_whole_head_ms=1e3 * draft_whole, budgets=loop["budgets"],
                 draft_vocab=len(spec.draft_vocab))
  md = ["## The loop's parts beside their floors (auto's cost curve vs the same weights' "
        "matmuls alone, batch 1, one run)", "",
        md_table(["part", "in the loop ms", "floor ms", "loop / floor"],
                 [[r["part"], num(r["loop_ms"], ".1f"), num(r["floor_ms"], ".1f"),
                   num(r["ratio"], ".2f", "×")] for r in rows]), "",
        md_table(["rows"] + [str(r) for r in ROWS],
                 [["target matmuls ms"] + [num(1e3 * floors[r], ".1f") for r in ROWS]]), "",
        f"Drafter floor with the whole {target.cfg.vocab_size}-token head: "
        f"{1e3 * draft_whole:.1f} ms."]
  return write_outputs(bench, "floors", payload, "\n".join(md) + "\n")
