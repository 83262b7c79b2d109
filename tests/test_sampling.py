"""Sampling is lossless: every method's first three tokens follow the target's own distribution.

Stated test: a random target/drafter pair over a 4-token vocabulary (64 possible 3-token
continuations). The exact target distribution of the first 3 tokens is computed by enumerating
all prefixes through the target. Each method draws N = 3000 continuations (one batch, fresh
seed per row); a chi-square goodness-of-fit test (cells with expected count < 5 merged) must not
reject at significance 0.001. A deliberately wrong verifier ("test every child against the full
target distribution and keep the longest accepted branch", no residual) must be rejected.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from cure_jax.tree import controller, repair, sampling, verify
from cure_jax.runtime.generation import Generator
from cure_jax.tree.sampling import Sampling
from cure_jax.analysis import random_models

ARCH = random_models.Arch(vocab=4, block_size=4, target_layer_ids=(0, 2))
N = 3000
PROMPT = [1, 2, 0, 3, 1]
ALPHA = 1e-3


def _exact(target, warp: Sampling):
  """P(t1, t2, t3 | PROMPT) under plain target sampling, by enumeration: [V, V, V]."""
  v = ARCH.vocab
  seqs = [PROMPT + list(prefix) for n in range(3) for prefix in itertools.product(range(v),
                                                                                  repeat=n)]
  longest = max(map(len, seqs))
  tokens = jnp.asarray([s + [0] * (longest - len(s)) for s in seqs], jnp.int32)
  b = tokens.shape[0]
  cache = target.init_cache(b, 1)
  mask = jnp.concatenate([jnp.zeros((b, longest, 1), bool),
                          jnp.broadcast_to(jnp.tril(jnp.ones((longest, longest), bool)),
                                           (b, longest, longest))], axis=-1)
  out = target(tokens, jnp.broadcast_to(jnp.arange(longest), (b, longest)), cache, mask)
  last = jnp.asarray([len(s) - 1 for s in seqs])
  probs = np.asarray(sampling.warp(target.logits(out.hidden[jnp.arange(b), last]), warp),
                     np.float64)
  dist = {tuple(s[len(PROMPT):]): probs[i] for i, s in enumerate(seqs)}
  joint = np.zeros((v, v, v))
  for t1, t2, t3 in itertools.product(range(v), repeat=3):
    joint[t1, t2, t3] = dist[()][t1] * dist[(t1,)][t2] * dist[(t1, t2)][t3]
  return joint


def _p_value(counts, expected):
  counts, expected = counts.ravel(), expected.ravel()
  order = np.argsort(expected)
  small = expected[order] < 5
  merged_c = np.append(counts[order][~small], counts[order][small].sum())
  merged_e = np.append(expected[order][~small], expected[order][small].sum())
  keep = merged_e > 0
  return stats.chisquare(merged_c[keep], merged_e[keep] * merged_c.sum() / merged_e[keep].sum()
                         ).pvalue


def _counts(gen, max_new=3):
  outs = gen.generate([PROMPT] * N, seed=123)
  counts = np.zeros((ARCH.vocab,) * 3)
  for r in outs:
    counts[tuple(r.output_ids[:3])] += 1
  return counts


def _generators(target, drafter, ar_drafter, warp, max_new=3):
  cure = repair.RepairConfig(tau_margin=1e9, v_max=16, max_depth=ARCH.block_size - 1, b_max=3,
                             beam_width=3)
  common = dict(max_new_tokens=max_new, sampling=warp)
  return {
      "chain": Generator(target, drafter, method="chain", **common),
      "cure": Generator(target, drafter, method="cure", cure=cure, **common),
      "ddtree": Generator(target, drafter, method="ddtree", cure=dataclasses.replace(cure, topk=3),
                          **common),
      "hybrid": Generator(target, drafter, method="hybrid",
                          cure=dataclasses.replace(cure, topk=2, beam_width=2), **common),
      "ar_draft": Generator(target, ar_drafter, method="ar_draft", block_size=3, **common),
      # Costs under which plain steps, cut trees and whole trees all win somewhere.
      "auto": Generator(target, drafter, method="auto", cure=dataclasses.replace(cure, topk=3),
                        auto=controller.Settings(budgets=(1, 4, 16), costs=(1.0, 1.3, 1.6),
                                                 explore_every=2), **common),
  }


@pytest.fixture(scope="module")
def models():
  target, drafter = random_models.pair(ARCH, 3, logit_scale=1.5)
  return target, drafter, random_models.ar_drafter(ARCH, 3)


@pytest.mark.parametrize("warp", [Sampling(1.0), Sampling(0.8, top_k=3, top_p=0.9)],
                         ids=["t1", "t0.8_topk3_topp0.9"])
def test_speculative_sampling_matches_target_distribution(models, warp):
  target, drafter, ar_drafter = models
  expected = _exact(target, warp) * N
  for name, gen in _generators(target, drafter, ar_drafter, warp).items():
    p = _p_value(_counts(gen), expected)
    assert p > ALPHA, (name, p)


def test_reduced_draft_vocab_matches_target_distribution(models):
  """drafter.vocab: the drafter proposes 3 of the 4 tokens, never token 2, which the target does
  write; the residual distribution must supply it."""
  target, drafter, _ = models
  warp = Sampling(1.0)
  expected = _exact(target, warp) * N
  assert expected[2].sum() > 0.05 * N
  cure = repair.RepairConfig(tau_margin=1e9, v_max=16, max_depth=ARCH.block_size - 1, b_max=2,
                             beam_width=2, topk=2)
  for method in ("chain", "cure", "ddtree"):
    gen = Generator(target, drafter, method=method, max_new_tokens=3, sampling=warp,
                    draft_vocab=(0, 1, 3), cure=None if method == "chain" else cure)
    assert _p_value(_counts(gen), expected) > ALPHA, method


def _longest_branch_verifier(tree, p, q, deterministic, key, length, max_children):
  """WRONG on purpose: each node accepted with min(1, p/q) against the full target distribution
  (no residual), the longest accepted branch kept, the bonus drawn from p at its end."""
  x = tree.tokens
  parent = jnp.maximum(tree.parent, 0)
  p_parent = jnp.take_along_axis(p, parent[..., None], axis=1)             # [B, V, N]
  px = jnp.take_along_axis(p_parent, x[..., None], axis=2)[..., 0]
  qx = jnp.where(deterministic, 1.0, jnp.take_along_axis(q, x[..., None], axis=2)[..., 0])
  u = jax.vmap(lambda k: jax.random.uniform(k, px.shape[1:]))(key)       # key: one per row
  correct = (tree.parent < 0) | (u * qx < px)
  ok = verify.accepted_nodes(tree, correct)
  reach = jnp.where(ok, tree.depth, -1)
  winner = jnp.argmax(reach, axis=1).astype(jnp.int32)
  final = jnp.take_along_axis(p, winner[:, None, None], axis=1)[:, 0]
  return verify.Verdict(accepted=jnp.max(reach, axis=1), path=verify.path_to(tree, winner, length),
                        next_token=sampling.draw(sampling.fold(key, 1), final),
                        winner=winner, branch0_accepted=jnp.zeros_like(winner))


def test_a_wrong_verifier_is_caught(models, monkeypatch):
  target, drafter, ar_drafter = models
  warp = Sampling(1.0)
  expected = _exact(target, warp) * N
  monkeypatch.setattr(verify, "stochastic", _longest_branch_verifier)
  # max_new=4 gives a Spec never compiled before, so the patched verifier is traced.
  gens = _generators(target, drafter, ar_drafter, warp, max_new=4)
  for name in ("chain", "cure", "ddtree"):
    assert _p_value(_counts(gens[name]), expected) < ALPHA, name


def test_temperature_zero_is_greedy(models):
  target, drafter, _ = models
  greedy = Generator(target, drafter, method="cure", max_new_tokens=8,
                     cure=repair.RepairConfig(tau_margin=1e9, v_max=16, max_depth=3, b_max=3))
  zero = Generator(target, drafter, method="cure", max_new_tokens=8, sampling=Sampling(0.0),
                   cure=repair.RepairConfig(tau_margin=1e9, v_max=16, max_depth=3, b_max=3),
                   seed=5)
  ref = Generator(target, method="ar", max_new_tokens=8)
  prompts = random_models.prompts(1, ARCH.vocab, 4)
  for a, b, c in zip(greedy.generate(prompts), zero.generate(prompts), ref.generate(prompts)):
    assert a.output_ids == b.output_ids == c.output_ids


def test_runs_are_reproducible_from_the_seed(models):
  target, drafter, _ = models
  gen = Generator(target, drafter, method="chain", max_new_tokens=8, sampling=Sampling(1.0))
  prompts = random_models.prompts(2, ARCH.vocab, 6)
  first = [r.output_ids for r in gen.generate(prompts, seed=7)]
  assert first == [r.output_ids for r in gen.generate(prompts, seed=7)]
  assert first != [r.output_ids for r in gen.generate(prompts, seed=8)]


def test_bad_sampling_settings_are_refused(models):
  target, _, _ = models
  for bad, match in [(Sampling(-1.0), "temperature"), (Sampling(1.0, top_k=-2), "top_k"),
                     (Sampling(1.0, top_p=0.0), "top_p")]:
    with pytest.raises(ValueError, match=match):
      Generator(target, method="ar", max_new_tokens=4, sampling=bad)
