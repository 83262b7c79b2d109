"""Our Qwen3/Llama decoder, loaded through cure_jax.checkpoints.qwen3, against transformers on random models."""

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from cure_jax.checkpoints.qwen3 import load_target

BATCH, LENGTH, PREFILL, CACHE = 2, 33, 20, 40
TOL = 1e-4

_COMMON = dict(vocab_size=97, intermediate_size=80, num_hidden_layers=3, rms_norm_eps=1e-6,
               initializer_range=0.08, max_position_embeddings=128)
# name -> (HF classes, config kwargs): GQA groups 1, 2 and 4, tied and untied heads, head_dim
# both equal to and different from hidden/heads, default and llama3 rotary scaling.
CASES = {
    "qwen3_group1_untied": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        tie_word_embeddings=False)),
    "qwen3_group2_tied": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=True)),
    "qwen3_group4_untied": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
        tie_word_embeddings=False)),
    "llama_group2_tied": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_group4_llama3_rope": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        tie_word_embeddings=False,
        # original_max_position_embeddings small enough that all three frequency bands occur.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Qwen3's long-context setting at toy scale: LENGTH runs 4x past the original window.
    "qwen3_group2_yarn": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})),
    "llama_group2_linear_rope": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 3.0})),
}


def random_hf_model(config_cls, model_cls, seed: int = 0, **kwargs):
  """A random float32 HF model whose norm weights are far from the all-ones initialisation."""
  torch.manual_seed(seed)
  model = model_cls(config_cls(**{**_COMMON, **kwargs})).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "norm" in name:
        param.add_(0.3 * torch.randn_like(param))
  return model


# Test-only: XLA's CPU backend optimisations off compile these tiny graphs ~8x faster, and jitting
# whole steps avoids compiling every eager op; the arithmetic is the same.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


@functools.partial(_jit, static_argnames=("graphdef", "feature_layers"))
def _prefill(graphdef, state, tokens, feature_layers):
  model = nnx.merge(graphdef, state)
  b, t = tokens.shape
  cache = model.init_cache(b, CACHE)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.concatenate([jnp.zeros((b, t, CACHE), bool),
                          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))], axis=-1)
  out = model(tokens, positions, cache, mask, feature_layers)
  return model.logits(out.hidden), out.features, cache.append(out.k, out.v, jnp.full((b,), t))


def prefill(model, tokens, feature_layers=()):
  """Causal forward of tokens [B, T] from an empty cache: (logits [B, T, V], features, the cache
  with all T tokens committed)."""
  return _prefill(*nnx.split(model), tokens, feature_layers)


@functools.partial(_jit, static_argnames="graphdef")
def _decode_step(graphdef, state, cache, token, position):
  model = nnx.merge(graphdef, state)
  b = token.shape[0]
  mask = jnp.concatenate([cache.visible()[:, None, :], jnp.ones((b, 1, 1), bool)], axis=-1)
  out = model(token[:, None], jnp.full((b, 1), position), cache, mask)
  return model.logits(out.hidden)[:, 0], cache.append(out.k, out.v, jnp.ones((b,), jnp.int32))


def decode_step(model, cache, token, position):
  """One token [B] at `position`, attending to the committed slots and itself: (logits [B, V],
  the cache with the token committed)."""
  return _decode_step(*nnx.split(model), cache, token, position)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
  config_cls, model_cls, kwargs = CASES[request.param]
  hf_model = random_hf_model(config_cls, model_cls, **kwargs)
  hf_dir = tmp_path_factory.mktemp(request.param)
  hf_model.save_pretrained(hf_dir)
  tokens = torch.randint(0, hf_model.config.vocab_size, (BATCH, LENGTH),
                         generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    ref = hf_model(tokens, output_hidden_states=True)
  return types.SimpleNamespace(
      name=request.param, hf_dir=hf_dir, tokens=tokens.numpy(), logits=ref.logits.numpy(),
      hidden_states=[h.numpy() for h in ref.hidden_states],
      model=load_target(hf_dir, jnp.float32, progress=False))


def test_logits_and_features_match_transformers(case):
  feature_layers = (0, 1, case.model.cfg.num_layers)
  logits, features, _ = prefill(case.model, case.tokens, feature_layers)
  chex.assert_trees_all_close(np.asarray(logits), case.logits, rtol=0, atol=TOL)
  expected = np.concatenate([case.hidden_states[i] for i in feature_layers], axis=-1)
  chex.assert_trees_all_close(np.asarray(features), expected, rtol=0, atol=TOL)


def test_incremental_decoding_through_cache(case):
  """Prefill and commit, then one token at a time over the committed slots plus itself."""
  prefill_logits, _, cache = prefill(case.model, case.tokens[:, :PREFILL])
  logits = [np.asarray(prefill_logits)]
  for t in range(PREFILL, LENGTH):
    step_logits, cache = decode_step(case.model, cache, case.tokens[:, t], t)
    logits.append(np.asarray(step_logits)[:, None])
  np.testing.assert_array_equal(cache.lengths, LENGTH)
  chex.assert_trees_all_close(np.concatenate(logits, axis=1), case.logits, rtol=0, atol=TOL)


@pytest.mark.parametrize("chunk", [4, 11, 16])
def test_chunked_prefill_matches_transformers(case, chunk):
  """decoding.prefill_chunks with rows of different lengths (a whole number of chunks, one
  under, one over): each row's last logits and its committed keys/values equal transformers'
  (and the single-pass prefill's)."""
  from cure_jax.methods.base import Spec
  from cure_jax.runtime import decoding
  lengths = np.array([LENGTH, 2 * chunk - 1, chunk + 1][:BATCH], np.int32)
  spec = Spec(method="ar", max_new_tokens=1, max_len=CACHE, prefill_chunk=chunk)
  graphdef, state = nnx.split(case.model)

  @_jit
  def run(state, tokens, lengths):
    cache, _, last = decoding.prefill_chunks(nnx.merge(graphdef, state), None, spec, tokens,
                                             lengths)
    return nnx.merge(graphdef, state).logits(last), cache

  logits, cache = run(state, case.tokens, lengths)
  np.testing.assert_array_equal(cache.lengths, lengths)
  _, _, single = prefill(case.model, case.tokens)
  hf_model = random_hf_model(*CASES[case.name][:2], **CASES[case.name][2])
  for row, n in enumerate(lengths):
    with torch.no_grad():
      ref = hf_model(torch.tensor(case.tokens[row:row + 1, :n]), use_cache=True)
    chex.assert_trees_all_close(np.asarray(logits[row]), ref.logits[0, -1].numpy(), rtol=0,
                                atol=TOL)
    for i, layer in enumerate(ref.past_key_values.layers):
      for ours, theirs, one in ((cache.k[i], layer.keys, single.k[i]),
                                (cache.v[i], layer.values, single.v[i])):
        chex.assert_trees_all_close(np.asarray(ours[row, :, :n]), theirs[0].numpy(), rtol=0,
                                    atol=TOL)
        chex.assert_trees_all_close(np.asarray(ours[row, :, :n]), np.asarray(one[row, :, :n]),
                                    rtol=0, atol=TOL)


def test_bfloat16_load_is_close_to_float32(case):
  model = load_target(case.hf_dir, jnp.bfloat16, progress=False)
  assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
  logits = np.asarray(prefill(model, case.tokens)[0])
  scale = np.abs(case.logits).max()
  chex.assert_trees_all_close(logits, case.logits, rtol=0, atol=0.05 * scale)


def test_greedy_generation_matches_transformers_generate(case):
  """32 greedy tokens from our compiled AR loop equal `generate` (ties broken alike by argmax)."""
  from cure_jax.runtime.generation import Generator
  hf_model = random_hf_model(*CASES[case.name][:2], **CASES[case.name][2])
  prompt = case.tokens[0, :12].tolist()
  with torch.no_grad():
    ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
  ours = Generator(case.model, method="ar", max_new_tokens=32).generate([prompt])[0]
  assert ours.output_ids == ref[0, len(prompt):].tolist()
