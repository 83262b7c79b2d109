"""Slots over the compiled loop: requests come and go while one decode state runs.

JetStream's shape on `decoding.iteration`: the state holds S slots, each a row of the batch
with its own caches, position, drafter state, produced count and token limit. `insert` prefills
one request (in chunks, `decoding.prefill` at batch 1) and writes its row into a free slot;
`step` runs one compiled chunk of up to `steps` iterations for every live slot inside one
`lax.while_loop` (a free or finished slot is a done row: masked, as in offline decoding) and
returns each slot's new tokens; `cancel` ends a slot. The host syncs once per chunk.

Every program is compiled once, when the engine is built, for its (Spec, slots, cache length):
a request's prompt is padded to the cache length, its token limit and key are row values.
A sampled engine (its Spec's temperature > 0) takes each request's temperature, top-k and top-p
as row values too (`sampling.Rows`): rows at temperature 0 decode greedily in the same program.
A request's random numbers come from its own seed (the row key of `Generator.generate` for a
prompt decoded alone), never from its slot; with numerics=invariant a row's logits do not
depend on the rows beside it, so its tokens are those of decoding it alone at batch 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cure_jax.runtime import decoding
from cure_jax.runtime.generation import Generator
from cure_jax.tree.sampling import Rows, Sampling


@dataclasses.dataclass(frozen=True)
class Request:
  """What one slot decodes: prompt ids, the most tokens to produce, the sampling seed and
  settings (None: the engine's)."""

  prompt: tuple[int, ...]
  max_tokens: int
  seed: int = 0
  sampling: Sampling | None = None


@dataclasses.dataclass
class Update:
  """What a chunk did for one live slot: its new tokens and iterations' records."""

  slot: int
  tokens: list[int]
  finished: bool
  accept_lengths: list[int]   # tokens emitted per iteration (accepted drafts + bonus)
  nodes_verified: list[int]   # tree nodes per iteration, root included
  repair_gain: list[int]      # drafts the winner got accepted beyond branch 0
  budgets: list[int]          # node budget auto chose per iteration (0: no controller)


def _place(state: decoding.State, row: decoding.State, slot, limit) -> decoding.State:
  """state with row (a batch-1 state) written into `slot`, its token limit set."""
  row = row.replace(limit=jnp.reshape(limit, (1,)), done=row.done | (limit <= 1))
  return jax.tree.map(lambda big, one: big.at[slot].set(one[0]) if big.ndim else big,
                      state, row)


def _cancel(state: decoding.State, slot) -> decoding.State:
  return state.replace(done=state.done.at[slot].set(True))


def _chunk(graphdef, params, state: decoding.State, *, spec, steps: int) -> decoding.State:
  """Up to `steps` iterations for every live slot; the step counter restarts per chunk, so the
  per-iteration records of this chunk sit in columns 0.. of the state's stats."""
  target, drafter = decoding._merge(graphdef, params)
  if spec.draft_vocab:
    drafter.hold_head_rows(target, spec.draft_vocab)
  state = state.replace(step=jnp.zeros((), jnp.int32))
  return jax.lax.while_loop(lambda st: jnp.any(~st.done) & (st.step < steps),
                            lambda st: decoding.iteration(target, drafter, spec, st), state)


class Engine:
  """S slots decoding with one Generator's method, models and settings; max_len: the cache
  length every slot has (prompt + max_tokens - 1 must fit), steps: iterations per chunk (the
  host's turn comes once per chunk: time to first token against dispatch overhead)."""

  def __init__(self, generator: Generator, slots: int, max_len: int, steps: int = 8):
    if slots < 1:
      raise ValueError(f"slots={slots} must be >= 1 (requests decoded at once)")
    if steps < 1:
      raise ValueError(f"steps={steps} must be >= 1 (iterations per chunk)")
    if generator.mesh is not None:
      raise ValueError("the serving engine runs on one device: set mesh.data=1 and mesh.model=1")
    self.generator, self.slots, self.max_len = generator, slots, max_len
    self.max_tokens = generator.max_new_tokens
    self.steps = min(steps, self.max_tokens)
    generator.check_memory(slots, max_len, max_len)
    self.spec = generator.spec(max_len, slots)
    self.sampled = not generator.sampling.greedy   # per-request settings in one program
    self._compile()
    self.state = self._tile(self._prefill(Request((0,), 1)), slots)
    self._seen = np.zeros(slots, np.int64)        # tokens of each slot already returned
    self._iterations = np.zeros(slots, np.int64)  # iterations of each slot already returned
    self.live = np.zeros(slots, bool)

  # --- compiled once ------------------------------------------------------------------------

  def _compile(self):
    g = self.generator
    platform = jax.default_backend()
    options = decoding.platform_options(platform, dict(g.compiler_options))
    prompt = jax.ShapeDtypeStruct((1, self.max_len), jnp.int32)
    plen = jax.ShapeDtypeStruct((1,), jnp.int32)
    rng = jax.eval_shape(jax.random.key, 0)
    first = jax.ShapeDtypeStruct((), jnp.int32)
    rows = jax.eval_shape(lambda: Rows.of(g.sampling)) if self.sampled else None
    self._pre = decoding.compile_with(decoding.prefill.lower(
        g.graphdef, g.params, prompt, plen, rng, first, rows, spec=self.spec), options)
    row = jax.eval_shape(lambda p, n, k, f, r: decoding.prefill(g.graphdef, g.params, p, n, k, f,
                                                                r, spec=self.spec),
                         prompt, plen, rng, first, rows)
    state = jax.eval_shape(lambda r: self._tile(r, self.slots), row)
    slot = jax.ShapeDtypeStruct((), jnp.int32)
    chunk = jax.jit(_chunk, donate_argnums=2, static_argnames=("graphdef", "spec", "steps"))
    self._run = decoding.compile_with(chunk.lower(g.graphdef, g.params, state, spec=self.spec,
                                                  steps=self.steps), options)
    self._put = jax.jit(_place, donate_argnums=0).lower(state, row, slot, slot).compile()
    self._end = jax.jit(_cancel, donate_argnums=0).lower(state, slot).compile()

  @staticmethod
  def _tile(row: decoding.State, slots: int) -> decoding.State:
    """slots copies of a batch-1 state, every one done (free)."""
    index = jnp.zeros((slots,), jnp.int32)
    state = jax.tree.map(lambda x: x[index] if x.ndim else x, row)
    return state.replace(done=jnp.ones((slots,), bool),
                         limit=jnp.ones((slots,), jnp.int32))

  def _prefill(self, request: Request) -> decoding.State:
    g = self.generator
    prompt = np.zeros((1, self.max_len), np.int32)
    prompt[0, :len(request.prompt)] = request.prompt
    rows = Rows.of(request.sampling or g.sampling) if self.sampled else None
    return self._pre(g.params, jnp.asarray(prompt), jnp.asarray([len(request.prompt)], jnp.int32),
                     jax.random.key(request.seed), np.int32(0), rows)

  # --- the host's side ----------------------------------------------------------------------

  def check(self, prompt_len: int, max_tokens: int) -> None:
    """Raises ValueError naming the limit a request breaks."""
    if prompt_len < 1:
      raise ValueError("the prompt is empty: it needs at least one token")
    if max_tokens < 1:
      raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if max_tokens > self.max_tokens:
      raise ValueError(f"max_tokens={max_tokens} is over this server's limit of "
                       f"{self.max_tokens} (its max_new_tokens)")
    if prompt_len + max_tokens - 1 > self.max_len:
      raise ValueError(f"prompt of {prompt_len} tokens + max_tokens={max_tokens} needs a cache "
                       f"of {prompt_len + max_tokens - 1}, over this server's max_len="
                       f"{self.max_len}: shorten the prompt or lower max_tokens to "
                       f"{max(self.max_len - prompt_len + 1, 0)}")

  def free_slots(self) -> list[int]:
    return [int(i) for i in np.flatnonzero(~self.live)]

  def insert(self, slot: int, request: Request) -> int:
    """Prefills `request` into the free `slot`; returns its first token (the prefill's), so
    that it reaches the client before the next chunk has run."""
    if self.live[slot]:
      raise ValueError(f"slot {slot} is busy")
    self.check(len(request.prompt), request.max_tokens)
    if request.sampling is not None:
      request.sampling.validate()
      if not self.sampled and not request.sampling.greedy:
        raise ValueError(f"temperature={request.sampling.temperature}: this engine's program "
                         "is greedy; build it with a temperature > 0 to sample per request")
    row = self._prefill(request)
    first = int(row.anchor[0])
    self.state = self._put(self.state, row, np.int32(slot), np.int32(request.max_tokens))
    self._seen[slot], self._iterations[slot] = 1, 0
    self.live[slot] = True
    return first

  def cancel(self, slot: int) -> None:
    """Ends the request in `slot`; the slot is free for the next insert."""
    self.state = self._end(self.state, np.int32(slot))
    self.live[slot] = False

  def step(self) -> list[Update]:
    """One chunk (after which the host reads the results once); an Update per live slot with
    its tokens after the first. Finished slots become free."""
    if self.live.any():
      self.state = self._run(self.generator.params, self.state)
    st = self.state
    tokens, produced, done, iterations, stats = jax.device_get(
        (st.tokens, st.produced, st.done, st.iterations,
         (st.stats.accept_lengths, st.stats.nodes_verified, st.stats.repair_gain,
          st.stats.budget)))
    updates = []
    for slot in np.flatnonzero(self.live):
      n = int(produced[slot])
      new = int(iterations[slot] - self._iterations[slot])
      rows = [s[slot, :new].tolist() for s in stats]
      updates.append(Update(int(slot), tokens[slot, self._seen[slot]:n].tolist(),
                            bool(done[slot]), *rows))
      self._seen[slot], self._iterations[slot] = n, iterations[slot]
      self.live[slot] = not done[slot]
    return updates
