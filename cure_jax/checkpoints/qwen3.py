"""Qwen3 / Qwen3-MoE / Llama target checkpoints: HF directories and converted orbax folders.

Model dimensions always come from the checkpoint's config.json. A converted folder holds the
orbax state, that config.json, a cure_jax.json {kind, dtype} and the tokenizer files, so it can
be exported back to an HF directory unchanged.

    python -m convert.qwen3 --hf_dir=Qwen3-8B --out=ckpt/qwen3-8b --dtype=bfloat16
    python -m convert.qwen3 --hf_dir=exported/qwen3-8b --out=ckpt/qwen3-8b --to_hf
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp

from cure_jax.checkpoints import store
from cure_jax.models.qwen3 import ModelConfig, Qwen3

def hf_name(path: store.StatePath) -> str:
  """HF tensor name of a Qwen3 state path: everything but lm_head lives under `model.`; an
  MoE's stacked experts are stored one per expert, `mlp.experts.{e}.gate_proj.weight`."""
  if "experts" in path:
    i = path.index("experts") + 1
    path = path[:i] + ("{e}",) + path[i:]
  return store.hf_name(path, "" if path[0] == "lm_head" else "model.")


def _read_names(hf_dir: Path, config: dict):
  # transformers shares embed_tokens as the head of a tied model and ignores a stored lm_head.
  tied = ModelConfig.from_hf(config).tie_embeddings
  return hf_name, ("lm_head.weight",) if tied else ()


FAMILY = store.Family(
    kind="target", module="convert.qwen3",
    source="a Hugging Face Qwen3/Qwen3-MoE/Llama directory (the target model's)",
    build=lambda config, dtype: Qwen3(ModelConfig.from_hf(config), dtype),
    read_names=_read_names, write_names=hf_name)


def load_target(path: str | os.PathLike, dtype=jnp.bfloat16, progress: bool = True,
                placement=None) -> Qwen3:
  """The target model from an HF directory (converted while loading) or a converted checkpoint
  (recognised by its cure_jax.json), with parameters in `dtype`; with a `placement`
  (cure_jax.runtime.sharding.placement(mesh)) each tensor is loaded straight onto its shards."""
  return store.load(FAMILY, path, dtype, progress, placement)


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=jnp.bfloat16,
               progress: bool = True) -> Path:
  """Converts an HF directory into an orbax checkpoint folder at out_dir (written atomically)."""
  return store.convert(FAMILY, hf_dir, out_dir, dtype, progress)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=None,
              num_shards: int = 1) -> Path:
  """Writes a converted checkpoint back as an HF directory (in its stored dtype by default)."""
  return store.export(FAMILY, ckpt_dir, out_dir, dtype, num_shards)

