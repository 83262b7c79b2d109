"""Our Qwen3-MoE decoder, loaded through the converter from save_pretrained directories, against
transformers' Qwen3MoeForCausalLM on random configs with dense layers mixed in.

Prefill over BATCH x LENGTH tokens takes the ragged_dot lowering; one-token decoding steps at
batch 2 take the gathered-slices one (3 * 2 * top_k <= experts), so both are checked against the
reference."""

import types

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from cure_jax.checkpoints import qwen3, store
from cure_jax.checkpoints.qwen3 import load_target
from tests.test_qwen3_parity import (BATCH, LENGTH, PREFILL, TOL, decode_step, prefill,
                                     random_hf_model)

_MOE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=24, tie_word_embeddings=False)
# name -> (config kwargs, save_pretrained shard size): renormalised and raw top-k weights, dense
# layers from mlp_only_layers and from decoder_sparse_step, one file and sharded files.
CASES = {
    "norm_topk_mlp_only": (dict(_MOE, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[1]), None),
    "raw_topk_sparse_step2_sharded": (dict(_MOE, num_experts=18, num_experts_per_tok=3,
                                           norm_topk_prob=False, decoder_sparse_step=2,
                                           mlp_only_layers=[]), "40KB"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
  kwargs, shard = CASES[request.param]
  hf_model = random_hf_model(Qwen3MoeConfig, Qwen3MoeForCausalLM, **kwargs)
  with torch.no_grad():  # a sharper router, so no token's top-k is a near tie
    for layer in hf_model.model.layers:
      if hasattr(layer.mlp, "gate"):
        layer.mlp.gate.weight.mul_(20.0)
  hf_dir = tmp_path_factory.mktemp(request.param)
  hf_model.save_pretrained(hf_dir, **({"max_shard_size": shard} if shard else {}))
  tokens = torch.randint(0, hf_model.config.vocab_size, (BATCH, LENGTH),
                         generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    ref = hf_model(tokens)
  return types.SimpleNamespace(hf_dir=hf_dir, tokens=tokens.numpy(), logits=ref.logits.numpy(),
                               config=hf_model.config, sharded=shard is not None,
                               model=load_target(hf_dir, jnp.float32, progress=False))


def test_checkpoint_layout_is_the_hub_one(case):
  """Per-expert tensors and a router per sparse layer, dense MLP tensors in the others."""
  names = store.tensor_names(case.hf_dir)
  sparse = case.model.cfg.moe.sparse_layers
  assert sum(sparse) not in (0, len(sparse))  # dense layers really are mixed in
  for i, is_sparse in enumerate(sparse):
    experts = {n for n in names if n.startswith(f"model.layers.{i}.mlp.experts.")}
    assert len(experts) == (3 * case.config.num_experts if is_sparse else 0)
    assert (f"model.layers.{i}.mlp.gate.weight" in names) == is_sparse
    assert (f"model.layers.{i}.mlp.gate_proj.weight" in names) != is_sparse
  if case.sharded:
    assert len(store.safetensors_files(case.hf_dir)) > 1


def test_prefill_logits_match_transformers(case):
  logits, _, _ = prefill(case.model, case.tokens)
  chex.assert_trees_all_close(np.asarray(logits), case.logits, rtol=0, atol=TOL)


def test_incremental_decoding_matches_transformers(case):
  prefill_logits, _, cache = prefill(case.model, case.tokens[:, :PREFILL])
  logits = [np.asarray(prefill_logits)]
  for t in range(PREFILL, LENGTH):
    step_logits, cache = decode_step(case.model, cache, case.tokens[:, t], t)
    logits.append(np.asarray(step_logits)[:, None])
  chex.assert_trees_all_close(np.concatenate(logits, axis=1), case.logits, rtol=0, atol=TOL)


def test_convert_and_export_round_trip(case, tmp_path):
  """HF -> orbax -> HF gives back the same per-expert tensors transformers wrote."""
  ckpt = qwen3.convert_hf(case.hf_dir, tmp_path / "ckpt", jnp.float32, progress=False)
  out = qwen3.export_hf(ckpt, tmp_path / "hf", num_shards=2)
  assert store.tensor_names(out) == store.tensor_names(case.hf_dir)
  reloaded = load_target(out, jnp.float32, progress=False)
  np.testing.assert_array_equal(np.asarray(prefill(reloaded, case.tokens)[0]),
                                np.asarray(prefill(case.model, case.tokens)[0]))
