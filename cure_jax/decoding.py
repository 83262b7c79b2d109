"""The jitted generation loop shared by every method.

`prefill` runs the prompt through the target (and the drafter), `decode` runs
`lax.while_loop` over iterations of propose -> verify -> commit -> resync until every sequence
has its tokens or hit a stop token. Both are compiled once per (Spec, batch, prompt bucket);
the loop never returns to the host between iterations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from cure_jax import drafting, sampling, verify
from cure_jax.cache import KVCache
from cure_jax.drafting import Spec


@struct.dataclass
class Stats:
  """Per-iteration records [B, N] (N = max_new_tokens, the most iterations a run can take)."""

  accept_lengths: jax.Array   # tokens emitted (accepted drafts + bonus, after truncation)
  nodes_verified: jax.Array
  winning_branch: jax.Array
  branch0_accepted: jax.Array # draft tokens branch 0 alone got accepted
  repair_gain: jax.Array      # accepted by the winner minus accepted by branch 0
  ufp_positions: jax.Array    # [B, N, U]
  ufp_margins: jax.Array      # [B, N, U]
  branches: jax.Array         # [B, N, U]
  block_margins: jax.Array    # [B, N, K-1] top-1 minus top-2 of the main draft's logits

  @classmethod
  def zeros(cls, batch: int, n: int, u: int, k: int) -> "Stats":
    z = jnp.zeros((batch, n), jnp.int32)
    return cls(z, z, z, z, z, jnp.full((batch, n, u), -1, jnp.int32), jnp.zeros((batch, n, u)),
               jnp.zeros((batch, n, u), jnp.int32), jnp.zeros((batch, n, max(k - 1, 0))))


@struct.dataclass
class State:
  cache: KVCache              # target: committed tokens except the anchor
  dcache: KVCache | None      # drafter: the same tokens (features for DFlash, KV for ar_draft)
  anchor: jax.Array           # [B] last committed token
  tokens: jax.Array           # [B, N + K] generated tokens
  produced: jax.Array         # [B] generated so far
  done: jax.Array             # [B]
  iterations: jax.Array       # [B] iterations run per sequence
  step: jax.Array             # [] loop counter
  key: jax.Array              # PRNG key (used when sampling)
  stats: Stats


def _merge(graphdef, params):
  return nnx.merge(graphdef, params)


def _is_stop(spec: Spec, tokens):
  if not spec.stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(spec.stop_ids, tokens.dtype))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def prefill(graphdef, params, prompt, prompt_len, key=None, *, spec: Spec) -> State:
  """prompt [B, P] right-padded ids, prompt_len [B], a PRNG key (for sampling; default seed 0)
  -> the state before the first iteration."""
  key = jax.random.key(0) if key is None else key
  target, drafter = _merge(graphdef, params)
  b, p = prompt.shape
  s = spec.max_len
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  # The prompt attends to itself only: an empty (length-0) cache keeps XLA from constant-folding
  # attention over an all-zero cache, which can take minutes at large batch.
  mask = jnp.tril(jnp.ones((p, p), bool))[None] & (jnp.arange(p)[None, None] <
                                                   prompt_len[:, None, None])
  out = target(prompt, positions, target.init_cache(b, 0), mask, spec.feature_layers)
  last = jnp.take_along_axis(out.hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
  key, sub = jax.random.split(key)
  first, _ = drafting.choose(spec, sub, target.logits(last))
  cache = target.init_cache(b, s).append(out.k, out.v, prompt_len)

  dcache = None
  if spec.method in ("chain", "cure"):
    k, v = drafter.context_kv(out.features, positions)
    dcache = drafter.init_cache(b, s).append(k, v, prompt_len)
  elif spec.method == "ar_draft":
    dout = drafter(prompt, positions, drafter.init_cache(b, 0), mask)
    dcache = drafter.init_cache(b, s).append(dout.k, dout.v, prompt_len)

  n = spec.max_new_tokens
  u = spec.cure.max_repair_positions if spec.cure else 1
  tokens = jnp.zeros((b, n + spec.block_size), jnp.int32).at[:, 0].set(first)
  return State(cache=cache, dcache=dcache, anchor=first, tokens=tokens,
               produced=jnp.ones((b,), jnp.int32), done=_is_stop(spec, first) | (n <= 1),
               iterations=jnp.zeros((b,), jnp.int32), step=jnp.zeros((), jnp.int32), key=key,
               stats=Stats.zeros(b, n, u, spec.block_size))


def iteration(target, drafter, spec: Spec, st: State) -> State:
  """One propose -> verify -> commit -> resync step for every sequence still running."""
  active = ~st.done
  lengths = st.cache.lengths
  limit = drafting.depth_limit(spec, lengths, st.produced)
  key, key_draft, key_verify = jax.random.split(st.key, 3)
  proposal, dcache = drafting.propose(target, drafter, st.dcache, spec, key_draft, st.anchor,
                                      lengths, limit)
  tree = proposal.tree
  out = target(tree.tokens, tree.positions(lengths), st.cache, tree.attention_mask(
      st.cache.visible()), spec.feature_layers)
  logits = target.logits(out.hidden)                                       # [B, V, N]
  k = spec.block_size
  if spec.sampling.greedy:
    verdict = verify.greedy(tree, jnp.argmax(logits, axis=-1).astype(jnp.int32), k)
  else:
    verdict = verify.stochastic(tree, sampling.warp(logits, spec.sampling), proposal.q,
                                proposal.deterministic, key_verify, k, spec.max_children)

  # Tokens emitted: the accepted nodes after the root, then the bonus token.
  i = jnp.arange(k)[None]
  along = jnp.take_along_axis(tree.tokens, jnp.roll(verdict.path, -1, axis=1), axis=1)
  emitted = jnp.where(i < verdict.accepted[:, None], along, verdict.next_token[:, None])
  owed = spec.max_new_tokens - st.produced
  n_new = jnp.minimum(verdict.accepted + 1, owed)
  stop_at = jnp.argmax(_is_stop(spec, emitted) & (i < n_new[:, None]), axis=1)
  hit_stop = jnp.any(_is_stop(spec, emitted) & (i < n_new[:, None]), axis=1)
  n_new = jnp.where(hit_stop, stop_at + 1, n_new)
  n_new = jnp.where(active, n_new, 0)

  count = jnp.where(active, verdict.accepted + 1, 0)  # committed nodes: root + accepted
  cache = drafting.commit_target(st.cache, out, verdict.path, count)
  dcache = drafting.resync(drafter, dcache, spec, proposal, out.features, verdict.path, lengths,
                           count) if dcache is not None else None
  if dcache is not None:  # an inactive sequence keeps its drafter state
    dcache = dcache.replace(lengths=jnp.where(active, dcache.lengths, st.dcache.lengths))

  slots = jnp.where(i < n_new[:, None], st.produced[:, None] + i, st.tokens.shape[1])
  tokens = st.tokens.at[jnp.arange(emitted.shape[0])[:, None], slots].set(emitted, mode="drop")
  produced = st.produced + n_new
  done = st.done | (active & (hit_stop | (produced >= spec.max_new_tokens)))

  it = st.step
  record = lambda buf, val: buf.at[:, it].set(jnp.where(
      active.reshape((-1,) + (1,) * (val.ndim - 1)), val, buf[:, it]))
  gate = proposal.gate
  stats = st.stats
  stats = stats.replace(
      accept_lengths=record(stats.accept_lengths, n_new),
      nodes_verified=record(stats.nodes_verified, jnp.sum(tree.valid, axis=1).astype(jnp.int32)),
      winning_branch=record(stats.winning_branch,
                            jnp.take_along_axis(tree.branch, verdict.winner[:, None], axis=1)[:, 0]),
      branch0_accepted=record(stats.branch0_accepted, verdict.branch0_accepted),
      repair_gain=record(stats.repair_gain, verdict.accepted - verdict.branch0_accepted),
  )
  if proposal.block_margins is not None:
    stats = stats.replace(block_margins=record(stats.block_margins, proposal.block_margins))
  if gate is not None:
    stats = stats.replace(ufp_positions=record(stats.ufp_positions, gate.positions),
                          ufp_margins=record(stats.ufp_margins, gate.margins),
                          branches=record(stats.branches, gate.branches))
  return st.replace(cache=cache, dcache=dcache, anchor=jnp.where(active, verdict.next_token,
                                                                 st.anchor),
                    tokens=tokens, produced=produced, done=done,
                    iterations=st.iterations + active.astype(jnp.int32), step=it + 1, key=key,
                    stats=stats)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("state",))
def decode(graphdef, params, state: State, *, spec: Spec) -> State:
  """Runs iterations inside one compiled while loop until every sequence is done."""
  target, drafter = _merge(graphdef, params)

  def cond(st):
    return jnp.any(~st.done) & (st.step < spec.max_new_tokens)

  return jax.lax.while_loop(cond, lambda st: iteration(target, drafter, spec, st), state)
