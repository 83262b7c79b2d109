"""The reduced draft vocabulary: which tokens, read from which file, and the drafter's logits
over them (the N head rows, -inf elsewhere) against plain numpy. Losslessness with a reduced
vocabulary is in test_lossless.py and test_sampling.py."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cure_jax.analysis import random_models
from cure_jax.methods import block
from cure_jax.runtime import cost_curve, decoding, draft_vocab
from cure_jax.runtime.generation import Generator
from cure_jax.tree import best_first, repair, sampling

ROOT = Path(__file__).resolve().parents[1]
ARCH = random_models.Arch(vocab=16)


def test_top_tokens_match_a_plain_sort():
  rng = np.random.default_rng(0)
  counts = rng.integers(0, 6, 50)                              # many ties
  for n in (1, 7, 20, 50):
    ranked = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    assert draft_vocab.top_tokens(counts, n) == tuple(sorted(ranked[:n]))


def test_count_tokens_counts_responses_only(tmp_path):
  """Two sequences: prompt [5] then response [1, 2, 2]; prompt [3, 3] then response [0]."""
  path = tmp_path / "responses.npz"
  np.savez(path, tokens=np.array([5, 1, 2, 2, 3, 3, 0], np.int32),
           lengths=np.array([4, 3]), prompt_lens=np.array([1, 2], np.int32))
  assert draft_vocab.count_tokens(str(path), 6).tolist() == [1, 1, 2, 0, 0, 0]
  with pytest.raises(ValueError, match="outside the target vocabulary .*this target"):
    draft_vocab.count_tokens(str(path), 2)


def test_the_embedded_counts_are_the_drafters_training_responses():
  """token_counts.npz beside the embedded drafter, recounted here from each token's place in
  its sequence (a response token sits at or past its sequence's prompt length)."""
  data = np.load(ROOT / "data/drafter_responses/smollm2_v2.npz")
  tokens, lengths, prompt_lens = data["tokens"], data["lengths"], data["prompt_lens"]
  sequence = np.repeat(np.arange(len(lengths)), lengths)                   # [T]
  place = np.arange(len(tokens)) - (np.cumsum(lengths) - lengths)[sequence]
  want = np.bincount(tokens[place >= prompt_lens[sequence]], minlength=49152)
  counts = np.load(ROOT / "cure_jax/assets/smollm2_dflash" / draft_vocab.COUNTS_FILE)["counts"]
  assert counts.dtype == np.int32 and counts.shape == (49152,)
  np.testing.assert_array_equal(counts, want)


def test_load_reads_what_write_counts_wrote(tmp_path):
  path = str(tmp_path / "counts.npz")
  draft_vocab.write_counts(path, [0, 9, 3, 9, 1])
  assert draft_vocab.load(path, 3, 5) == (1, 2, 3)
  assert draft_vocab.load(path, 0, 5) == ()
  assert draft_vocab.load(str(tmp_path / "never_read.npz"), 0, 5) == ()


def test_load_errors_name_the_fix(tmp_path):
  path = str(tmp_path / "counts.npz")
  with pytest.raises(FileNotFoundError, match="no token counts at .*--stage=counts"):
    draft_vocab.load(path, 3, 5)
  draft_vocab.write_counts(path, [1, 2, 3, 4])
  with pytest.raises(ValueError, match=r"shape \(4,\), but the target has 5 tokens; count"):
    draft_vocab.load(path, 3, 5)
  with pytest.raises(ValueError, match="drafter.vocab=1 is too small.*use drafter.vocab >= 2"):
    draft_vocab.load(path, 1, 4)
  for n in (-1, 5):
    with pytest.raises(ValueError, match=f"drafter.vocab={n} must lie in 0..4"):
      draft_vocab.load(path, n, 4)


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_logits_rows_are_those_rows_of_the_head(tie):
  target, _ = random_models.pair(dataclasses.replace(ARCH, tie=tie), 0)
  w = np.asarray(target.embed_tokens.embedding[...] if tie else target.lm_head.kernel[...].T)
  hidden = np.random.default_rng(1).standard_normal((2, 3, ARCH.hidden)).astype(np.float32)
  ids = np.array([0, 3, 4, 11])
  got = target.logits_rows(jnp.asarray(hidden), ids)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, hidden @ w[ids].T, rtol=1e-5, atol=1e-5)


def test_draft_logits_keep_the_subset_and_give_the_rest_minus_inf():
  """With a multiplier and a soft cap, applied before the scatter."""
  target, drafter = random_models.pair(ARCH, 0)
  drafter.cfg = dataclasses.replace(drafter.cfg, output_multiplier=0.5, logit_softcap=4.0)
  hidden = np.random.default_rng(2).standard_normal((2, 5, ARCH.hidden)).astype(np.float32)
  vocab = (1, 2, 6, 9, 15)
  got = np.asarray(drafter.draft_logits(jnp.asarray(hidden), target, vocab))   # [2, 5, V]
  head = np.asarray(target.lm_head.kernel[...])                                 # [H, V]
  full = np.tanh(hidden @ head * 0.5 / 4.0) * 4.0
  np.testing.assert_allclose(got[..., vocab], full[..., vocab], rtol=1e-5, atol=1e-5)
  rest = np.setdiff1d(np.arange(ARCH.vocab), vocab)
  assert np.all(got[..., rest] == -np.inf)
  np.testing.assert_allclose(drafter.draft_logits(jnp.asarray(hidden), target), full, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_held_head_rows_give_the_same_draft_logits(tie):
  """hold_head_rows (decoding.decode, once before its loop) against a gather per call; held rows
  of another vocabulary are not used."""
  target, drafter = random_models.pair(dataclasses.replace(ARCH, tie=tie), 0)
  hidden = jnp.asarray(np.random.default_rng(4).standard_normal((2, 5, ARCH.hidden)), jnp.float32)
  vocab = (0, 4, 5, 12)
  want = np.asarray(drafter.draft_logits(hidden, target, vocab))
  drafter.hold_head_rows(target, vocab)
  np.testing.assert_array_equal(drafter.draft_logits(hidden, target, vocab), want)
  other = (1, 2, 3)
  np.testing.assert_allclose(drafter.draft_logits(hidden, target, other)[..., other],
                             target.logits(hidden)[..., other], rtol=1e-5, atol=1e-5)


def test_minus_inf_makes_no_nan_downstream():
  """Margins, the gate's alternatives, log q and the sampling warp over logits that are -inf
  outside a 3-token subset: finite where they should be, never NaN, nothing outside chosen."""
  rng = np.random.default_rng(3)
  vocab = np.array([2, 5, 7])
  logits = np.full((2, 4, 10), -np.inf, np.float32)
  logits[..., vocab] = rng.standard_normal((2, 4, 3))
  logits = jnp.asarray(logits)
  assert np.all(np.isfinite(repair.margins(logits)))
  draft = jnp.argmax(logits, -1).astype(jnp.int32)
  cfg = repair.RepairConfig(tau_margin=1e9, b_max=2, max_depth=4)
  gate, alts = repair.select(logits, draft, jnp.full((2,), 4, jnp.int32), cfg)
  assert np.all(np.isfinite(gate.margins)) and np.all(np.isin(alts, vocab))
  logq = jax.nn.log_softmax(logits, -1)
  assert not np.any(np.isnan(logq)) and np.all(np.isfinite(logq[..., vocab]))
  q = sampling.warp(logits, sampling.Sampling(0.7, top_k=2, top_p=0.9))
  assert not np.any(np.isnan(q)) and np.all(np.delete(np.asarray(q), vocab, -1) == 0)
  np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-6)


def test_a_vocabulary_smaller_than_the_tree_settings_is_rejected():
  target, drafter = random_models.pair(ARCH, 0)
  with pytest.raises(ValueError, match="cure.topk=4 alternatives .*drafter.vocab=4: raise it"):
    Generator(target, drafter, method="ddtree", max_new_tokens=4, draft_vocab=(0, 1, 2, 3),
              cure=repair.RepairConfig(b_max=3, topk=4, max_depth=5))
  with pytest.raises(ValueError, match="cure.b_max=5 alternatives .*drafter.vocab=3: raise it"):
    Generator(target, drafter, method="cure", max_new_tokens=4, draft_vocab=(0, 1, 2),
              cure=repair.RepairConfig(b_max=5, max_depth=5))
  with pytest.raises(ValueError, match="distinct ascending ids in 0..15"):
    Generator(target, drafter, method="chain", max_new_tokens=4, draft_vocab=(3, 1))
  with pytest.raises(ValueError, match="drafter.vocab=1 is too small"):
    Generator(target, drafter, method="chain", max_new_tokens=4, draft_vocab=(3,))


def test_the_timed_drafter_pass_drafts_what_the_loop_drafts():
  """cost_curve's drafter pass takes the head rows gathered beforehand (decoding.models, as
  decoding.decode's loop does, so C_d excludes the gather): the same proposal as a pass that
  gathers them."""
  target, drafter = random_models.pair(ARCH, 0)
  gen = Generator(target, drafter, method="chain", max_new_tokens=4, draft_vocab=(0, 3, 5, 9))
  spec = gen.spec(gen.cache_len(8))
  st = cost_curve._start(gen.graphdef, gen.params, spec, 2)
  held = cost_curve.proposal_of(gen.graphdef, gen.params, spec, 2)
  t, d = nnx.merge(gen.graphdef, gen.params)
  # The jitted pass and this eager one sum in different orders. Reordering a float32 sum of n
  # terms moves it by up to n * eps of the sum of magnitudes, about sqrt(n) times the result for
  # random weights; n <= 2 * hidden (the MLP's down projection), compounded over the target
  # layers that make the context features and the drafter's layers. Probabilities are <= 1, so
  # the same figure bounds their absolute error. Integer leaves (tokens, tree) are exact.
  n = 2 * ARCH.hidden
  tol = (ARCH.layers + ARCH.draft_layers) * n * np.sqrt(n) * np.finfo(np.float32).eps
  def same(a, b):
    if jnp.issubdtype(a.dtype, jnp.floating):
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    else:
      np.testing.assert_array_equal(a, b)
  jax.tree.map(same, held, decoding.propose(t, d, spec, st)[0])
  assert cost_curve.draft_seconds(gen.graphdef, gen.params, spec, 2) > 0


def test_ddtree_from_the_compact_logits_is_the_tree_of_the_whole_vocabulary():
  """ddtree ranks the draft vocabulary's N logits alone and maps positions back to tokens: the
  same tree, tokens and path log-probabilities as jax.lax.top_k over the [.., V] logits with
  -inf outside the vocabulary (DFlash.draft_logits)."""
  target, drafter = random_models.pair(ARCH, 3)
  vocab = (1, 4, 5, 8, 11, 14)
  cure = repair.RepairConfig(v_max=12, topk=3, max_depth=ARCH.block_size - 1)
  gen = Generator(target, drafter, method="ddtree", max_new_tokens=4, draft_vocab=vocab,
                  cure=cure)
  spec = gen.spec(gen.cache_len(8))
  st = cost_curve._start(gen.graphdef, gen.params, spec, 2)
  t, d = nnx.merge(gen.graphdef, gen.params)
  got = decoding.propose(t, d, spec, st)[0]
  limit = decoding.depth_limit(spec, st.cache.lengths, st.produced)
  logits = block.main_logits(t, d, st.dcache, spec, st.anchor, st.cache.lengths, limit)
  assert np.all(np.isneginf(np.asarray(logits)[..., np.setdiff1d(np.arange(ARCH.vocab), vocab)]))
  logq = jax.nn.log_softmax(logits, axis=-1)
  logp, tokens = jax.lax.top_k(logq, 3)
  want = best_first.ddtree(st.anchor, tokens, logp, limit, v_max=12)
  np.testing.assert_array_equal(got.tree.tokens, want.tokens)
  np.testing.assert_array_equal(got.tree.parent, want.parent)
  rows = jnp.arange(2)[:, None]
  own = logq[rows, jnp.maximum(want.depth - 1, 0), want.tokens]
  np.testing.assert_allclose(got.path_logp, best_first.cumulative(want, own), rtol=1e-6,
                             atol=1e-6)
