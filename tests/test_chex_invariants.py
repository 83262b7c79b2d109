"""chex invariants of the gate, tree build, verification and commit, each run with and without
jit (`chex.variants`) on hypothesis-generated blocks and checked against plain-Python references;
and `chex.assert_max_traces` on the decode loop: one trace per Spec for every prompt of a bucket
and every batch of one shape, while a Python value leaking into the Spec retraces and fails."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from cure_jax.runtime import decoding, generation
from cure_jax.methods.base import Spec
from cure_jax.analysis import random_models
from cure_jax.tree import repair, candidates as tree_lib, verify
from cure_jax.models.cache import KVCache
from cure_jax.runtime.generation import Generator
from tests.test_tree import _random_block, cases

SETTINGS = settings(max_examples=15, deadline=None)
BATCH = 3  # _random_block's batch


def _gate_inputs(k, vocab, cfg, seed):
  logits, anchor, limit, lengths, redraft = _random_block(k, vocab, seed)
  limit = jnp.minimum(limit, cfg.max_depth)
  return logits, jnp.argmax(logits, -1).astype(jnp.int32), anchor, limit, lengths, redraft


def _path_rows(draft, depth, alt, redraft, k):
  """Each repair path's token row: the draft before its focal depth, its alternative there, an
  arbitrary re-draft after. [B, R, K-1]"""
  d = jnp.arange(1, k)[None, None]
  j = depth[..., None]
  return jnp.where(d < j, draft[:, None], jnp.where(d == j, alt[..., None],
                                                    redraft[:, :depth.shape[1]]))


def _reference_gate(logits, limit, cfg):
  """The gate in plain Python: (positions, margins, branches) [B, U], alternatives [B, K-1, b]."""
  logits, limit = np.asarray(logits), np.asarray(limit)
  b, km1, _ = logits.shape
  top = -np.sort(-logits, axis=-1)
  margins = top[..., 0] - top[..., 1]
  u = cfg.max_repair_positions
  pos, marg, br = (np.full((b, u), -1), np.zeros((b, u), np.float32), np.zeros((b, u), int))
  for i in range(b):
    eligible = [j for j in range(km1)
                if margins[i, j] < cfg.tau_margin and j < limit[i] and j < cfg.max_depth]
    if cfg.select == "margin":
      eligible.sort(key=lambda j: (margins[i, j], j))
    chosen = eligible[:u]  # expected_gain keeps the eligible set and count only (checked below)
    for slot, j in enumerate(chosen):
      m = margins[i, j]
      budget = (cfg.b_min + np.round(np.clip(1 - m / cfg.margin_scale, 0, 1) *
                                     (cfg.b_max - cfg.b_min)) if cfg.dynamic else cfg.b_max)
      pos[i, slot], marg[i, slot], br[i, slot] = j + 1, m, budget
  ranked = np.argsort(-logits, axis=-1, kind="stable")                     # ties: lower index
  draft = ranked[..., 0]
  alts = np.stack([[[t for t in ranked[i, j] if t != draft[i, j]][:cfg.b_max] for j in range(km1)]
                   for i in range(b)])
  return pos, marg, br, alts


def _reference_ancestors(parent, valid):
  """Ancestor closure (self included) by walking parent pointers; padding sees itself."""
  b, v = parent.shape
  anc = np.zeros((b, v, v), bool)
  for i in range(b):
    for n in range(v):
      node = n
      while node >= 0:
        anc[i, n, node] = True
        node = parent[i, node] if valid[i, n] else -1
  return anc


def _reference_greedy(t, target_argmax, length):
  """Greedy verification in plain Python: walk every node's root path."""
  tokens, parent, depth, valid, branch = map(np.asarray, (t.tokens, t.parent, t.depth, t.valid,
                                                          t.branch))
  target_argmax = np.asarray(target_argmax)
  b, v = tokens.shape
  out = dict(accepted=[], path=[], next_token=[], winner=[], branch0_accepted=[])
  for i in range(b):
    def root_path(n):
      nodes = []
      while n >= 0:
        nodes.append(n)
        n = parent[i, n]
      return nodes[::-1]
    ok = [valid[i, n] and all(p == 0 or tokens[i, p] == target_argmax[i, parent[i, p]]
                              for p in root_path(n)) for n in range(v)]
    reach = [depth[i, n] if ok[n] else -1 for n in range(v)]
    winner = int(np.argmax(reach))  # the first deepest: branch 0 on ties
    path = root_path(winner)
    out["accepted"].append(reach[winner])
    out["path"].append(path + [0] * (length - len(path)))
    out["next_token"].append(target_argmax[i, winner])
    out["winner"].append(winner)
    out["branch0_accepted"].append(max([depth[i, n] for n in range(v) if ok[n] and
                                        branch[i, n] == 0]))
  return verify.Verdict(**{k: np.asarray(x, np.int32) for k, x in out.items()})


class TreeInvariants(chex.TestCase):
  """Each test runs once under jax.jit and once eagerly, on the same hypothesis cases."""

  def _tree(self, case, build):
    k, vocab, cfg, seed = case
    logits, draft, anchor, limit, lengths, redraft = _gate_inputs(k, vocab, cfg, seed)
    gate, alts = repair.select(logits, draft, limit, cfg)
    depth, alt, valid = repair.repair_paths(gate, alts, cfg.num_paths)
    rows = _path_rows(draft, depth, alt, redraft, k)
    t = build(anchor, draft, limit, v_max=cfg.v_max, keep_branch0=cfg.keep_branch0,
              path_tokens=rows, path_depth=depth, path_valid=valid)
    return t, dict(anchor=anchor, draft=draft, limit=limit, rows=rows, depth=depth, valid=valid,
                   lengths=lengths)

  @chex.variants(with_jit=True, without_jit=True)
  @SETTINGS
  @given(cases())
  def test_gate_matches_the_python_reference(self, case):
    k, vocab, cfg, seed = case
    logits, draft, _, limit, _, _ = _gate_inputs(k, vocab, cfg, seed)
    gate, alts = self.variant(repair.select, static_argnames="cfg")(logits, draft, limit, cfg=cfg)
    u = cfg.max_repair_positions
    chex.assert_shape([gate.positions, gate.margins, gate.branches], (BATCH, u))
    chex.assert_shape(alts, (BATCH, k - 1, cfg.b_max))
    chex.assert_type([gate.positions, gate.margins, gate.branches, alts],
                     [jnp.int32, jnp.float32, jnp.int32, jnp.int32])
    chex.assert_tree_all_finite(gate.margins)
    pos, marg, br, ref_alts = _reference_gate(logits, limit, cfg)
    chex.assert_trees_all_equal(alts, ref_alts.astype(np.int32))
    if cfg.select == "expected_gain":  # its ranking has no simple reference: the set rules only
      chosen = np.asarray(gate.positions)
      chex.assert_trees_all_equal(np.sum(chosen > 0, 1), np.sum(pos > 0, 1))
      return
    chex.assert_trees_all_equal(gate.positions, pos.astype(np.int32))
    chex.assert_trees_all_close(gate.margins, marg, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_equal(gate.branches, br.astype(np.int32))
    paths = self.variant(repair.repair_paths, static_argnames="num_paths")
    depth, alt, valid = paths(gate, alts, num_paths=cfg.num_paths)
    chex.assert_shape([depth, alt, valid], (BATCH, min(cfg.num_paths, u * cfg.b_max)))
    # Path r is (UFP u, alternative rank i) in that order, only for i < the UFP's budget.
    want = [[(p, ref_alts[b, p - 1, i]) for slot, p in enumerate(pos[b]) if p > 0
             for i in range(br[b, slot])][:cfg.num_paths] for b in range(BATCH)]
    got = [[(int(d), int(a)) for d, a, ok in zip(depth[b], alt[b], valid[b]) if ok]
           for b in range(BATCH)]
    assert got == [[(int(p), int(a)) for p, a in w] for w in want]

  @chex.variants(with_jit=True, without_jit=True)
  @SETTINGS
  @given(cases())
  def test_tree_build_invariants(self, case):
    k, _, cfg, _ = case
    build = self.variant(tree_lib.build, static_argnames=("v_max", "keep_branch0"))
    t, x = self._tree(case, build)
    v = cfg.v_max  # padded to exactly the budget, so leaves (hybrid) can fill every slot
    chex.assert_shape([t.tokens, t.parent, t.depth, t.valid, t.branch, t.source], (BATCH, v))
    chex.assert_shape(t.ancestors, (BATCH, v, v))
    chex.assert_type([t.tokens, t.parent, t.depth, t.valid, t.ancestors],
                     [jnp.int32, jnp.int32, jnp.int32, bool, bool])
    tokens, parent, depth, valid, branch, source = map(
        np.asarray, (t.tokens, t.parent, t.depth, t.valid, t.branch, t.source))
    limit, rows = np.asarray(x["limit"]), np.asarray(x["rows"])
    pdepth, pvalid = np.asarray(x["depth"]), np.asarray(x["valid"])
    # The root is the anchor; every other valid node hangs off an earlier valid node one level up.
    chex.assert_trees_all_equal(tokens[:, 0], np.asarray(x["anchor"]))
    chex.assert_trees_all_equal(valid[:, 0], np.ones(BATCH, bool))
    chex.assert_trees_all_equal(parent[:, 0], np.full(BATCH, -1, np.int32))
    idx = np.arange(v)[None]
    inner = valid & (idx > 0)
    safe = np.maximum(parent, 0)
    chex.assert_trees_all_equal(np.where(inner, (parent >= 0) & (parent < idx), True),
                                np.ones_like(inner))
    chex.assert_trees_all_equal(np.where(inner, np.take_along_axis(valid, safe, 1), True),
                                np.ones_like(inner))
    chex.assert_trees_all_equal(np.where(inner, depth - np.take_along_axis(depth, safe, 1), 1),
                                np.ones_like(depth))
    chex.assert_trees_all_equal(np.where(valid, depth <= limit[:, None], True), np.ones_like(inner))
    chex.assert_trees_all_equal(t.ancestors, _reference_ancestors(parent, valid))
    # Tokens: branch 0 is the draft, a repair node is its path's row at its depth.
    draft = np.asarray(x["draft"])
    rep = valid & (source >= k)
    # Padding slots (invalid, past the raw candidates) are clipped only to index safely.
    path = np.clip((source - k) // (k - 1), 0, rows.shape[1] - 1)
    at = (source - k) % (k - 1)
    want = np.where(branch == 0, np.take_along_axis(draft, np.maximum(depth - 1, 0), 1), tokens)
    want = np.where(rep, rows[np.arange(BATCH)[:, None], path, at], want)
    chex.assert_trees_all_equal(np.where(inner, tokens, 0), np.where(inner, want, 0))
    # How many nodes: every usable candidate (branch 0 to the limit, each path from its focal
    # depth to the limit), cut to v_max.
    for b in range(BATCH):
      focal = pdepth[b][pvalid[b]]
      b0 = sum(1 for d in range(1, limit[b] + 1)
               if cfg.keep_branch0 or not focal.size or d <= focal.max() - 1)
      total = 1 + b0 + sum(max(0, limit[b] - j + 1) for j in focal)
      assert valid[b].sum() == min(total, v), (b, valid[b].sum(), total, v)

  @chex.variants(with_jit=True, without_jit=True)
  @SETTINGS
  @given(cases())
  def test_greedy_verification_matches_the_python_walk(self, case):
    k, vocab, _, seed = case
    t, _ = self._tree(case, tree_lib.build)
    rng = np.random.default_rng(seed + 1)
    # The target's argmax after node i: mostly one of i's children (so paths get accepted).
    tokens, parent, valid = map(np.asarray, (t.tokens, t.parent, t.valid))
    argmax = rng.integers(0, vocab, tokens.shape)
    for b, i in zip(*np.nonzero(valid)):
      kids = np.flatnonzero(valid[b] & (parent[b] == i))
      if kids.size and rng.random() < 0.8:
        argmax[b, i] = tokens[b, rng.choice(kids)]
    argmax = jnp.asarray(argmax, jnp.int32)
    verdict = self.variant(verify.greedy, static_argnames="length")(t, argmax, length=k)
    chex.assert_shape([verdict.accepted, verdict.next_token, verdict.winner], (BATCH,))
    chex.assert_shape(verdict.path, (BATCH, k))
    chex.assert_trees_all_equal(verdict, _reference_greedy(t, argmax, k))

  @chex.variants(with_jit=True, without_jit=True)
  @SETTINGS
  @given(cases())
  def test_commit_moves_the_accepted_path_into_the_cache(self, case):
    k, vocab, _, seed = case
    t, _ = self._tree(case, tree_lib.build)
    rng = np.random.default_rng(seed + 2)
    layers, max_len, kvh, hd = 2, 24, 2, 3
    argmax = jnp.asarray(rng.integers(0, vocab, t.tokens.shape), jnp.int32)
    verdict = verify.greedy(t, argmax, k)
    count = verdict.accepted + 1                                            # root + accepted
    lengths = jnp.asarray(rng.integers(max_len - 2 * k, max_len, BATCH), jnp.int32)  # near end
    cache_shape = (BATCH, kvh, max_len, hd)                                 # heads-major
    per_layer = lambda: tuple(jnp.asarray(rng.normal(size=cache_shape), jnp.float32)  # noqa: E731
                              for _ in range(layers))
    old = KVCache(k=per_layer(), v=per_layer(), lengths=lengths)
    shape = (layers, BATCH, t.size, kvh, hd)                                # the tree's K/V
    k_new, v_new = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))

    spec = Spec(method="ar", max_new_tokens=1, max_len=max_len)

    def commit(cache, k_tree, v_tree, path, count):
      out = types.SimpleNamespace(k=k_tree, v=v_tree)
      return decoding.commit_target(cache, spec.impl.keep_verified(spec, t, out, path), count)

    new = self.variant(commit)(old, k_new, v_new, verdict.path, count)
    chex.assert_trees_all_equal_shapes_and_dtypes(new, old)
    chex.assert_tree_all_finite(new)
    want_k, want_v = np.array(old.k), np.array(old.v)
    path, count, lengths = map(np.asarray, (verdict.path, count, lengths))
    for b in range(BATCH):
      for i in range(count[b]):
        if lengths[b] + i < max_len:  # writes past the cache end are dropped
          want_k[:, b, :, lengths[b] + i] = np.asarray(k_new)[:, b, path[b, i]]
          want_v[:, b, :, lengths[b] + i] = np.asarray(v_new)[:, b, path[b, i]]
    chex.assert_trees_all_equal(
        new, KVCache(k=tuple(want_k), v=tuple(want_v),
                     lengths=np.minimum(lengths + count, max_len)))


# ----------------------------------------------------------------------------- trace counts

ARCH = random_models.Arch()


def _count_traces(monkeypatch):
  """Re-jits decoding.prefill / decode with their Python bodies under chex.assert_max_traces(n=1)
  and empties the Generator's executable cache, so every compile traces through the counter."""
  chex.clear_trace_counter()
  statics = dict(static_argnames=("graphdef", "spec"))
  monkeypatch.setattr(decoding, "prefill", jax.jit(
      chex.assert_max_traces(decoding.prefill.__wrapped__, n=1), **statics))
  monkeypatch.setattr(decoding, "decode", jax.jit(
      chex.assert_max_traces(decoding.decode.__wrapped__, n=1), donate_argnames=("state",),
      **statics))
  monkeypatch.setattr(generation, "_EXECUTABLES", {})


@pytest.mark.parametrize("method", ["chain", "cure"])
def test_decode_loop_traces_once_per_bucket_and_batch_shape(monkeypatch, method):
  target, drafter = random_models.pair(ARCH, 3)
  gen = Generator(target, drafter, method=method, max_new_tokens=12)
  lengths = (2, 5, 11, 17, 30)  # one prompt bucket (32)
  prompts = [random_models.prompts(n, ARCH.vocab, 1, lo=n, hi=n)[0] for n in lengths]
  assert len({generation.prompt_bucket(len(p)) for p in prompts}) == 1
  _count_traces(monkeypatch)
  for p in prompts:  # batch 1, every prompt of the bucket
    gen.generate([p])
  chex.clear_trace_counter()  # a new batch shape may trace once more, and only once
  for i in range(3):
    gen.generate([prompts[i], prompts[i + 1], prompts[(i + 2) % len(prompts)]])
  assert len(generation._EXECUTABLES) == 2


def test_one_prefill_serves_every_prompt_up_to_max_len(monkeypatch):
  """With max_len set, prompts of 3 to 150 tokens (five power-of-two buckets, 1 to 10 chunks of
  16) share one compiled prefill and decode loop: the chunks are a loop count."""
  target, drafter = random_models.pair(ARCH, 3)
  gen = Generator(target, drafter, method="chain", max_new_tokens=8, max_len=160,
                  prefill_chunk=16)
  _count_traces(monkeypatch)
  for n in (3, 16, 40, 97, 150):
    gen.generate(random_models.prompts(n, ARCH.vocab, 1, lo=n, hi=n))
  assert len(generation._EXECUTABLES) == 1


def test_a_python_int_leaking_into_the_spec_fails_the_trace_count(monkeypatch):
  """Sizing the cache from each prompt's own length (not its bucket) puts a per-prompt Python int
  into the Spec, a static argument: the second prompt retraces and chex says so."""
  target, drafter = random_models.pair(ARCH, 3)
  gen = Generator(target, drafter, method="chain", max_new_tokens=12)
  monkeypatch.setattr(Generator, "cache_len", lambda self, n: n + self.max_new_tokens - 1)
  _count_traces(monkeypatch)
  gen.generate(random_models.prompts(0, ARCH.vocab, 1, lo=4, hi=4))
  with pytest.raises(AssertionError, match="is traced > 1 times"):
    gen.generate(random_models.prompts(0, ARCH.vocab, 1, lo=5, hi=5))


# ----------------------------------------------------------------------------- boundary asserts

_B, _K, _VOCAB = 2, 6, 8
_DRAFT, _ANCHOR, _LIMIT = (jnp.zeros((_B, _K - 1), jnp.int32), jnp.zeros((_B,), jnp.int32),
                           jnp.full((_B,), _K - 1, jnp.int32))
_CFG = repair.RepairConfig(max_depth=_K - 1)
_BUILD = jax.jit(tree_lib.build, static_argnames="v_max")
_TREE = tree_lib.build(_ANCHOR, _DRAFT, _LIMIT, v_max=_K)
BAD_INPUTS = {  # name -> (call, what chex reports)
    "build_anchor_rank": (lambda: _BUILD(_ANCHOR[:, None], _DRAFT, _LIMIT, v_max=_K), "assert_shape"),
    "build_float_draft": (lambda: _BUILD(_ANCHOR, _DRAFT * 1.0, _LIMIT, v_max=_K), "assert_type"),
    "build_path_rows": (lambda: _BUILD(_ANCHOR, _DRAFT, _LIMIT, v_max=_K,
                                       path_tokens=jnp.zeros((_B, 2, _K), jnp.int32),
                                       path_depth=jnp.ones((_B, 2), jnp.int32),
                                       path_valid=jnp.ones((_B, 2), bool)), "assert_shape"),
    "select_transposed_logits": (lambda: jax.jit(repair.select, static_argnames="cfg")(
        jnp.zeros((_B, _VOCAB, _K - 1)), _DRAFT, _LIMIT, cfg=_CFG), "assert_shape"),
    "select_int_logits": (lambda: repair.select(jnp.zeros((_B, _K - 1, _VOCAB), jnp.int32),
                                                _DRAFT, _LIMIT, _CFG), "assert_type"),
    "greedy_float_argmax": (lambda: jax.jit(verify.greedy, static_argnames="length")(
        _TREE, jnp.zeros((_B, _K)), length=_K), "assert_type"),
    "greedy_short_argmax": (lambda: verify.greedy(_TREE, jnp.zeros((_B, _K - 1), jnp.int32), _K),
                            "assert_equal_shape"),
    "stochastic_p_rank": (lambda: verify.stochastic(_TREE, jnp.zeros((_B, _K)), None, None,
                                                    jax.random.key(0), _K, 1), "assert_shape"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_public_boundaries_reject_wrong_shapes_and_types(name):
  """The static asserts at the public boundaries fire at trace time, under jit too."""
  call, check = BAD_INPUTS[name]
  with pytest.raises(AssertionError, match=rf"\[Chex\] Assertion {check} failed"):
    call()
