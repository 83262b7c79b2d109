"""The jitted generation loop shared by every method.

`prefill` runs the prompt through the target (and the drafter) in chunks, `decode` runs
`lax.while_loop` over iterations of propose -> verify -> commit -> resync until every sequence
has its tokens or hit a stop token. Both are compiled once per (Spec, batch, cache length);
the loop never returns to the host between iterations. What differs between methods is asked
of `spec.impl` (cure_jax/methods); this file names no method.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cure_jax.methods.base import Proposal, Spec, Verified, choose, depth_limit
from cure_jax.models.cache import KVCache
from cure_jax.models.kernels.prefix import Prefix
from cure_jax.runtime import sharding, xla_options
from cure_jax.tree import budget as budget_lib, candidates as tree_lib, controller, sampling, verify


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
  budget: jax.Array           # node budget the controller chose (0: no controller)
  expected: jax.Array         # tokens it expected of this sequence at that budget

  @classmethod
  def zeros(cls, batch: int, n: int, u: int, k: int) -> "Stats":
    z = jnp.zeros((batch, n), jnp.int32)
    return cls(z, z, z, z, z, jnp.full((batch, n, u), -1, jnp.int32), jnp.zeros((batch, n, u)),
               jnp.zeros((batch, n, u), jnp.int32), jnp.zeros((batch, n, max(k - 1, 0))), z,
               jnp.zeros((batch, n)))


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
  budget: budget_lib.Budget | None = None  # the online budget's running means (spec.online)
  controller: controller.Controller | None = None  # the goodput controller's (spec.auto)
  limit: jax.Array | None = None  # [B] tokens each sequence may produce (serving's slots);
                                  # None: spec.max_new_tokens for all
  sampling: sampling.Rows | None = None  # each sequence's own settings (serving's slots);
                                         # None: spec.sampling for all


def row_spec(spec: Spec, rows: sampling.Rows | None) -> Spec:
  """spec sampling with each row's settings where the state carries them (a sampled spec's)."""
  if rows is None:
    return spec
  if spec.sampling.greedy:
    raise ValueError("per-row sampling settings need a sampled program (temperature > 0)")
  return dataclasses.replace(spec, sampling=rows)


def max_new(spec: Spec, st: State):
  """Tokens each sequence may produce: its own limit where the state carries one."""
  return spec.max_new_tokens if st.limit is None else st.limit


def _merge(graphdef, params):
  return nnx.merge(graphdef, params)


def _is_stop(spec: Spec, tokens):
  if not spec.stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(spec.stop_ids, tokens.dtype))


def prefill_start(target, drafter, spec: Spec, b: int):
  """The carry of an empty prefill at batch b: (target cache, drafter state, last hidden)."""
  return (target.init_cache(b, spec.max_len), spec.impl.init_drafter(drafter, spec, b),
          jnp.zeros((b, target.cfg.hidden_size), target.dtype))


def prefill_window(target, drafter, spec: Spec, prompt, prompt_len, carry, start=0, stop=None):
  """Prompt positions [start, min(stop, prompt_len)) of prompt [B, P] into `carry`
  (prefill_start's), spec.prefill_chunk tokens a step from `start` (a multiple of the chunk);
  the steps are a loop count, so one compiled program serves every prompt length and window.

  Each chunk attends to the cache so far and causally to itself (kernels/prefix.py): nothing
  [P, P] is built. Rows of different lengths share the steps; a row whose prompt has ended
  takes no more tokens. Returns (target cache, drafter state, final hidden state [B, H] at each
  row's last prompt token once the window holds it)."""
  b, p = prompt.shape
  c = min(spec.prefill_chunk, p)
  prompt = jnp.pad(prompt, ((0, 0), (0, -p % c)))                          # [B, chunks * C]

  def step(i, carry):
    cache, dcache, last = carry
    at_chunk = start + i * c
    tokens = jax.lax.dynamic_slice_in_dim(prompt, at_chunk, c, axis=1)    # [B, C]
    positions = jnp.broadcast_to(at_chunk + jnp.arange(c), (b, c))
    chunk = Prefix(lengths=cache.lengths, count=jnp.clip(prompt_len - at_chunk, 0, c))
    out = target(tokens, positions, cache, chunk, spec.feature_layers)
    at = prompt_len - 1 - at_chunk                                         # [B]
    here = jnp.take_along_axis(out.hidden, jnp.clip(at, 0, c - 1)[:, None, None], axis=1)[:, 0]
    last = jnp.where(((at >= 0) & (at < c))[:, None], here, last)
    dcache = spec.impl.prefill_drafter(drafter, dcache, spec, out, tokens, positions, chunk)
    return cache.replace(k=out.k, v=out.v).advance(chunk.count), dcache, last

  end = jnp.max(prompt_len) if stop is None else jnp.minimum(stop, jnp.max(prompt_len))
  return jax.lax.fori_loop(0, jnp.maximum(end - start + c - 1, 0) // c, step, carry)


def prefill_chunks(target, drafter, spec: Spec, prompt, prompt_len):
  """The whole prompt [B, P] into a fresh carry (prefill_window from 0)."""
  return prefill_window(target, drafter, spec, prompt, prompt_len,
                        prefill_start(target, drafter, spec, prompt.shape[0]))


def start_state(target, spec: Spec, carry, key, first_row=0, rows=None) -> State:
  """The state before the first iteration, from a finished prefill's carry: the first token
  chosen from each row's last hidden state with its row key (fold_in(key, first_row + b));
  rows: each row's sampling settings (None: spec.sampling's)."""
  spec = row_spec(spec, rows)
  cache, dcache, last = carry
  b = last.shape[0]
  key, sub = sampling.split(sampling.row_keys(key, first_row, b))        # [B] each
  first, _ = choose(spec, sub, target.logits(last))

  n = spec.max_new_tokens
  u = spec.cure.max_repair_positions if spec.cure else 1
  tokens = jnp.zeros((b, n + spec.block_size), jnp.int32).at[:, 0].set(first)
  return State(cache=cache, dcache=dcache, anchor=first, tokens=tokens,
               produced=jnp.ones((b,), jnp.int32), done=_is_stop(spec, first) | (n <= 1),
               iterations=jnp.zeros((b,), jnp.int32), step=jnp.zeros((), jnp.int32), key=key,
               stats=Stats.zeros(b, n, u, spec.block_size),
               budget=budget_lib.init(b) if spec.online else None,
               controller=controller.init(b, spec.auto) if spec.auto else None, sampling=rows)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def prefill(graphdef, params, prompt, prompt_len, key=None, first_row=0, rows=None, *,
            spec: Spec) -> State:
  """prompt [B, P] right-padded ids, prompt_len [B], a PRNG key (for sampling; default seed 0)
  and the index of row 0 in the whole request (row b samples from fold_in(key, first_row + b));
  rows: each row's sampling settings (None: spec.sampling's) -> the state before the first
  iteration."""
  key = jax.random.key(0) if key is None else key
  target, drafter = _merge(graphdef, params)
  return start_state(target, spec, prefill_chunks(target, drafter, spec, prompt, prompt_len),
                     key, first_row, rows)


def propose(target, drafter, spec: Spec, st: State, want=None):
  """Phase 1, draft and tree build: (proposal, drafter cache). want [B] (online budget): the
  sequences that may repair; by default the budget's choice."""
  limit = depth_limit(spec, st.cache.lengths, st.produced, max_new(spec, st))
  key_draft = sampling.fold(st.key, 1)
  if want is None and spec.online:
    want = budget_lib.want_tree(st.budget, st.step, spec.cure, spec.block_size)
  return spec.impl.propose(target, drafter, st.dcache, spec, key_draft, st.anchor,
                           st.cache.lengths, limit, want)


def _beyond_branch0(tree):
  """[B] the tree holds a node off branch 0."""
  return jnp.any(tree.valid & (tree.branch != 0), axis=1)


def _verify(target, spec: Spec, st: State, proposal: Proposal):
  tree = proposal.tree
  lengths = st.cache.lengths
  out = target(tree.tokens, tree.positions(lengths), st.cache,
               tree.attention_mask(st.cache.visible()), spec.feature_layers)
  if spec.sampling.greedy:
    verdict = verify.greedy(tree, target.greedy(out.hidden), spec.block_size)
  else:
    logits = target.logits(out.hidden)                                     # [B, N, V]
    verdict = verify.stochastic(tree, sampling.warp(logits, spec.sampling), proposal.q,
                                proposal.deterministic, sampling.fold(st.key, 2),
                                spec.block_size, spec.max_children)
  return verdict, spec.impl.keep_verified(spec, tree, out, verdict.path)


def verify_tree(target, spec: Spec, st: State, proposal: Proposal):
  """Phase 2, one target forward over the whole tree: (verdict, what the commit keeps).

  Under the online budget, an iteration in which no sequence built more than branch 0 verifies
  branch 0's K slots alone (the tree's first K), at a chain's cost."""
  if not spec.online:
    return _verify(target, spec, st, proposal)
  return jax.lax.cond(jnp.any(_beyond_branch0(proposal.tree)),
                      lambda: _verify(target, spec, st, proposal),
                      lambda: _verify(target, spec, st, _prefix(proposal, spec.block_size)))


def _prefix(proposal: Proposal, n: int) -> Proposal:
  """The proposal cut to its first n nodes (a tree when parents precede children)."""
  cut = lambda x: None if x is None else x[:, :n]
  return proposal.replace(tree=proposal.tree.prefix(n), q=cut(proposal.q),
                          deterministic=cut(proposal.deterministic),
                          path_logp=cut(proposal.path_logp))


def _emitted(spec: Spec, st: State, tree, verdict):
  """The accepted nodes after the root, then the bonus token, cut at a stop token or at
  max_new_tokens: (tokens [B, K], how many count [B], stopped [B])."""
  i = jnp.arange(spec.block_size)[None]
  along = jnp.take_along_axis(tree.tokens, jnp.roll(verdict.path, -1, axis=1), axis=1)
  emitted = jnp.where(i < verdict.accepted[:, None], along, verdict.next_token[:, None])
  n_new = jnp.minimum(verdict.accepted + 1, max_new(spec, st) - st.produced)
  stops = _is_stop(spec, emitted) & (i < n_new[:, None])
  hit_stop = jnp.any(stops, axis=1)
  n_new = jnp.where(hit_stop, jnp.argmax(stops, axis=1) + 1, n_new)
  return emitted, jnp.where(st.done, 0, n_new), hit_stop


def _record(stats: Stats, step, active, proposal, verdict, n_new) -> Stats:
  """Writes this iteration's statistics at column `step` for the active sequences."""
  def put(buf, val):
    keep = active.reshape((-1,) + (1,) * (val.ndim - 1))
    return buf.at[:, step].set(jnp.where(keep, val, buf[:, step]))

  tree = proposal.tree
  stats = stats.replace(
      accept_lengths=put(stats.accept_lengths, n_new),
      nodes_verified=put(stats.nodes_verified, jnp.sum(tree.valid, axis=1).astype(jnp.int32)),
      winning_branch=put(stats.winning_branch,
                         jnp.take_along_axis(tree.branch, verdict.winner[:, None], axis=1)[:, 0]),
      branch0_accepted=put(stats.branch0_accepted, verdict.branch0_accepted),
      repair_gain=put(stats.repair_gain, verdict.accepted - verdict.branch0_accepted),
  )
  if proposal.block_margins is not None:
    stats = stats.replace(block_margins=put(stats.block_margins, proposal.block_margins))
  gate = proposal.gate
  if gate is not None:
    stats = stats.replace(ufp_positions=put(stats.ufp_positions, gate.positions),
                          ufp_margins=put(stats.ufp_margins, gate.margins),
                          branches=put(stats.branches, gate.branches))
  return stats


def commit_target(cache: KVCache, verified: Verified, count) -> KVCache:
  """Moves the accepted nodes' keys/values into contiguous slots after the committed prefix."""
  return cache.append(verified.k, verified.v, count)


def _first_rows(verified: Verified, rows: int) -> Verified:
  return verified.replace(k=tuple(x[:, :rows] for x in verified.k),
                          v=tuple(x[:, :rows] for x in verified.v),
                          features=None if verified.features is None
                          else verified.features[:, :rows])


def commit(drafter, spec: Spec, st: State, proposal, dcache, verdict, verified,
           resync: bool = True) -> State:
  """Phase 3: accepted keys/values into the target cache, drafter resync (unless `resync` is
  off: the caller keeps the features), outputs, stats."""
  active = ~st.done
  lengths = st.cache.lengths
  emitted, n_new, hit_stop = _emitted(spec, st, proposal.tree, verdict)
  count = jnp.where(active, verdict.accepted + 1, 0)  # committed nodes: root + accepted
  cache = commit_target(st.cache, verified, count)
  if dcache is not None and resync:  # an inactive sequence keeps its drafter state
    dcache = spec.impl.resync(drafter, dcache, spec, _first_rows(verified, spec.block_size),
                              lengths, count)
    dcache = dcache.replace(lengths=jnp.where(active, dcache.lengths, st.dcache.lengths))
  i = jnp.arange(spec.block_size)[None]
  slots = jnp.where(i < n_new[:, None], st.produced[:, None] + i, st.tokens.shape[1])
  tokens = st.tokens.at[jnp.arange(emitted.shape[0])[:, None], slots].set(emitted, mode="drop")
  produced = st.produced + n_new
  budget = st.budget
  if spec.online:
    budget = budget_lib.update(budget, spec.cure, active, _beyond_branch0(proposal.tree),
                               verdict.accepted, verdict.branch0_accepted)
  return st.replace(
      cache=cache, dcache=dcache, anchor=jnp.where(active, verdict.next_token, st.anchor),
      tokens=tokens, produced=produced,
      done=st.done | (active & (hit_stop | (produced >= max_new(spec, st)))),
      iterations=st.iterations + active.astype(jnp.int32), step=st.step + 1,
      key=sampling.fold(st.key, 3),
      stats=_record(st.stats, st.step, active, proposal, verdict, n_new), budget=budget)


def verify_budget(target, spec: Spec, st: State, proposal: Proposal, n: int):
  """verify_tree over the proposal's first n nodes only (the rest masked off)."""
  tree = proposal.tree
  cut = proposal.replace(tree=tree.replace(valid=tree.valid & (jnp.arange(tree.size) < n)))
  return _verify(target, spec, st, _prefix(cut, n))


def _put(buf, step, active, val):
  """buf [B, N] with column `step` set to val [B] for the active sequences."""
  return buf.at[:, step].set(jnp.where(active, val, buf[:, step]))


def _record_budget(new: State, st: State, n, expected) -> State:
  """The controller's choice n [] and the tokens it expected [B] into the per-iteration stats."""
  active = ~st.done
  stats = new.stats.replace(
      budget=_put(new.stats.budget, st.step, active, jnp.broadcast_to(n, active.shape)),
      expected=_put(new.stats.expected, st.step, active, expected))
  return new.replace(stats=stats)


# auto's plain steps between two drafter resyncs: their features wait in a buffer and are taken
# in together, one context projection for up to this many rows instead of one per step (on the
# embedded default, half of what a plain step cost beyond ar's)
PENDING = 16


def plain_iteration(target, spec: Spec, st: State, expected):
  """Auto's budget 1: ar's step (the root alone, one row committed) with no drafter pass and no
  drafter resync. expected [B]: the controller's guess. Returns the new state and the committed
  row's features [B, n*H], which the drafter takes in later (resync_pending)."""
  one = dataclasses.replace(spec, block_size=1, auto=None)
  b = st.anchor.shape[0]
  root = tree_lib.build(st.anchor, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32),
                        v_max=1)
  proposal = Proposal(root)
  verdict, verified = _verify(target, one, st, proposal)
  new = commit(None, one, st, proposal, st.dcache, verdict, verified, resync=False)
  return _record_budget(new, st, jnp.ones((), jnp.int32), expected), verified.features[:, 0]


def resync_pending(drafter, spec: Spec, dcache, pending, count):
  """The drafter takes in the features of the plain steps since its last resync: pending
  [B, PENDING, n*H], count [B] of them per sequence, the rows after dcache.lengths. A loop of at
  most one trip (none when nothing waits), not a cond, so that no branch copies the cache."""
  def take(carry):
    dc, _ = carry
    verified = Verified(k=(), v=(), features=pending)
    return spec.impl.resync(drafter, dc, spec, verified, dc.lengths, count), jnp.zeros_like(count)

  return jax.lax.while_loop(lambda c: jnp.any(c[1] > 0), take, (dcache, count))[0]


def drafted_iteration(target, drafter, spec: Spec, st: State, arm) -> State:
  """An iteration at drafting budget index `arm` []: the best-first tree's first n nodes
  verified, each budget its own compiled branch."""
  cfg = spec.auto
  active = ~st.done
  n = jnp.asarray(cfg.budgets)[arm]
  proposal, dcache = propose(target, drafter, spec, st)
  mass = controller.masses(cfg, proposal.tree.valid, proposal.path_logp)
  arms = [i for i, m in enumerate(cfg.budgets) if m > 1]
  verdict, verified = jax.lax.switch(
      arm - arms[0],
      [functools.partial(verify_budget, target, spec, st, proposal, cfg.budgets[i]) for i in arms])
  tree = proposal.tree
  proposal = proposal.replace(tree=tree.replace(valid=tree.valid & (jnp.arange(tree.size) < n)))
  expected = jnp.take(controller.expected_tokens(st.controller), arm, axis=1)
  new = commit(drafter, spec, st, proposal, dcache, verdict, verified)
  new = _record_budget(new, st, n, expected)
  return new.replace(controller=controller.update(st.controller, cfg, arm, active, mass,
                                                  verdict.accepted, st.step))


def _running(spec: Spec, st: State):
  return jnp.any(~st.done) & (st.step < spec.max_new_tokens)


def controlled_iteration(target, drafter, spec: Spec, st: State) -> State:
  """What the goodput controller (cure_jax/tree/controller.py) picks for the whole batch: plain
  target steps while budget 1 wins, then one drafted iteration when a drafting budget does.

  Plain steps run in their own inner loop, whose body is ar's plus the committed row's
  features kept for the drafter (taken in when the loop ends: resync_pending); its condition
  asks the controller every step, so the choices are the ones a per-iteration pick would
  make. The
  drafted iteration is a loop of at most one trip, not a cond, so that no branch copies the
  caches."""
  cfg = spec.auto

  def arm(s):
    return controller.choose(s.controller, cfg, ~s.done, s.step, spec.max_new_tokens)

  def wants(s, plain: bool):
    return _running(spec, s) & ((jnp.asarray(cfg.budgets)[arm(s)] == 1) == plain)

  if cfg.budgets[0] == 1:
    def plain(carry):
      s, pending, count = carry
      expected = controller.expected_tokens(s.controller)[:, 0]
      new, features = plain_iteration(target, spec, s, expected)
      pending = pending.at[jnp.arange(count.shape[0]), count].set(features, mode="drop")
      return new, pending, count + (~s.done).astype(jnp.int32)

    b = st.anchor.shape[0]
    width = len(spec.feature_layers) * target.cfg.hidden_size
    carry = (st, jnp.zeros((b, PENDING, width), target.dtype), jnp.zeros((b,), jnp.int32))
    st, pending, count = jax.lax.while_loop(
        lambda c: wants(c[0], True) & jnp.all(c[2] < PENDING), plain, carry)
    st = st.replace(dcache=resync_pending(drafter, spec, st.dcache, pending, count))
  start = st.step   # the drafted loop's one trip: it ends once the step has moved
  return jax.lax.while_loop(lambda s: (s.step == start) & wants(s, False),
                            lambda s: drafted_iteration(target, drafter, spec, s, arm(s)), st)


def iteration(target, drafter, spec: Spec, st: State) -> State:
  """One propose -> verify -> commit/resync step for every sequence still running."""
  spec = row_spec(spec, st.sampling)
  if spec.auto is not None:
    return controlled_iteration(target, drafter, spec, st)
  proposal, dcache = propose(target, drafter, spec, st)
  verdict, verified = verify_tree(target, spec, st, proposal)
  return commit(drafter, spec, st, proposal, dcache, verdict, verified)


def models(graphdef, params, spec: Spec):
  """(target, drafter) as the loop uses them: a draft vocabulary's head rows gathered once per
  call, not every iteration."""
  target, drafter = _merge(graphdef, params)
  if spec.draft_vocab:
    drafter.hold_head_rows(target, spec.draft_vocab)
  return target, drafter


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("state",))
def decode(graphdef, params, state: State, *, spec: Spec) -> State:
  """Runs iterations inside one compiled while loop until every sequence is done."""
  target, drafter = models(graphdef, params, spec)
  return jax.lax.while_loop(functools.partial(_running, spec),
                            lambda st: iteration(target, drafter, spec, st), state)


# --- sharded compile ------------------------------------------------------------------------------

def lower_sharded(graphdef, params, spec, batch: int, bucket: int, mesh: Mesh):
  """Lowered (prefill, decode) for sharded params: the same jitted functions as the unsharded
  path, wrapped so that the state's shardings are fixed at their boundaries (decode donates it).
  `params` may be abstract (ShapeDtypeStructs with shardings): nothing is allocated, so a mesh
  of compile-only devices (jax.experimental.topologies) works too."""
  rows = NamedSharding(mesh, P(sharding.DATA, None))
  prompt = jax.ShapeDtypeStruct((batch, bucket), jnp.int32, sharding=rows)
  plen = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, P(sharding.DATA)))
  key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  key_data = jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=NamedSharding(mesh, P()))

  first = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))

  def start(p, x, n, k, f):  # k: raw key data (put_key), so every process can supply it
    return prefill(graphdef, p, x, n, jax.random.wrap_key_data(k), f, spec=spec)

  def run(p, st):
    return decode(graphdef, p, st, spec=spec)

  with jax.set_mesh(mesh):   # the TPU attention kernel runs per shard of this mesh
    shapes = jax.eval_shape(start, params, prompt, plen, key_data, first)
    out = sharding.decoding_state_shardings(shapes, mesh)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         shapes, out)
    pre = jax.jit(start, out_shardings=out).lower(params, prompt, plen, key_data, first)
    dec = jax.jit(run, out_shardings=out, donate_argnums=1).lower(params, state)
  return pre, dec


def compile_sharded(graphdef, params, spec, batch: int, bucket: int, mesh: Mesh,
                    options: dict[str, str] | None = None):
  """Compiled (prefill, decode) of lower_sharded, with XLA `options` if given."""
  pre, dec = lower_sharded(graphdef, params, spec, batch, bucket, mesh)
  return xla_options.compile_with(pre, options), xla_options.compile_with(dec, options)
