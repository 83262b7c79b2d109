"""The trained drafter on disk in DFlash's HF format (config.json, model.safetensors), as
`DFlashDraftModel.from_pretrained` and cure_jax.checkpoints.dflash read it; written aside and swapped in, so
a reader never finds half a drafter."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from cure_jax.models.dflash import DFlashConfig


def hf_config(cfg: DFlashConfig, target_dir: str, dtype_name: str) -> dict:
  """The drafter's config.json as `DFlashDraftModel.from_pretrained` reads it."""
  from cure_jax.checkpoints.store import read_hf_config
  tcfg = read_hf_config(target_dir)
  return {
      "architectures": ["DFlashDraftModel"],
      "model_type": "qwen3",
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope.theta,
      "rope_scaling": tcfg.get("rope_scaling"),
      "max_position_embeddings": tcfg.get("max_position_embeddings", 8192),
      "vocab_size": tcfg["vocab_size"],
      "attention_bias": False,
      "attention_dropout": 0.0,
      "tie_word_embeddings": False,
      "use_sliding_window": False,
      "torch_dtype": dtype_name,
      "block_size": cfg.block_size,
      "num_target_layers": cfg.num_target_layers,
      "dflash_config": {"mask_token_id": cfg.mask_token_id,
                        "target_layer_ids": list(cfg.target_layer_ids)},
  }


def export(params: nnx.State, cfg: DFlashConfig, out_dir, target_dir: str, dtype,
           extra: dict | None = None) -> Path:
  """Writes host parameters as a DFlash HF directory (config.json, model.safetensors,
  training.json) in `dtype`; it replaces out_dir only once complete."""
  from cure_jax.checkpoints import store
  out = Path(out_dir).resolve()
  staged = out.parent / f".{out.name}.new-{uuid.uuid4().hex[:8]}"
  try:
    store.export_hf(params, staged, store.hf_name,
                         hf_config(cfg, target_dir, jnp.dtype(dtype).name), dtype=dtype)
    if extra is not None:
      (staged / "training.json").write_text(json.dumps(extra, indent=1))
      (staged / "training.json").chmod(0o644)
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    if out.exists():
      os.replace(out, old)
    os.replace(staged, out)
    shutil.rmtree(old, ignore_errors=True)
  finally:
    shutil.rmtree(staged, ignore_errors=True)
  return out
