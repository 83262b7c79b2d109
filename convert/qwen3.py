"""Qwen3 / Llama target checkpoints: HF directories and converted orbax folders.

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
from flax import nnx

from convert import checkpoint
from cure_jax.models.qwen3 import ModelConfig, Qwen3

KIND = "target"


def hf_name(path: checkpoint.StatePath) -> str:
  """HF tensor name of a Qwen3 state path: everything but lm_head lives under `model.`."""
  return checkpoint.hf_name(path, "" if path[0] == "lm_head" else "model.")


def _read_state(path: str | os.PathLike, dtype, progress: bool, placement=None):
  """(config dict, graphdef, state) of an HF directory or a converted checkpoint at `path`.

  `placement` (cure_jax.sharding.placement(mesh)) puts each tensor straight onto its devices.
  """
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; pass a Hugging Face Qwen3/Llama directory or "
                            "a checkpoint written by `python -m convert.qwen3`.")
  meta = checkpoint.read_metadata(path)
  if meta is not None and meta.get("kind") != KIND:
    raise ValueError(f"{path} holds a converted {meta.get('kind')!r} checkpoint, not a {KIND!r} "
                     "model; pass the target model's directory.")
  config = checkpoint.read_hf_config(path)
  cfg = ModelConfig.from_hf(config)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, jnp.dtype(dtype))))
  if meta is not None:
    if placement is not None:  # restore each leaf straight into its sharding
      abstract = placement.annotate(abstract)
    return config, graphdef, checkpoint.load_checkpoint(abstract, path)
  # transformers shares embed_tokens as the head of a tied model and ignores a stored lm_head.
  ignore = ("lm_head.weight",) if cfg.tie_embeddings else ()
  state = checkpoint.stream_params(abstract, path, hf_name, jnp.dtype(dtype), progress,
                                   ignore=ignore, placement=placement)
  return config, graphdef, state


def load_target(path: str | os.PathLike, dtype=jnp.bfloat16, progress: bool = True,
                placement=None) -> Qwen3:
  """The target model from an HF directory (converted while loading) or a converted checkpoint
  (recognised by its cure_jax.json), with parameters in `dtype`; with a `placement`
  (cure_jax.sharding.placement(mesh)) each tensor is loaded straight onto its shards."""
  _, graphdef, state = _read_state(path, dtype, progress, placement)
  return nnx.merge(graphdef, state)


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=jnp.bfloat16,
               progress: bool = True) -> Path:
  """Converts an HF directory into an orbax checkpoint folder at out_dir (written atomically)."""
  config, _, state = _read_state(hf_dir, dtype, progress)
  return checkpoint.save_checkpoint(state, out_dir, config, KIND, aux_from=hf_dir)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=None,
              num_shards: int = 1) -> Path:
  """Writes a converted checkpoint back as an HF directory (in its stored dtype by default)."""
  meta = checkpoint.read_metadata(ckpt_dir)
  if meta is None:
    raise ValueError(f"{ckpt_dir} has no {checkpoint.METADATA}, so it is not a checkpoint written "
                     "by `python -m convert.qwen3`; an HF directory needs no export.")
  config, _, state = _read_state(ckpt_dir, meta["dtype"] if dtype is None else dtype, False)
  return checkpoint.export_hf(state, out_dir, hf_name, config, aux_from=ckpt_dir,
                              num_shards=num_shards)


if __name__ == "__main__":
  checkpoint.run_cli("Hugging Face model", convert_hf, export_hf)
