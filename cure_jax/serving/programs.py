"""The engine's compiled programs: every one is lowered and compiled when the engine is built,
for its (Spec, rows, cache length), and called with row values only.

  chunk     up to `steps` (a row value: the engine paces its chunks) iterations of every live
            row of a decode state of `rows` rows
  place     a finished prefill's batch-1 state written into one row
  cancel    one row ended (done)
  take      rows of a state gathered into a state of another size (live rows moved to the
            lowest rows when it shrinks; free rows added when it grows)
  open / fill / first   a batch-1 prefill in windows: an empty carry, a window of prompt
            positions into it, the state before the first iteration
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cure_jax.runtime import decoding

_static = functools.partial(jax.jit, static_argnames=("graphdef", "spec"))


def place(state: decoding.State, row: decoding.State, at, limit) -> decoding.State:
  """state with row (a batch-1 state) written into row `at`, its token limit set."""
  row = row.replace(limit=jnp.reshape(limit, (1,)), done=row.done | (limit <= 1))
  return jax.tree.map(lambda big, one: big.at[at].set(one[0]) if big.ndim else big, state, row)


def cancel(state: decoding.State, at) -> decoding.State:
  return state.replace(done=state.done.at[at].set(True))


def take(state: decoding.State, index, free) -> decoding.State:
  """Rows `index` [R] of state; rows where `free` [R] are done (free) whatever they held."""
  st = jax.tree.map(lambda x: x[index] if x.ndim else x, state)
  return st.replace(done=st.done | free, limit=jnp.where(free, 1, st.limit))


@functools.partial(_static, donate_argnums=2)
def chunk(graphdef, params, state: decoding.State, steps, *, spec) -> decoding.State:
  """Up to `steps` iterations for every live row; the step counter restarts per chunk, so the
  per-iteration records of this chunk sit in columns 0.. of the state's stats."""
  target, drafter = decoding._merge(graphdef, params)
  if spec.draft_vocab:
    drafter.hold_head_rows(target, spec.draft_vocab)
  state = state.replace(step=jnp.zeros((), jnp.int32))
  return jax.lax.while_loop(lambda st: jnp.any(~st.done) & (st.step < steps),
                            lambda st: decoding.iteration(target, drafter, spec, st), state)


@_static
def open_fill(graphdef, params, *, spec):
  target, drafter = decoding._merge(graphdef, params)
  return decoding.prefill_start(target, drafter, spec, 1)


@functools.partial(_static, donate_argnums=2)
def fill(graphdef, params, carry, prompt, prompt_len, start, stop, *, spec):
  """Prompt positions [start, stop) of prompt [1, max_len] into the carry."""
  target, drafter = decoding._merge(graphdef, params)
  return decoding.prefill_window(target, drafter, spec, prompt, prompt_len, carry, start, stop)


@functools.partial(_static, donate_argnums=2)
def first(graphdef, params, caches, last, key, rows=None, *, spec) -> decoding.State:
  """caches: the carry's (target cache, drafter state), given up to the state; last: its
  final hidden state; rows: the request's sampling settings (a sampled engine's)."""
  target, _ = decoding._merge(graphdef, params)
  return decoding.start_state(target, spec, (*caches, last), key, rows=rows)
