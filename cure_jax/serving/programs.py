"""The engine's compiled programs: every one is jitted, lowered and compiled when the engine is
built (Engine._lower: on a mesh, with its outputs pinned to the shardings of the state it
keeps), for its (Spec, rows, cache length), and called with row values only.

  chunk     up to `steps` (a row value: the engine paces its chunks) iterations of every live
            row of a decode state of `rows` rows
  place     row 0 of a finished prefill's state written into one row
  cancel    one row ended (done)
  take      rows of a state gathered into a state of another size (live rows moved to the
            lowest rows when it shrinks; free rows added when it grows)
  open / fill / first   one request's prefill in windows: an empty carry, a window of prompt
            positions into it, the state before the first iteration; `batch` rows, each the
            request's (one, or on a mesh one per data shard, so that they split over it)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cure_jax.runtime import decoding


def place(state: decoding.State, row: decoding.State, at, limit) -> decoding.State:
  """state with row 0 of `row` (a prefilled state) written into row `at`, its token limit set."""
  row = row.replace(limit=jnp.full(row.done.shape, limit, jnp.int32),
                    done=row.done | (limit <= 1))
  return jax.tree.map(lambda big, one: big.at[at].set(one[0]) if big.ndim else big, state, row)


def cancel(state: decoding.State, at) -> decoding.State:
  return state.replace(done=state.done.at[at].set(True))


def take(state: decoding.State, index, free) -> decoding.State:
  """Rows `index` [R] of state; rows where `free` [R] are done (free) whatever they held."""
  st = jax.tree.map(lambda x: x[index] if x.ndim else x, state)
  return st.replace(done=st.done | free, limit=jnp.where(free, 1, st.limit))


def chunk(graphdef, params, state: decoding.State, steps, *, spec) -> decoding.State:
  """Up to `steps` iterations for every live row; the step counter restarts per chunk, so the
  per-iteration records of this chunk sit in columns 0.. of the state's stats."""
  target, drafter = decoding._merge(graphdef, params)
  if spec.draft_vocab:
    drafter.hold_head_rows(target, spec.draft_vocab)
  state = state.replace(step=jnp.zeros((), jnp.int32))
  return jax.lax.while_loop(lambda st: jnp.any(~st.done) & (st.step < steps),
                            lambda st: decoding.iteration(target, drafter, spec, st), state)


def open_fill(graphdef, params, *, spec, batch):
  target, drafter = decoding._merge(graphdef, params)
  return decoding.prefill_start(target, drafter, spec, batch)


def fill(graphdef, params, carry, prompt, prompt_len, start, stop, *, spec):
  """Prompt positions [start, stop) of prompt [batch, max_len] into the carry."""
  target, drafter = decoding._merge(graphdef, params)
  return decoding.prefill_window(target, drafter, spec, prompt, prompt_len, carry, start, stop)


def first(graphdef, params, caches, last, key, rows=None, *, spec) -> decoding.State:
  """caches: the carry's (target cache, drafter state), given up to the state; last: its
  final hidden state; rows: the request's sampling settings (a sampled engine's)."""
  target, _ = decoding._merge(graphdef, params)
  return decoding.start_state(target, spec, (*caches, last), key, rows=rows)
