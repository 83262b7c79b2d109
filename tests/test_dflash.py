"""Our DFlash drafter, its loader and the chain loop against the public `dflash` wheel.

Random tiny target/drafter pairs come from tests/dflash_reference.py. The wheel's
`DFlashDraftModel.forward` is the reference for block logits, its `dflash_generate` for the
greedy chain loop (output ids and acceptance lengths, exactly).
"""

import functools
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel
from flax import nnx
from safetensors.torch import load_file, save_file

from cure_jax.checkpoints import store
from cure_jax.checkpoints.dflash import export_hf, load_drafter
from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.models import layer_kernels
from cure_jax.runtime.generation import Generator
from tests.dflash_reference import (PairSpec, add_model_prefix, build_pair, reference_block_logits,
                                    reference_features, reference_generate)

TOL = 1e-4
CACHE = 64
ROOT = Path(__file__).resolve().parents[1]

# Parity pairs: GQA groups 2 and 4, head_dim equal to and different from hidden/heads, block
# sizes 4 and 8, feature layers including the target's last (hidden_states[L], the normed output).
PARITY = {
    "gqa2_b4": PairSpec(vocab_size=96, hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=12,
                        target_layers=4, draft_layers=2, target_layer_ids=(1, 3), block_size=4),
    "gqa4_b8": PairSpec(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=1, head_dim=16,
                        target_layers=6, draft_layers=3, target_layer_ids=(0, 2, 5),
                        block_size=8, draft_rope_theta=1e6, seed=1),
}
# Chain pairs, with max_new_tokens and stop ids: an 8-token vocabulary (and, for the second,
# hidden states leaning one way) so that drafts do get accepted; seeds picked so that acceptance
# lengths vary. No budget is a multiple of the block size, so the last block is shortened. The
# stop id ends two prompts at their first token, one in the middle of a 2-token step, and never
# occurs in the fourth.
_V8_B4_LEAN = PairSpec(vocab_size=8, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8,
                       target_layers=5, draft_layers=1, target_layer_ids=(0, 4), block_size=4,
                       shared_embedding=1.0, seed=1)
CHAIN = {
    "v8_b8": (PairSpec(vocab_size=8, target_layer_ids=(1, 3), block_size=8, seed=1), 30, None),
    "v8_b4_lean": (_V8_B4_LEAN, 23, None),
    "v8_b4_lean_stop": (_V8_B4_LEAN, 23, [7]),
}
PROMPT_LENGTHS = (5, 9, 14, 20)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
  """The reference models are tiny: torch's thread pool only adds contention on a busy CPU."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@functools.partial(nnx.jit, static_argnums=2)
def causal_forward(target, ids, feature_layers):
  """Our target over whole sequences ids [B, T] from an empty cache."""
  b, t = ids.shape
  mask = jnp.concatenate([jnp.zeros((b, t, CACHE), bool),
                          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))], axis=-1)
  return target(ids, jnp.broadcast_to(jnp.arange(t), (b, t)), target.init_cache(b, CACHE), mask,
                feature_layers)


def load_pair(pair):
  target = load_target(pair.target_dir, jnp.float32, progress=False)
  drafter = load_drafter(pair.drafter_dir, jnp.float32, progress=False, target_cfg=target.cfg)
  return target, drafter


def flat_params(module) -> dict:
  """{state path: array} of a module's parameters, for bit-exact comparisons."""
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def assert_same_params(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for path in a:
    assert a[path].dtype == b[path].dtype and np.array_equal(a[path], b[path]), path


@pytest.fixture(scope="module", params=list(PARITY))
def parity(request, tmp_path_factory):
  pair = build_pair(PARITY[request.param], tmp_path_factory.mktemp(request.param))
  target, drafter = load_pair(pair)
  return types.SimpleNamespace(pair=pair, target=target, drafter=drafter)


def test_features_use_hidden_states_index_plus_one(parity):
  """target_layer_ids[i] selects hidden_states[id + 1] (index 0 is the embedding output)."""
  cfg = parity.drafter.cfg
  assert cfg.feature_layers == tuple(i + 1 for i in cfg.target_layer_ids)
  ids = torch.randint(0, parity.pair.spec.vocab_size, (2, 13),
                      generator=torch.Generator().manual_seed(2))
  expected = reference_features(parity.pair, ids).numpy()
  ours = causal_forward(parity.target, jnp.asarray(ids.numpy()), cfg.feature_layers).features
  chex.assert_trees_all_close(np.asarray(ours), expected, rtol=0, atol=TOL)
  unshifted = causal_forward(parity.target, jnp.asarray(ids.numpy()), cfg.target_layer_ids)
  assert np.abs(np.asarray(unshifted.features) - expected).max() > 100 * TOL


@functools.partial(nnx.jit, static_argnums=(5, 6))
def our_block_logits(target, drafter, feats, lengths, anchors, verify_size, kernels=False):
  """Draft logits [B, verify_size-1, V] after context features feats [B, T, n*H] (valid up to
  lengths [B]), appended to the drafter cache in two chunks (4 tokens, then the rest), for the
  blocks [anchor, mask...]; kernels: the drafter's layers through gpu_layer's kernels."""
  b, t, _ = feats.shape
  k = drafter.cfg.block_size
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  cache = drafter.init_cache(b, CACHE)
  for start, stop in ((0, 4), (4, t)):
    ctx_k, ctx_v = drafter.context_kv(feats[:, start:stop], positions[:, start:stop])
    cache = cache.append(ctx_k, ctx_v, jnp.clip(lengths - start, 0, stop - start))
  block = jnp.full((b, 1, k), drafter.cfg.mask_token_id).at[:, 0, 0].set(anchors)  # [B, 1, K]
  hidden = drafter(target.embed(block), lengths[:, None] + jnp.arange(k)[None], cache,
                   jnp.full((b,), verify_size), kernels=kernels)
  return drafter.draft_logits(hidden[:, 0, 1:verify_size], target)


def _reference_and_ours(pair, target, drafter, verify_size, kernels=False):
  """The wheel's draft logits and ours for two contexts of different lengths."""
  lengths, anchors = (11, 7), (5, 17)
  gen = torch.Generator().manual_seed(3)
  features = [reference_features(pair, torch.randint(0, pair.spec.vocab_size, (1, t),
                                                     generator=gen)) for t in lengths]
  expected = np.stack([reference_block_logits(pair, f, a, verify_size)[0].numpy()
                       for f, a in zip(features, anchors)])                # [B, vs-1, V]

  feats = np.zeros((len(lengths), max(lengths), features[0].shape[-1]), np.float32)
  for i, f in enumerate(features):
    feats[i, :lengths[i]] = f[0].numpy()
  logits = our_block_logits(target, drafter, jnp.asarray(feats), jnp.asarray(lengths),
                            jnp.asarray(anchors), verify_size, kernels)
  return expected, np.asarray(logits)


@pytest.mark.parametrize("short_block", [False, True])
def test_block_logits_match_reference(parity, short_block):
  """Two contexts of different lengths, appended to our cache in two chunks; with short_block
  the block is cut to 2 tokens, as near the end of generation (the reference's verify_size)."""
  verify_size = 2 if short_block else parity.pair.spec.block_size
  expected, logits = _reference_and_ours(parity.pair, parity.target, parity.drafter, verify_size)
  chex.assert_trees_all_close(logits, expected, rtol=0, atol=TOL)


def test_block_logits_through_the_gpu_kernels_match_reference(tmp_path, monkeypatch):
  """Every drafter layer through gpu_layer's kernels (Pallas interpret mode, as an NVIDIA GPU
  runs them; heads of 32, GQA 2) gives the wheel's draft logits."""
  pair = build_pair(PairSpec(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2,
                             head_dim=32, target_layers=3, draft_layers=2,
                             target_layer_ids=(0, 2), block_size=8, seed=2), tmp_path)
  target, drafter = load_pair(pair)
  traced = []

  def interpreted(gpu, other, *args):
    traced.append(args[0].shape)
    return gpu(*args, interpret=True)

  monkeypatch.setattr(layer_kernels, "on_gpu", interpreted)
  expected, logits = _reference_and_ours(pair, target, drafter, 8, kernels=True)
  assert traced == [(2, 1, 8, 64)] * 2                     # both layers, the block's 16 rows
  chex.assert_trees_all_close(logits, expected, rtol=0, atol=TOL)


@pytest.fixture(scope="module", params=list(CHAIN))
def chain(request, tmp_path_factory):
  spec, max_new_tokens, stop_ids = CHAIN[request.param]
  pair = build_pair(spec, tmp_path_factory.mktemp(request.param))
  target, drafter = load_pair(pair)
  gen = torch.Generator().manual_seed(4)
  prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()
             for n in PROMPT_LENGTHS]
  return types.SimpleNamespace(pair=pair, target=target, drafter=drafter, prompts=prompts,
                               max_new_tokens=max_new_tokens, stop_ids=stop_ids)


def test_chain_matches_reference_generate(chain):
  """Greedy chain decoding of a batch equals the wheel's dflash_generate run prompt by prompt."""
  generator = Generator(chain.target, chain.drafter, method="chain",
                        max_new_tokens=chain.max_new_tokens, stop_ids=chain.stop_ids or ())
  results = generator.generate(chain.prompts)
  lengths = []
  for prompt, result in zip(chain.prompts, results):
    ids, accept_lengths = reference_generate(chain.pair, prompt, chain.max_new_tokens,
                                             chain.stop_ids)
    assert result.output_ids == ids
    assert result.accept_lengths == accept_lengths
    lengths += accept_lengths
  if not chain.stop_ids:  # the stop case ends too early to accept much
    assert sum(n >= 2 for n in lengths) >= 3, f"too few accepted drafts to test: {lengths}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return build_pair(PARITY["gqa2_b4"], tmp_path_factory.mktemp("saved"))


def test_loads_with_and_without_model_prefix(saved, tmp_path):
  prefixed = tmp_path / "prefixed"
  shutil.copytree(saved.drafter_dir, prefixed)
  add_model_prefix(prefixed)
  assert all(n.startswith("model.") for n in store.tensor_names(prefixed))
  plain = flat_params(load_drafter(saved.drafter_dir, jnp.float32, progress=False))
  assert_same_params(plain, flat_params(load_drafter(prefixed, jnp.float32, progress=False)))
  reference = saved.drafter.state_dict()
  for path, value in plain.items():
    weight = reference[store.hf_name(path)].numpy()
    assert np.array_equal(value, weight.T if path[-1] == "kernel" else weight), path


def test_convert_export_round_trip_is_bit_identical(saved, tmp_path):
  """HF dir -> converted checkpoint (through the CLI) -> HF dir gives the same tensors, and the
  export loads in the wheel."""
  ckpt = tmp_path / "ckpt"
  subprocess.run([sys.executable, "-m", "convert.dflash", f"--hf_dir={saved.drafter_dir}",
                  f"--out={ckpt}", "--dtype=float32"], check=True, capture_output=True,
                 cwd=ROOT)
  original = flat_params(load_drafter(saved.drafter_dir, jnp.float32, progress=False))
  assert_same_params(original, flat_params(load_drafter(ckpt, jnp.float32, progress=False)))
  exported = export_hf(ckpt, tmp_path / "hf")
  assert_same_params(original, flat_params(load_drafter(exported, jnp.float32, progress=False)))
  wheel = DFlashDraftModel.from_pretrained(exported)
  assert (wheel.block_size, wheel.mask_token_id, list(wheel.target_layer_ids)) == (
      saved.drafter.block_size, saved.drafter.mask_token_id, list(saved.drafter.target_layer_ids))
  reference = saved.drafter.state_dict()
  assert wheel.state_dict().keys() == reference.keys()
  for name, tensor in wheel.state_dict().items():
    assert torch.equal(tensor, reference[name]), name


def _copy_with_config(src, dst, **changes):
  """Copies a drafter directory, changing config.json keys (dflash_config's where they live)."""
  shutil.copytree(src, dst)
  config = json.loads((dst / "config.json").read_text())
  for key, value in changes.items():
    (config["dflash_config"] if key in config["dflash_config"] else config)[key] = value
  (dst / "config.json").write_text(json.dumps(config))
  return dst


@pytest.mark.parametrize("change, match", [
    (dict(hidden_size=64), "drafter hidden_size 64 != target hidden_size 48"),
    (dict(target_layer_ids=[1, 4]), r"target_layer_ids \[4\] are outside the target's 4 layers"),
    (dict(mask_token_id=96), r"mask_token_id 96 is outside the target vocabulary \(96\)"),
    (dict(block_size=1), "block_size 1 < 2 leaves nothing to draft"),
])
def test_drafter_that_does_not_fit_the_target_is_rejected(saved, tmp_path, change, match):
  """Rejected from config.json alone, before any weight is read (these weights no longer fit)."""
  bad = _copy_with_config(saved.drafter_dir, tmp_path / "bad", **change)
  target_cfg = load_target(saved.target_dir, jnp.float32, progress=False).cfg
  with pytest.raises(ValueError, match=match):
    load_drafter(bad, jnp.float32, progress=False, target_cfg=target_cfg)


@pytest.mark.parametrize("edit, match", [
    ("missing", r"lacks 1 tensor\(s\) the model needs: fc.weight"),
    ("unexpected", r"has 1 tensor\(s\) the model does not use: extra.weight"),
    ("misshaped", r"fc.weight: expected \(48, 96\), found \(48, 48\)"),
])
def test_bad_tensors_are_named(saved, tmp_path, edit, match):
  bad = tmp_path / "bad"
  shutil.copytree(saved.drafter_dir, bad)
  tensors = load_file(str(bad / "model.safetensors"))
  if edit == "missing":
    del tensors["fc.weight"]
  elif edit == "unexpected":
    tensors["extra.weight"] = torch.zeros(3)
  else:
    tensors["fc.weight"] = tensors["fc.weight"][:, :48].contiguous()
  save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=match):
    load_drafter(bad, jnp.float32, progress=False)


def test_target_directory_is_not_a_drafter(saved):
  with pytest.raises(ValueError, match="neither dflash_config.target_layer_ids nor"):
    load_drafter(saved.target_dir, jnp.float32, progress=False)
