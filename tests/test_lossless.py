"""The central invariant: float32 greedy speculative decoding emits exactly the target's greedy
tokens, for every method, on many random target/drafter pairs and prompts."""

import numpy as np
import pytest

from cure_jax.tree import controller, repair
from cure_jax.runtime import draft_vocab
from cure_jax.runtime.generation import PREFILL_CHUNK, Generator
from cure_jax.analysis import random_models

QWEN3 = random_models.Arch()
LLAMA = random_models.Arch(vocab=6, model_type="llama", tie=True, heads=4, kv_heads=1,
                           block_size=5, target_layer_ids=(1, 2), draft_layers=1)
SEEDS = range(13)   # 13 random pairs per architecture, 3 prompts each
MAX_NEW = 20
LONGEST = 12  # random_models.prompts' longest prompt
# Chunked prefill: prompts of 7, 9 and 12 tokens (under, over, at a multiple of 4) in one batch,
# in chunks of 4; the reference prefills each prompt in one step.
CHUNK, CHUNKED_LENGTHS, CHUNKED_SEEDS = 4, (7, 9, LONGEST), range(4)


def _cure(arch, **kw):
  base = dict(tau_margin=1e9, v_max=40, beam_width=5, b_max=5, max_depth=arch.block_size - 1)
  base.update(kw)
  return repair.RepairConfig(**base)


def _variants(full, arch, target, drafter, ar_drafter, tight, chunk):
  """Each architecture exercises a different half of the settings (one compile per variant);
  the `full` half has every method. With a chunk, every variant prefills in chunks and the
  drafter window joins in."""
  new = dict(max_new_tokens=MAX_NEW, prefill_chunk=chunk)
  return {**_settings(full, arch, target, drafter, ar_drafter, tight, new),
          **(_windows(arch, target, drafter, new) if chunk == CHUNK else {})}


def _windows(arch, target, drafter, new):
  """The DFlash drafter seeing only its last few context positions (drafter.window)."""
  return {"chain_window1": Generator(target, drafter, method="chain", drafter_window=1, **new),
          "cure_window5": Generator(target, drafter, method="cure", drafter_window=5,
                                    cure=_cure(arch), **new)}


def _settings(full, arch, target, drafter, ar_drafter, tight, new):
  if full:
    return {
        "chain": Generator(target, drafter, method="chain", **new),
        "cure": Generator(target, drafter, method="cure", cure=_cure(arch), **new),
        "cure_no_branch0": Generator(target, drafter, method="cure",
                                     cure=_cure(arch, keep_branch0=False), **new),
        "ar_draft": Generator(target, ar_drafter, method="ar_draft", block_size=4, **new),
        "ddtree": Generator(target, drafter, method="ddtree", cure=_cure(arch, topk=3), **new),
        "hybrid": Generator(target, drafter, method="hybrid",
                            cure=_cure(arch, v_max=24, topk=2, select="earliest"), **new),
        # The tree rarely pays at these costs: chain-only iterations with a tree every third.
        "cure_online": Generator(target, drafter, method="cure",
                                 cure=_cure(arch, online=True, cost_verify_per_node=10.0,
                                            explore_every=3), **new),
        # Costs that make every budget the best somewhere: plain steps, cut trees, whole trees.
        "auto": Generator(target, drafter, method="auto", cure=_cure(arch, topk=3),
                          auto=controller.Settings(budgets=(1, 3, 6, 12),
                                                   costs=(1.0, 1.3, 1.5, 1.9), explore_every=3),
                          **new),
    }
  # A tight cache (no slack past prompt + new tokens) makes the cache end cut the last trees.
  return {
      "chain_tight": Generator(target, drafter, method="chain", max_len=tight, **new),
      "cure_tight_multi": Generator(target, drafter, method="cure", max_len=tight,
                                    cure=_cure(arch, v_max=12, max_repair_positions=2,
                                               select="earliest"), **new),
      "ar_draft_gamma2": Generator(target, ar_drafter, method="ar_draft", block_size=3, **new),
      "cure_gain_fixed_no_resync": Generator(
          target, drafter, method="cure",
          cure=_cure(arch, dynamic=False, select="expected_gain", resync=False), **new),
      "ddtree_tight": Generator(target, drafter, method="ddtree", max_len=tight,
                                cure=_cure(arch, v_max=9, topk=2), **new),
      "hybrid_online_tight": Generator(target, drafter, method="hybrid", max_len=tight,
                                       cure=_cure(arch, v_max=12, topk=3, online=True), **new),
      "auto_tight": Generator(target, drafter, method="auto", max_len=tight,
                              cure=_cure(arch, topk=2),
                              auto=controller.Settings(budgets=(1, 2, 9), costs=(1.0, 1.2, 1.6),
                                                       explore_every=2), **new),
  }


def _batch(seed, vocab, chunked):
  """Three prompts, the last of LONGEST tokens, so the tight cache length (and its compiled
  loop) is the same for every seed instead of one compile per seed."""
  if chunked:
    return [random_models.prompts(seed + 500 + n, vocab, 1, lo=n, hi=n)[0]
            for n in CHUNKED_LENGTHS]
  return (random_models.prompts(seed, vocab, 2) +
          random_models.prompts(seed + 500, vocab, 1, lo=LONGEST, hi=LONGEST))


def check_equals_target_greedy(arch, seeds, full: bool, chunked: bool = False) -> dict:
  """Every variant (the QWEN3 half of the settings when `full`, else the other half) emits the
  target-only greedy tokens for 3 prompts on each seed's random pair; returns how many long
  accepts and repair wins the comparison saw."""
  counters = dict(repair_wins=0, long_accepts=0, plain_steps=0, cut_trees=0)
  for seed in seeds:
    target, drafter = random_models.pair(arch, seed)
    batch = _batch(seed, arch.vocab, chunked)
    assert len(batch[-1]) == LONGEST
    tight = LONGEST + MAX_NEW - 1
    ref = Generator(target, method="ar", max_new_tokens=MAX_NEW).generate(batch)
    variants = _variants(full, arch, target, drafter, random_models.ar_drafter(arch, seed), tight,
                         CHUNK if chunked else PREFILL_CHUNK)
    for name, gen in variants.items():
      for r, a in zip(gen.generate(batch), ref):
        assert r.output_ids == a.output_ids, (name, seed)
        assert len(r.output_ids) == MAX_NEW
        assert sum(r.accept_lengths) == MAX_NEW - 1, (name, seed)
        counters["long_accepts"] += sum(n >= 2 for n in r.accept_lengths)
        counters["repair_wins"] += sum(s["winning_branch"] > 0 for s in r.stats)
        counters["plain_steps"] += sum(s["budget"] == 1 for s in r.stats)
        counters["cut_trees"] += sum(1 < s["budget"] < gen.cure.v_max for s in r.stats
                                     if gen.auto)
  return counters


@pytest.mark.parametrize("chunked", [False, True], ids=["one_step_prefill", "chunked_prefill"])
@pytest.mark.parametrize("arch", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_every_method_equals_target_greedy(arch, chunked):
  seeds = CHUNKED_SEEDS if chunked else SEEDS
  counters = check_equals_target_greedy(arch, seeds, full=arch is QWEN3, chunked=chunked)
  # The comparison is only meaningful if drafts were accepted and repairs won.
  assert counters["long_accepts"] > 50 * len(seeds) / len(SEEDS), counters
  assert counters["repair_wins"] > 20 * len(seeds) / len(SEEDS), counters
  assert min(counters["plain_steps"], counters["cut_trees"]) > 20 * len(seeds) / len(SEEDS), \
      counters   # auto switched between plain steps, cut trees and whole trees


VOCAB16 = random_models.Arch(vocab=16)
SUBSET, VOCAB_SEEDS = 6, range(6)


def test_reduced_draft_vocab_equals_target_greedy():
  """drafter.vocab: chain, ddtree and cure drafting only the 6 tokens the target writes most
  often (counted on other prompts, as the real counts are) of 16. The target writes tokens
  outside them too, which the drafter can never propose: the verification must supply them."""
  counters = dict(long_accepts=0, repair_wins=0, outside=0)
  for seed in VOCAB_SEEDS:
    target, drafter = random_models.pair(VOCAB16, seed)
    ar = Generator(target, method="ar", max_new_tokens=MAX_NEW)
    written = [t for r in ar.generate(random_models.prompts(seed + 900, VOCAB16.vocab, 4))
               for t in r.output_ids]
    vocab = draft_vocab.top_tokens(np.bincount(written, minlength=VOCAB16.vocab), SUBSET)
    batch = random_models.prompts(seed, VOCAB16.vocab, 3)
    ref = ar.generate(batch)
    counters["outside"] += sum(t not in vocab for r in ref for t in r.output_ids)
    cure = _cure(VOCAB16, b_max=SUBSET - 1, topk=3)
    for method in ("chain", "ddtree", "cure"):
      gen = Generator(target, drafter, method=method, max_new_tokens=MAX_NEW, draft_vocab=vocab,
                      cure=None if method == "chain" else cure)
      for r, a in zip(gen.generate(batch), ref):
        assert r.output_ids == a.output_ids, (method, seed)
        counters["long_accepts"] += sum(n >= 2 for n in r.accept_lengths)
        counters["repair_wins"] += sum(s["winning_branch"] > 0 for s in r.stats)
  assert min(counters.values()) > 40, counters


def test_stop_tokens_end_each_sequence_like_target_greedy():
  arch = QWEN3
  target, drafter = random_models.pair(arch, 99)
  batch = random_models.prompts(99, arch.vocab, 4)
  ref = Generator(target, method="ar", max_new_tokens=MAX_NEW).generate(batch)
  stop = ref[0].output_ids[3]  # a token the target really emits
  ref = Generator(target, method="ar", max_new_tokens=MAX_NEW, stop_ids=(stop,)).generate(batch)
  assert ref[0].output_ids[-1] == stop and len(ref[0].output_ids) <= 4
  for method in ("chain", "cure", "ddtree", "hybrid"):
    gen = Generator(target, drafter, method=method, max_new_tokens=MAX_NEW, stop_ids=(stop,),
                    cure=_cure(arch) if method != "chain" else None)
    for r, a in zip(gen.generate(batch), ref):
      assert r.output_ids == a.output_ids


@pytest.mark.parametrize("method", ["ar", "chain", "cure", "ddtree", "hybrid"])
def test_batched_equals_one_by_one(method):
  """Batch 4, prompts of different lengths: each sequence's output equals its batch-1 output."""
  arch = QWEN3
  target, drafter = random_models.pair(arch, 7)
  batch = random_models.prompts(7, arch.vocab, 4, lo=2, hi=30)
  gen = Generator(target, drafter, method=method, max_new_tokens=MAX_NEW,
                  cure=_cure(arch) if method not in ("ar", "chain") else None)
  together = gen.generate(batch)
  for prompt, r in zip(batch, together):
    alone = gen.generate([prompt])[0]
    assert alone.output_ids == r.output_ids
    assert alone.accept_lengths == r.accept_lengths
