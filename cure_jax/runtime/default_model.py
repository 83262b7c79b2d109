"""The embedded default: SmolLM2-135M-Instruct (converted once from its packaged GGUF) and the
drafters trained for it that ship inside this package.

    from cure_jax.runtime import default_model
    target_dir = default_model.smollm2_dir()          # HF directory, converted on first use
    drafter_dir = default_model.SMOLLM2_DFLASH_DIR    # DFlash block drafter (block size 16)
"""

from __future__ import annotations

import os
from pathlib import Path

_ASSETS = Path(__file__).resolve().parents[1] / "assets"

# DFlash drafter trained for SmolLM2-135M-Instruct (config.json + model.safetensors).
SMOLLM2_DFLASH_DIR = str(_ASSETS / "smollm2_dflash")
# Small autoregressive (Llama-family) drafter for the `ar_draft` baseline.
SMOLLM2_AR_DRAFTER_DIR = str(_ASSETS / "smollm2_ar_drafter")

_CACHE_ENV = "CURE_JAX_CACHE"
_SMOLLM2_NAME = "smollm2-135m-instruct"
_REQUIRED_FILES = ("config.json", "model.safetensors")


def cache_root() -> Path:
  """`$CURE_JAX_CACHE` if set, else ~/.cache/cure_jax."""
  env = os.environ.get(_CACHE_ENV)
  return Path(env).expanduser() if env else Path.home() / ".cache" / "cure_jax"


def _complete(model_dir: Path) -> bool:
  return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def smollm2_dir(progress: bool = True) -> str:
  """The HF directory of SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

  The conversion (about a minute) writes into a hidden sibling folder and renames it into place,
  so an interrupted run never leaves a half-written model; later calls reuse the folder.
  """
  out = cache_root() / _SMOLLM2_NAME
  if _complete(out):
    return str(out)
  # heavy imports, first use only
  from cure_jax.checkpoints.gguf import convert_gguf, default_smollm2_gguf

  gguf_path = default_smollm2_gguf()
  if progress:
    print(f"cure_jax: converting {gguf_path} -> {out} (first use only)", flush=True)
  # An existing but incomplete folder (e.g. emptied by hand) is replaced.
  convert_gguf(gguf_path, str(out), overwrite=out.exists())
  if not _complete(out):
    raise RuntimeError(f"conversion finished but {out} lacks one of {_REQUIRED_FILES}")
  if progress:
    print(f"cure_jax: SmolLM2 ready at {out}", flush=True)
  return str(out)
