"""Decoding one iteration at a time on the host, keeping every iteration's tree and verdict.

For looking at what a method did (the tree picture in the notebooks), not for speed: the
`Generator` runs the same propose -> verify -> commit steps inside one compiled while loop, and
a replay emits exactly its tokens (tests/test_replay.py). Greedy decoding only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.costs import efficiency
from cure_jax.runtime import decoding
from cure_jax.runtime.generation import Generator, prompt_bucket


@dataclasses.dataclass
class Iteration:
  """One iteration of one sequence: its candidate tree and what the target did with it."""

  index: int
  tokens: np.ndarray           # [V] node tokens (node 0 = the root, the anchor)
  parent: np.ndarray           # [V] parent node, -1 for the root and padding
  depth: np.ndarray            # [V]
  valid: np.ndarray            # [V] bool
  branch: np.ndarray           # [V] 0 = branch 0, r + 1 = repair path r, -1 = padding
  accepted: np.ndarray         # [V] bool: the target accepted the node's whole root path
  path: list[int]              # the winning path's nodes, root first
  # Under greedy verification the accepted nodes are exactly the winning path: siblings carry
  # distinct tokens and only one of them can be the target's argmax at their parent.
  winning_branch: int
  next_token: int              # the bonus token
  emitted: list[int]           # tokens this iteration appended to the output
  ufp_positions: list[int]     # focal block positions (1..K-1) the gate chose
  ufp_margins: list[float]
  branches: list[int]          # alternatives granted at each focal position
  block_margins: np.ndarray    # [K-1] top-1 minus top-2 of the main draft's logits


def prefill_state(generator: Generator, prompt: Sequence[int]):
  """(spec, the decoding state after the prompt) for batch 1 at the generator's shapes."""
  spec = generator.spec(generator.cache_len(len(prompt)))
  padded = np.zeros((1, prompt_bucket(len(prompt))), np.int32)
  padded[0, :len(prompt)] = prompt
  state = decoding.prefill(generator.graphdef, generator.params, jnp.asarray(padded),
                           jnp.asarray([len(prompt)], jnp.int32),
                           jax.random.key(generator.seed), spec=spec)
  return spec, state


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _step(graphdef, params, state, *, spec):
  """decoding.iteration, also returning the proposal and the verdict."""
  target, drafter = nnx.merge(graphdef, params)
  proposal, dcache = decoding.propose(target, drafter, spec, state)
  verdict, verified = decoding.verify_tree(target, spec, state, proposal)
  new = decoding.commit(drafter, spec, state, proposal, dcache, verdict, verified)
  return new, proposal, verdict


@dataclasses.dataclass
class Replay:
  first_token: int             # the prefill's token
  iterations: list[Iteration]

  @property
  def output_ids(self) -> list[int]:
    """The decoded tokens, as `Generator.generate` returns them."""
    return [self.first_token] + [x for it in self.iterations for x in it.emitted]


def replay(generator: Generator, prompt: Sequence[int]) -> Replay:
  """Every iteration of decoding `prompt` (batch 1) with the generator's method and settings."""
  if not generator.sampling.greedy:
    raise ValueError("replay follows greedy decoding only (temperature 0)")
  spec, state = prefill_state(generator, prompt)
  first = int(state.tokens[0, 0])
  out = []
  while not bool(state.done[0]) and int(state.step) < spec.max_new_tokens:
    before = int(state.produced[0])
    state, proposal, verdict = _step(generator.graphdef, generator.params, state, spec=spec)
    t, (st, v) = proposal.tree, jax.device_get((state, verdict))
    a = int(v.accepted[0])
    path = [int(n) for n in v.path[0, :a + 1]]
    gate = proposal.gate
    ufp = [] if gate is None else [int(x) for x in gate.positions[0] if x > 0]
    keep = slice(0, len(ufp))
    out.append(Iteration(
        index=len(out), tokens=np.asarray(t.tokens[0]), parent=np.asarray(t.parent[0]),
        depth=np.asarray(t.depth[0]), valid=np.asarray(t.valid[0]),
        branch=np.asarray(t.branch[0]), accepted=np.isin(np.arange(t.size), path), path=path,
        winning_branch=int(np.asarray(t.branch[0])[int(v.winner[0])]),
        next_token=int(v.next_token[0]),
        emitted=[int(x) for x in st.tokens[0, before:int(st.produced[0])]],
        ufp_positions=ufp,
        ufp_margins=[] if gate is None else [float(m) for m in gate.margins[0, keep]],
        branches=[] if gate is None else [int(b) for b in gate.branches[0, keep]],
        block_margins=(np.zeros(0) if proposal.block_margins is None
                       else np.asarray(proposal.block_margins[0]))))
  return Replay(first, out)


def phase_ms(generator, prompt: Sequence[int], repeats: int = 5) -> dict[str, float]:
  """ms of each phase of one decoding iteration at a real run's shapes (batch 1, the state right
  after prefill): draft + tree build, target verification, commit + resync. Each phase is jitted
  alone here, so the sum exceeds the fused loop's iteration time by the dispatch overheads."""
  spec, state = prefill_state(generator, prompt)
  graphdef, params = generator.graphdef, generator.params

  @jax.jit
  def draft(params, st):
    target, drafter = nnx.merge(graphdef, params)
    return decoding.propose(target, drafter, spec, st)

  @jax.jit
  def verify(params, st, proposal):
    target, _ = nnx.merge(graphdef, params)
    return decoding.verify_tree(target, spec, st, proposal)

  @jax.jit
  def commit(params, st, proposal, dcache, verdict, verified):
    _, drafter = nnx.merge(graphdef, params)
    return decoding.commit(drafter, spec, st, proposal, dcache, verdict, verified)

  proposal, dcache = draft(params, state)
  verdict, verified = verify(params, state, proposal)
  return dict(draft_and_tree_ms=efficiency.best_ms(draft, params, state, repeats=repeats),
              verify_ms=efficiency.best_ms(verify, params, state, proposal, repeats=repeats),
              commit_and_resync_ms=efficiency.best_ms(commit, params, state, proposal, dcache,
                                                      verdict, verified, repeats=repeats))
