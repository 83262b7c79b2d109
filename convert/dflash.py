"""DFlash drafter checkpoints: HF directories and converted orbax folders.

A drafter directory holds config.json (a Qwen3 config plus `block_size`, `num_target_layers` and
`dflash_config.{mask_token_id, target_layer_ids}`) and the drafter's own tensors only: it borrows
the target's embedding and head. Published exports name the tensors `layers.0...` or
`model.layers.0...`; both load. Exports are written the way `DFlashDraftModel.save_pretrained`
writes them (no prefix).

    python -m convert.dflash --hf_dir=Qwen3-8B-DFlash-b16 --out=ckpt/dflash-8b --dtype=bfloat16
    python -m convert.dflash --hf_dir=exported/dflash-8b --out=ckpt/dflash-8b --to_hf
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from convert import checkpoint
from cure_jax.models.dflash import DFlash, DFlashConfig

KIND = "drafter"
PREFIX = "model."


def _name_of(prefix: str) -> checkpoint.NameOf:
  return lambda path: checkpoint.hf_name(path, prefix)


def _stored_prefix(hf_dir: Path) -> str:
  """PREFIX if the directory's drafter tensors are stored under it, else ''."""
  names = checkpoint.tensor_names(hf_dir)
  return PREFIX if names and all(n.startswith(PREFIX) for n in names) else ""


def _read_state(path: str | os.PathLike, dtype, progress: bool, target_cfg=None, placement=None):
  """(config dict, graphdef, state) of an HF directory or a converted checkpoint at `path`.

  With target_cfg, the drafter is checked against the target before any weight is read;
  `placement` (cure_jax.sharding.placement(mesh)) puts each tensor straight onto its devices.
  """
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; pass a DFlash drafter directory or a "
                            "checkpoint written by `python -m convert.dflash`.")
  meta = checkpoint.read_metadata(path)
  if meta is not None and meta.get("kind") != KIND:
    raise ValueError(f"{path} holds a converted {meta.get('kind')!r} checkpoint, not a {KIND!r}; "
                     "pass the DFlash drafter's directory.")
  config = checkpoint.read_hf_config(path)
  cfg = DFlashConfig.from_hf(config)
  if target_cfg is not None:
    cfg.check_against(target_cfg)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DFlash(cfg, jnp.dtype(dtype))))
  if meta is not None:
    if placement is not None:  # restore each leaf straight into its sharding
      abstract = placement.annotate(abstract)
    return config, graphdef, checkpoint.load_checkpoint(abstract, path)
  state = checkpoint.stream_params(abstract, path, _name_of(_stored_prefix(path)),
                                   jnp.dtype(dtype), progress, placement=placement)
  return config, graphdef, state


def load_drafter(path: str | os.PathLike, dtype=jnp.bfloat16, progress: bool = True,
                 target_cfg=None, placement=None) -> DFlash:
  """The drafter from an HF directory (converted while loading) or a converted checkpoint, with
  parameters in `dtype`. Given the target's ModelConfig, a drafter that cannot sit on that
  target is rejected (ValueError) before any weight is read or anything compiles. With a
  `placement` (cure_jax.sharding.placement(mesh)) each tensor is loaded straight onto its shards."""
  _, graphdef, state = _read_state(path, dtype, progress, target_cfg, placement)
  return nnx.merge(graphdef, state)


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=jnp.bfloat16,
               progress: bool = True) -> Path:
  """Converts a DFlash HF directory into an orbax checkpoint folder at out_dir (atomically)."""
  config, _, state = _read_state(hf_dir, dtype, progress)
  return checkpoint.save_checkpoint(state, out_dir, config, KIND, aux_from=hf_dir)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=None,
              num_shards: int = 1) -> Path:
  """Writes a converted checkpoint back as a DFlash HF directory (stored dtype by default)."""
  meta = checkpoint.read_metadata(ckpt_dir)
  if meta is None:
    raise ValueError(f"{ckpt_dir} has no {checkpoint.METADATA}, so it is not a checkpoint written "
                     "by `python -m convert.dflash`; an HF directory needs no export.")
  config, _, state = _read_state(ckpt_dir, meta["dtype"] if dtype is None else dtype, False)
  return checkpoint.export_hf(state, out_dir, _name_of(""), config, aux_from=ckpt_dir,
                              num_shards=num_shards)


if __name__ == "__main__":
  checkpoint.run_cli("DFlash drafter HF", convert_hf, export_hf)
