"""The target's layers through gpu_layer's kernels (Pallas interpret mode on CPU, as an NVIDIA GPU
runs them) against transformers on random models: the logits of a few new tokens after a cached
prompt."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.models import layer_kernels
from cure_jax.models.kernels import gpu_layer
from tests.test_qwen3_parity import TOL, prefill, random_hf_model

BATCH, LENGTH, PROMPT = 2, 84, 20
_SIZES = dict(intermediate_size=96, num_hidden_layers=2)   # over the parity tests' others
# heads of 32 (rope's halves of 16: Triton's least dot); per-head norms or none, GQA 2 and 4
CASES = {
    "qwen3_group2_untied": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=False)),
    "llama_group4_tied": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name, new, row_block",
                         [(name, new, gpu_layer.ROW_BLOCK) for name in CASES for new in (1, 20, 64)]
                         + [(name, 20, 16) for name in CASES])
def test_new_tokens_through_the_layer_kernels_match_transformers(name, new, row_block,
                                                                  monkeypatch, tmp_path):
  """BATCH x new rows (2, 40 and 128: partial blocks of 16 and 64 rows, a whole one of 128; and
  40 in blocks of 16, the last partial, as more rows than ROW_BLOCK go) through every layer's
  kernels, attending the cached prompt and each other causally: logits as transformers'."""
  monkeypatch.setattr(gpu_layer, "ROW_BLOCK", row_block)
  config_cls, model_cls, kwargs = CASES[name]
  hf_model = random_hf_model(config_cls, model_cls, **_SIZES, **kwargs)
  hf_model.save_pretrained(tmp_path)
  tokens = torch.randint(0, 97, (BATCH, LENGTH), generator=torch.Generator().manual_seed(3))
  with torch.no_grad():
    want = hf_model(tokens).logits.numpy()[:, PROMPT:PROMPT + new]
  model = load_target(tmp_path, jnp.float32, progress=False)
  _, _, cache = prefill(model, tokens.numpy()[:, :PROMPT])   # 40 rows: the XLA path

  traced = []

  def interpreted(gpu, other, *args):
    traced.append(args[0].shape)
    return gpu(*args, interpret=True)

  monkeypatch.setattr(layer_kernels, "on_gpu", interpreted)

  @functools.partial(jax.jit, static_argnames="graphdef")
  def block(graphdef, state, cache, ids):
    target = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(PROMPT + jnp.arange(new), (BATCH, new))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((new, new), bool)), (BATCH, new, new))
    mask = jnp.concatenate([jnp.broadcast_to(cache.visible()[:, None], (BATCH, new,
                                                                        cache.max_len)),
                            causal], axis=-1)
    return target.logits(target(ids, positions, cache, mask).hidden)

  got = block(*nnx.split(model), cache, jnp.asarray(tokens.numpy()[:, PROMPT:PROMPT + new]))
  assert traced == [(BATCH, new, model.cfg.hidden_size)] * model.cfg.num_layers
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=TOL)


def test_the_kernels_take_decoding_rows_only():
  """A layer goes through the kernels for up to 1,024 rows (CURE's re-drafts at batch 8, 640;
  chain at batch 32, 512), and heads whose rope halves Triton's dot takes; more rows (a prompt
  chunk) or an odd head keep XLA's path."""
  assert gpu_layer.takes(1024, 4096, 12288, 128) and gpu_layer.takes(1, 576, 1536, 64)
  assert not gpu_layer.takes(1025, 4096, 12288, 128)
  assert not gpu_layer.takes(1, 64, 96, 16)                 # halves of 8
  assert not gpu_layer.takes(1, 64, 96, 96)                 # halves of 48
  assert not gpu_layer.takes(1, 72, 96, 32)                 # hidden not in tiles of 16


@pytest.mark.parametrize("by_rows", [False, True])
@pytest.mark.parametrize("m, row_block", [(1, 256), (20, 256), (130, 256), (130, 32)])
def test_head_argmax_takes_the_first_largest_logit(m, row_block, by_rows, monkeypatch):
  """head_argmax (interpreted) against numpy's argmax of exact logits: zeros and ones make every
  float32 sum an exact count, so the many equal maxima must go to the first index, within a
  block of the vocabulary and across blocks (a block of columns repeated further on); also with
  the rows in blocks of 32, the last partial."""
  monkeypatch.setattr(gpu_layer, "ROW_BLOCK", row_block)
  rng = np.random.default_rng(m)
  k, v = 32, 512
  x = rng.integers(0, 2, (m, k)).astype(np.float32)
  w = rng.integers(0, 2, (k, v)).astype(np.float32)
  w[:, 256:320] = w[:, 0:64]                       # the same logits in a later block
  want = np.argmax(x.astype(np.int64) @ w.astype(np.int64), axis=1)
  head = jnp.asarray(w.T if by_rows else w)
  got = jax.jit(functools.partial(gpu_layer.head_argmax, by_rows=by_rows, interpret=True))(
      jnp.asarray(x), head)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_greedy_decoding_through_the_gpu_kernels_equals_the_xla_path(monkeypatch):
  """ar, chain, ddtree and cure with every target and drafter layer and the greedy head through
  the kernels (interpreted) emit the tokens of the XLA path's target-only decoding (float32)."""
  from cure_jax.analysis import random_models
  from cure_jax.runtime import generation
  from cure_jax.runtime.generation import Generator
  from cure_jax.tree import repair
  arch = random_models.Arch(vocab=64, hidden=64, heads=2, kv_heads=1, head_dim=32,
                            block_size=8, target_layer_ids=(0, 2))
  target, drafter = random_models.pair(arch, seed=5)
  batch = random_models.prompts(5, arch.vocab, 2)
  new = dict(max_new_tokens=12, max_len=64)
  want = Generator(target, method="ar", **new).generate(batch)
  traced = []

  def interpreted(gpu, other, *args):
    traced.append(args[0].shape)
    return gpu(*args, interpret=True)

  generation.release_compiled()
  jax.clear_caches()
  monkeypatch.setattr(layer_kernels, "on_gpu", interpreted)
  for gen in (Generator(target, method="ar", **new),
              Generator(target, drafter, method="chain", **new),
              Generator(target, drafter, method="ddtree", **new),
              Generator(target, drafter, method="cure", **new, cure=repair.RepairConfig(
                  tau_margin=1e9, v_max=12, max_depth=arch.block_size - 1))):
    for got, ref in zip(gen.generate(batch), want):
      assert got.output_ids == ref.output_ids, gen.method
  generation.release_compiled()
  jax.clear_caches()
  hidden = [s for s in traced if len(s) == 3 and s[-1] == arch.hidden]
  assert {s[1] for s in hidden} >= {1, arch.block_size}    # decoding steps and verification
  blocks = {s[1] for s in traced if len(s) == 4}           # the drafter's [B, A, K, H]
  assert 1 in blocks and max(blocks) > 1, traced          # the main block, cure's re-drafts


@pytest.mark.parametrize("reduced", [False, True])
def test_greedy_drafts_through_the_head_kernel_take_the_first_largest_logit(reduced, monkeypatch):
  """The drafter's greedy tokens with the head through head_argmax (interpreted), over the whole
  vocabulary or a reduced one (the id of the best of its entries), against numpy's argmax of
  exact logits: zeros and ones in the head and the hidden states make many maxima equal, and
  the first must win."""
  from cure_jax.analysis import random_models
  arch = random_models.Arch(vocab=64, hidden=64, heads=2, kv_heads=1, head_dim=32,
                            block_size=8, target_layer_ids=(0, 2))
  target, drafter = random_models.pair(arch, seed=3)
  rng = np.random.default_rng(int(reduced))
  w = rng.integers(0, 2, (arch.vocab, arch.hidden)).astype(np.float32)         # rows [V, H]
  if target.cfg.tie_embeddings:
    target.embed_tokens.embedding[...] = jnp.asarray(w)
  else:
    target.lm_head.kernel[...] = jnp.asarray(w.T)
  x = rng.integers(0, 2, (2, 5, arch.hidden)).astype(np.float32)
  ids = (np.sort(rng.choice(arch.vocab, 32, replace=False)) if reduced
         else np.arange(arch.vocab))
  want = ids[np.argmax(x.astype(np.int64) @ w[ids].T.astype(np.int64), axis=-1)]
  kernels = []

  def interpreted(gpu, other, *args):
    kernels.append(args[-1].shape)
    return gpu(*args, interpret=True)

  monkeypatch.setattr(layer_kernels, "on_gpu", interpreted)
  vocab = tuple(int(i) for i in ids) if reduced else ()
  got = drafter.draft_argmax(jnp.asarray(x), target, vocab)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert kernels and len(ids) in kernels[0]            # the head kernel read len(ids) entries
