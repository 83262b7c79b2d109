"""Slots over the compiled loop: requests come and go while one decode state runs.

JetStream's shape on `decoding.iteration`: each of S slots is a request with its own caches,
position, drafter state, produced count and token limit, held in a row of the decode state.
`begin` queues a request's prefill, `fill` runs one prefill turn (up to `prefill_turn` prompt
tokens in chunks of `prefill_chunk`, given to the waiting prompts in the order they began) and
writes each prompt that completes into a free row; `step` runs one compiled chunk of up to
`steps` iterations for every row inside one `lax.while_loop` (a free or finished row is a done
row: masked, as in offline decoding) and returns each slot's new tokens; `cancel` ends a slot.
The host syncs once per chunk, and a long prompt stalls the running requests for one turn at a
time, never for its whole prefill. A request that arrives while a chunk runs waits for it, so
with `chunk_s` a chunk runs only as many iterations as fit in chunk_s at the pace the last
chunk of as many rows kept: many rows take short chunks, one row still takes `steps`.

Live requests are kept in the lowest rows, and the decode state holds only as many rows as the
smallest bucket (1, 2, 4, ..., S) that fits them: the state grows by a bucket when a request
finds no free row and shrinks by one when the live rows fit the bucket below (moving rows), so
a lone request pays for one row, not S. Every program is compiled once, when the engine is
built, for its (Spec, rows, cache length) per bucket: a request's prompt is padded to the cache
length, its token limit and key are row values. A sampled engine (its Spec's temperature > 0)
takes each request's temperature, top-k and top-p as row values too (`sampling.Rows`): rows at
temperature 0 decode greedily in the same program.

On a mesh (the Generator's, in one process: tensor parallel over `model`, rows split over
`data`) every program takes and returns the shardings of sharding.decoding_state_shardings, so
the donated state never changes sharding between calls. The buckets are multiples of mesh.data
(which must divide S: data=2, S=8 -> 2, 4, 8), and a request is prefilled in mesh.data rows,
each its own prompt, so that they split over `data` as the state's rows do; row 0 is placed.

A request's random numbers come from its own seed (the row key of `Generator.generate` for a
prompt decoded alone), never from its slot or row; with numerics=invariant a row's logits do
not depend on the rows beside it or on the batch size, so its tokens are those of decoding it
alone at batch 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from cure_jax.runtime import decoding, sharding, xla_options
from cure_jax.runtime.generation import Generator
from cure_jax.serving import programs
from cure_jax.tree.sampling import Rows, Sampling

# Prefill here, measured on the embedded default (2-core CPU, float32, cache 1,024, 2026-12-07):
# a 155-token prompt took 605 ms in one chunk of 512 (the offline CPU default), 205 in 256,
# 219 in 128, 185 in 64, 183 in 32. A turn of 256 tokens holds most chat prompts whole.
PREFILL_CHUNK = 64
PREFILL_TURN = 256


def buckets(slots: int, multiple: int = 1) -> list[int]:
  """Row counts the engine compiles for: `multiple` (mesh.data, which divides slots) times the
  powers of two below slots / multiple, then `slots`."""
  n = slots // multiple
  return [multiple << i for i in range((n - 1).bit_length()) if 1 << i < n] + [slots]


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


@dataclasses.dataclass
class Fill:
  """A prompt being prefilled: its carry (decoding.prefill_start's) and how far it has got;
  W rows, each the request's (Engine.width)."""

  request: Request
  carry: tuple
  prompt: jax.Array        # [W, max_len]
  length: jax.Array        # [W]
  prefilled: int = 0       # prompt tokens in the carry


class Engine:
  """S slots decoding with one Generator's method, models and settings; max_len: the cache
  length every slot has (prompt + max_tokens - 1 must fit), steps: the most iterations per
  chunk (the host's turn comes once per chunk: time to first token against dispatch
  overhead), chunk_s: seconds a chunk may take (None: always `steps` iterations),
  prefill_chunk: prompt tokens per prefill step, prefill_turn: prompt tokens prefilled between
  two chunks (rounded down to whole prefill steps, at least one)."""

  def __init__(self, generator: Generator, slots: int, max_len: int, steps: int = 8,
               chunk_s: float | None = None, prefill_chunk: int = PREFILL_CHUNK,
               prefill_turn: int = PREFILL_TURN):
    if slots < 1:
      raise ValueError(f"slots={slots} must be >= 1 (requests decoded at once)")
    if steps < 1:
      raise ValueError(f"steps={steps} must be >= 1 (iterations per chunk)")
    if chunk_s is not None and not chunk_s > 0:
      raise ValueError(f"chunk_s={chunk_s} must be > 0 (seconds a chunk may take) or None")
    if prefill_chunk < 1 or prefill_turn < 1:
      raise ValueError(f"prefill_chunk={prefill_chunk} and prefill_turn={prefill_turn} must be "
                       ">= 1 (prompt tokens per prefill step and per turn between chunks)")
    self.mesh = generator.mesh
    # rows of one request's prefill: a decode state's rows are split over the data axis
    self.width = 1 if self.mesh is None else sharding.batch_multiple(self.mesh)
    if slots % self.width:
      raise ValueError(f"slots={slots} is not a multiple of mesh.data={self.width} (the decode "
                       f"state's rows are split over it): use slots={slots + -slots % self.width}")
    self.generator, self.slots, self.max_len = generator, slots, max_len
    self.max_tokens = generator.max_new_tokens
    self.steps = min(steps, self.max_tokens)
    self.chunk_s = chunk_s
    self._iteration_s: dict[int, float] = {}       # rows -> seconds an iteration took last
    chunk = min(prefill_chunk, max_len)
    self.turn = max(prefill_turn // chunk, 1) * chunk
    generator.check_memory(slots, max_len, max_len)
    self.spec = dataclasses.replace(generator.spec(max_len, slots), prefill_chunk=chunk)
    self.buckets = buckets(slots, self.width)
    self.sampled = not generator.sampling.greedy   # per-request settings in one program
    self._compile()
    self.rows = self.buckets[0]                   # rows of the decode state
    self.state = self._device(self._tile(self._prefill(Request((0,), 1)), self.rows))
    self._row = np.full(slots, -1, np.int64)      # each slot's row (-1: none)
    self._seen = np.zeros(slots, np.int64)        # tokens of each slot already returned
    self._iterations = np.zeros(slots, np.int64)  # iterations of each slot already returned
    self.live = np.zeros(slots, bool)
    self.filling: dict[int, Fill] = {}            # slot -> its prompt's prefill, in order

  # --- compiled once ------------------------------------------------------------------------

  def _compile(self):
    g, spec, w = self.generator, self.spec, self.width
    model = lambda fn, **kw: functools.partial(fn, g.graphdef, spec=spec, **kw)   # noqa: E731
    i32 = self._pinned(jax.ShapeDtypeStruct((), jnp.int32))   # a row value: index, limit, bound
    key = self._pinned(jax.eval_shape(jax.random.key, 0))
    rows = self._pinned(jax.eval_shape(lambda: Rows.of(g.sampling, w))) if self.sampled else None
    prompt = self._pinned(jax.ShapeDtypeStruct((w, self.max_len), jnp.int32))
    length = self._pinned(jax.ShapeDtypeStruct((w,), jnp.int32))
    with self._on_mesh():
      carry = self._pinned(jax.eval_shape(model(programs.open_fill, batch=w), g.params))
      row = self._pinned(jax.eval_shape(model(programs.first), g.params, carry[:2], carry[2], key,
                                        rows))
    self._open = self._lower(model(programs.open_fill, batch=w), g.params, out=carry)
    self._fill = self._lower(model(programs.fill), g.params, carry, prompt, length, i32, i32,
                             out=carry, donate=1)
    self._first = self._lower(model(programs.first), g.params, carry[:2], carry[2], key, rows,
                              out=row, donate=1)
    states = {b: self._pinned(jax.eval_shape(lambda r, b=b: self._tile(r, b), row))
              for b in self.buckets}
    self._run, self._put, self._end, self._take = {}, {}, {}, {}
    for b, state in states.items():
      self._run[b] = self._lower(model(programs.chunk), g.params, state, i32, out=state,
                                 donate=1)
      self._put[b] = self._lower(programs.place, state, row, i32, i32, out=state, donate=0)
      self._end[b] = self._lower(programs.cancel, state, i32, out=state, donate=0)
    for a, b in zip(self.buckets, self.buckets[1:]):   # grow a -> b, shrink b -> a
      for src, dst in ((a, b), (b, a)):
        index, free = (self._pinned(jax.ShapeDtypeStruct((dst,), t)) for t in (jnp.int32, bool))
        self._take[src, dst] = self._lower(programs.take, states[src], index, free,
                                           out=states[dst])

  def _lower(self, fn, *args, out, donate=()):
    """fn compiled for the abstract args; on a mesh its outputs take out's shardings, so that a
    donated state keeps its shardings from call to call."""
    g = self.generator
    pin = {} if self.mesh is None else {"out_shardings": jax.tree.map(lambda x: x.sharding, out)}
    with self._on_mesh():
      lowered = jax.jit(fn, donate_argnums=donate, **pin).lower(*args)
    options = xla_options.platform_options(jax.default_backend(), dict(g.compiler_options))
    return xla_options.compile_with(lowered, options)

  def _on_mesh(self):
    """The mesh as the models' per-shard code sees it while tracing (decoding.lower_sharded)."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _pinned(self, tree):
    """Abstract arrays at the shardings the programs keep them in: on a mesh a decode state's
    (sharding.decoding_state_shardings: rows over data, caches' KV heads over model)."""
    if self.mesh is None:
      return tree
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        sharding.decoding_state_shardings(tree, self.mesh))

  def _device(self, tree):
    """Host or device arrays moved where the programs take them (_pinned's shardings)."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, sharding.decoding_state_shardings(tree, self.mesh))

  @staticmethod
  def _tile(row: decoding.State, rows: int) -> decoding.State:
    """rows copies of a prefilled state's row 0, every one done (free)."""
    index = jnp.zeros((rows,), jnp.int32)
    state = jax.tree.map(lambda x: x[index] if x.ndim else x, row)
    return state.replace(done=jnp.ones((rows,), bool), limit=jnp.ones((rows,), jnp.int32))

  def _prefill(self, request: Request) -> decoding.State:
    """request's whole prompt prefilled at once: its state (Fill's rows)."""
    fill = self._open_fill(request)
    fill.carry = self._fill(self.generator.params, fill.carry, fill.prompt, fill.length,
                            np.int32(0), np.int32(len(request.prompt)))
    return self._start(fill)

  def _start(self, fill: Fill) -> decoding.State:
    """A completed prefill's state (its first token chosen with the request's key: row 0
    takes the key a prompt decoded alone takes)."""
    g, request = self.generator, fill.request
    rows = Rows.of(request.sampling or g.sampling, self.width) if self.sampled else None
    key, rows = self._device((jax.random.key(request.seed), rows))
    return self._first(g.params, fill.carry[:2], fill.carry[2], key, rows)

  def _open_fill(self, request: Request) -> Fill:
    prompt = np.zeros((self.width, self.max_len), np.int32)
    prompt[:, :len(request.prompt)] = request.prompt
    length = np.full((self.width,), len(request.prompt), np.int32)
    return Fill(request, self._open(self.generator.params), *self._device((prompt, length)))

  # --- rows ---------------------------------------------------------------------------------

  def _resize(self, rows: int) -> None:
    """The state at `rows` rows (the next bucket up or down), live rows first, in order."""
    slots = sorted(np.flatnonzero(self._row >= 0), key=lambda s: self._row[s])
    keep = [int(self._row[s]) for s in slots]
    index = (keep + [r for r in range(self.rows) if r not in keep] + [0] * rows)[:rows]
    free = np.arange(rows) >= len(keep)
    self.state = self._take[self.rows, rows](self.state, np.asarray(index, np.int32), free)
    self._row[slots] = np.arange(len(slots))
    self.rows = rows

  def _free_row(self) -> int:
    """The lowest row no request holds, the state grown by a bucket if every row is held."""
    held = set(self._row[self._row >= 0].tolist())
    free = [r for r in range(self.rows) if r not in held]
    if free:
      return free[0]
    self._resize(self.buckets[self.buckets.index(self.rows) + 1])
    return self._free_row()

  def _fit(self) -> None:
    """Shrinks the state while its live rows fit the bucket below."""
    at = self.buckets.index(self.rows)
    while at and np.count_nonzero(self._row >= 0) <= self.buckets[at - 1]:
      at -= 1
      self._resize(self.buckets[at])

  def _place(self, slot: int, row: decoding.State, max_tokens: int) -> int:
    """Writes a prefilled state's row 0 into a free row for `slot`; returns its first token."""
    first = int(jax.device_get(row.anchor)[0])   # a transfer: indexing on device compiles
    at = self._free_row()
    self.state = self._put[self.rows](self.state, row, np.int32(at), np.int32(max_tokens))
    self._row[slot], self._seen[slot], self._iterations[slot] = at, 1, 0
    self.live[slot] = True
    return first

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
    return [s for s in range(self.slots) if not self.live[s] and s not in self.filling]

  def _admissible(self, slot: int, request: Request) -> None:
    if self.live[slot] or slot in self.filling:
      raise ValueError(f"slot {slot} is busy")
    self.check(len(request.prompt), request.max_tokens)
    if request.sampling is not None:
      request.sampling.validate()
      if not self.sampled and not request.sampling.greedy:
        raise ValueError(f"temperature={request.sampling.temperature}: this engine's program "
                         "is greedy; build it with a temperature > 0 to sample per request")

  def begin(self, slot: int, request: Request) -> None:
    """Queues `request`'s prefill for the free `slot`; `fill` runs it."""
    self._admissible(slot, request)
    self.filling[slot] = self._open_fill(request)

  def fill(self) -> list[Update]:
    """One prefill turn: up to `turn` prompt tokens to the queued prefills in the order they
    began. Each prompt that completes takes a row; its Update holds its first token, so that
    it reaches the client before the next chunk has run."""
    budget, updates = self.turn, []
    for slot, f in list(self.filling.items()):
      if budget <= 0:
        break
      stop = min(f.prefilled + budget, len(f.request.prompt))
      f.carry = self._fill(self.generator.params, f.carry, f.prompt, f.length,
                           np.int32(f.prefilled), np.int32(stop))
      budget -= -(-(stop - f.prefilled) // self.spec.prefill_chunk) * self.spec.prefill_chunk
      f.prefilled = stop
      if stop == len(f.request.prompt):
        del self.filling[slot]
        first = self._place(slot, self._start(f), f.request.max_tokens)
        updates.append(Update(slot, [first], False, [], [], [], []))
    return updates

  def insert(self, slot: int, request: Request) -> int:
    """Prefills `request` into the free `slot` at once; returns its first token."""
    self._admissible(slot, request)
    return self._place(slot, self._prefill(request), request.max_tokens)

  def cancel(self, slot: int) -> None:
    """Ends the request in `slot` (prefilling or decoding); the slot is free for the next."""
    if self.filling.pop(slot, None) is None and self.live[slot]:
      self.state = self._end[self.rows](self.state, np.int32(self._row[slot]))
      self._row[slot] = -1
    self.live[slot] = False

  def _steps(self) -> int:
    """Iterations for the next chunk: `steps`, or with chunk_s those that fit in it at the pace
    of the last chunk of this many rows (the first chunk of as many rows runs one: its pace)."""
    if self.chunk_s is None:
      return self.steps
    if self.rows not in self._iteration_s:
      return 1
    return int(np.clip(self.chunk_s // self._iteration_s[self.rows], 1, self.steps))

  def step(self) -> list[Update]:
    """One chunk (after which the host reads the results once); an Update per live slot with
    its tokens after the first. Finished slots become free."""
    self._fit()
    running, start = self.live.any(), time.perf_counter()
    if running:
      self.state = self._run[self.rows](self.generator.params, self.state,
                                        np.int32(self._steps()))
    st = self.state
    tokens, produced, done, iterations, ran, stats = jax.device_get(
        (st.tokens, st.produced, st.done, st.iterations, st.step,
         (st.stats.accept_lengths, st.stats.nodes_verified, st.stats.repair_gain,
          st.stats.budget)))
    if running:
      self._iteration_s[self.rows] = (time.perf_counter() - start) / max(int(ran), 1)
    updates = []
    for slot in np.flatnonzero(self.live):
      r = self._row[slot]
      n = int(produced[r])
      new = int(iterations[r] - self._iterations[slot])
      rows = [s[r, :new].tolist() for s in stats]
      updates.append(Update(int(slot), tokens[r, self._seen[slot]:n].tolist(), bool(done[r]),
                            *rows))
      self._seen[slot], self._iterations[slot] = n, iterations[r]
      self.live[slot] = not done[r]
      if done[r]:
        self._row[slot] = -1
    return updates
