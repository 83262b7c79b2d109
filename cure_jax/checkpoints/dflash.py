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

from cure_jax.checkpoints import store
from cure_jax.models.dflash import DFlash, DFlashConfig

PREFIX = "model."


def _read_names(hf_dir: Path, config: dict):
  """Published exports store the drafter's tensors under PREFIX or under no prefix."""
  names = store.tensor_names(hf_dir)
  prefix = PREFIX if names and all(n.startswith(PREFIX) for n in names) else ""
  return (lambda path: store.hf_name(path, prefix)), ()


FAMILY = store.Family(
    kind="drafter", module="convert.dflash", source="the DFlash drafter's directory",
    build=lambda config, dtype: DFlash(DFlashConfig.from_hf(config), dtype),
    read_names=_read_names, write_names=store.hf_name)


def load_drafter(path: str | os.PathLike, dtype=jnp.bfloat16, progress: bool = True,
                 target_cfg=None, placement=None) -> DFlash:
  """The drafter from an HF directory (converted while loading) or a converted checkpoint, with
  parameters in `dtype`. Given the target's ModelConfig, a drafter that cannot sit on that
  target is rejected (ValueError) before any weight is read or anything compiles. With a
  `placement` (cure_jax.runtime.sharding.placement(mesh)) each tensor is loaded straight onto
  its shards."""
  check = None
  if target_cfg is not None:
    def check(config):
      DFlashConfig.from_hf(config).check_against(target_cfg)
  return store.load(FAMILY, path, dtype, progress, placement, check)


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=jnp.bfloat16,
               progress: bool = True) -> Path:
  """Converts a DFlash HF directory into an orbax checkpoint folder at out_dir (atomically)."""
  return store.convert(FAMILY, hf_dir, out_dir, dtype, progress)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=None,
              num_shards: int = 1) -> Path:
  """Writes a converted checkpoint back as a DFlash HF directory (stored dtype by default)."""
  return store.export(FAMILY, ckpt_dir, out_dir, dtype, num_shards)

