"""Every dtype the config accepts decodes with every registered method, at batch 1 and 4, on the
platform the tests run on (CPU), along `experiments.decode`'s path: checkpoints on disk, loaded
in the config's dtype, a Generator made from the config.

XLA:CPU cannot execute some bfloat16 x bfloat16 -> float32 dots (at batch > 1, the attention
value product among them: "Unsupported element type for DotThunk::Execute"); layers.einsum_f32
upcasts such operands on CPU. Float32 greedy decoding is lossless, so there every method must
equal target-only decoding token for token. In bfloat16 no method is held to bfloat16
target-only decoding: a verification forward sums in another order than a one-token step, and a
near-tie can go either way (this pair has one, 0.015 apart in float32, that bfloat16 decides the
other way). What any correct greedy decoder satisfies: it emits c = argmax L, L the target's
logits as its bfloat16 program computes them, so the exact (float32) logits L32 given the same
tokens before it have L32[c] >= max L32 - 2 max|L - L32|. max|L - L32| is taken from a
teacher-forced bfloat16 forward over the same sequence (the same rounding, summed in another
order) against a float32 one; a wrong token (a stale cache row, an unverified draft) is rarely
that close. Vocabulary 8: the random drafters are right often enough that drafts are accepted.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from cure_jax import methods
from cure_jax.analysis import random_models
from cure_jax.checkpoints import qwen3 as qwen3_ckpt, store
from cure_jax.runtime import pipeline

ARCH = random_models.Arch(vocab=8, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                          draft_layers=1, block_size=4, target_layer_ids=(0, 1))
SEED, MAX_NEW, MAX_LEN = 1, 8, 24
PROMPTS = random_models.prompts(SEED, ARCH.vocab, 4, lo=3, hi=12)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """HF directories of a random target, its DFlash drafter and a one-layer AR drafter."""
  root = tmp_path_factory.mktemp("pair")
  target, drafter = random_models.pair(ARCH, SEED)
  target_dir, drafter_dir = random_models.write_hf(root, target, drafter)
  ar = random_models.ar_drafter(ARCH, SEED)
  ar_config = random_models.hf_configs(ar.cfg, drafter.cfg)[0]
  ar_dir = store.export_hf(nnx.state(ar), root / "ar_drafter", qwen3_ckpt.hf_name, ar_config)
  return dict(target=str(target_dir), block=str(drafter_dir), autoregressive=str(ar_dir))


def _config(dirs, dtype: str, method: str):
  config = common.base_config()
  config.method = method
  config.dtype = dtype
  config.target.path = dirs["target"]
  kind = methods.get(method).drafter_kind
  config.drafter.path = dirs[kind] if kind else ""
  config.drafter.gamma = 3
  config.max_new_tokens = MAX_NEW
  config.max_len = MAX_LEN          # one compiled prefill for every prompt length
  config.cure.update(tau_margin=1e9, v_max=12, topk=2, beam_width=3)   # a repair every block
  # fixed costs (not timed here) under which auto drafts: plain steps or whole trees
  config.auto.update(budgets="1,12", costs="1.0,1.05", explore_every=3)
  return config


def decode(dirs, dtype: str, method: str, batch: int):
  """Output ids of PROMPTS decoded `batch` at a time (one compiled program), and the draft
  tokens accepted in all."""
  config = _config(dirs, dtype, method)
  target = pipeline.load_target(config)
  drafter = pipeline.load_drafter(config, target)
  gen = pipeline.make_generator(config, target, drafter)
  results = pipeline.decode_all(gen, PROMPTS, batch)
  return ([r.output_ids for r in results],
          sum(n - 1 for r in results for n in r.accept_lengths))   # accepted draft tokens


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits(graphdef, state, tokens):
  """Teacher-forced logits [B, T, V] of sequences tokens [B, T]."""
  model = nnx.merge(graphdef, state)
  b, t = tokens.shape
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  out = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), model.init_cache(b, 0), causal)
  return model.logits(out.hidden)


def logits(dirs, dtype: str, sequences) -> np.ndarray:
  """Float32 copies of the target's logits [N, MAX_LEN, V] in `dtype` over the sequences,
  right-padded to MAX_LEN (causal: the padding changes no row before it), in one call."""
  tokens = np.zeros((len(sequences), MAX_LEN), np.int32)
  for i, s in enumerate(sequences):
    tokens[i, :len(s)] = s
  model = pipeline.load_target(_config(dirs, dtype, "ar"))
  return np.asarray(_logits(*nnx.split(model), jnp.asarray(tokens)), np.float32)


def _every_method(dirs, dtype, batch):
  """Each method's outputs on PROMPTS (checked for shape and range), and that drafts were
  accepted by every drafting method."""
  outputs, accepted = {}, {}
  for method in methods.names():
    outputs[method], accepted[method] = decode(dirs, dtype, method, batch)
    assert len(outputs[method]) == len(PROMPTS), method
    for ids in outputs[method]:
      assert len(ids) == MAX_NEW and all(0 <= t < ARCH.vocab for t in ids), (method, ids)
  assert min(n for m, n in accepted.items() if m != "ar") > 0, accepted
  return outputs


@pytest.mark.parametrize("batch", [1, 4])
def test_float32_every_method_equals_target_only(dirs, batch):
  outputs = _every_method(dirs, "float32", batch)
  for method in methods.names():
    assert outputs[method] == outputs["ar"], method


@pytest.mark.parametrize("batch", [1, 4])
def test_bfloat16_every_method_emits_near_argmax_tokens(dirs, batch):
  outputs = _every_method(dirs, "bfloat16", batch)
  runs = [(m, p, ids) for m, out in outputs.items() for p, ids in zip(PROMPTS, out)]
  sequences = [p + ids for _, p, ids in runs]
  exact, rounded = logits(dirs, "float32", sequences), logits(dirs, "bfloat16", sequences)
  for (method, prompt, ids), f32, bf16 in zip(runs, exact, rounded):
    rows = np.arange(len(prompt) - 1, len(prompt) - 1 + MAX_NEW)   # the rows that chose `ids`
    error = np.abs(bf16[rows] - f32[rows]).max()
    gap = f32[rows].max(-1) - f32[rows, ids]
    assert gap.max() <= 2 * error, (method, prompt, ids, gap, error)


def test_the_config_dtypes_are_those_tested():
  assert set(pipeline.DTYPES) == {"float32", "bfloat16"}, "a new dtype needs its tests here"
