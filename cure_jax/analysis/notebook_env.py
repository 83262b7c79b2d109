"""What the research notebooks need around the library: jax for the accelerator, the small mode
(tiny local stand-ins for Qwen3-8B and its drafter), checkpoints (download, one orbax
conversion), a mesh for the devices present, and the TPU scale report when one was written.

Importing this module does not import jax, so a notebook can still set XLA_FLAGS (8 fake CPU
devices in small mode) or install jax for its accelerator afterwards.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

SMALL_ENV = "CURE_JAX_NOTEBOOK_SMALL"
FAKE_DEVICES = 8
# Where the TPU scale report (`python -m experiments.aot`) is looked for, first
# match wins; the notebook shows it when one exists.
SCALE_REPORTS = ("results/aot/*.md", "results/scale/*.md", "results/*aot*.md", "results/*scale*.md")
HF_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model")


def small_mode(default: bool = False) -> bool:
  """True when CURE_JAX_NOTEBOOK_SMALL=1 (CI), else `default` (the notebook's parameter)."""
  value = os.environ.get(SMALL_ENV)
  return default if value is None else value == "1"


def fake_cpu_devices(count: int = FAKE_DEVICES) -> None:
  """Makes the CPU look like `count` devices; only works before jax is first imported."""
  if "jax" in sys.modules:
    raise RuntimeError("jax is already imported: restart the kernel and set small mode first")
  flag = f"--xla_force_host_platform_device_count={count}"
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), flag]))
  os.environ["JAX_PLATFORMS"] = "cpu"


def accelerator() -> str:
  """'tpu', 'gpu' or 'cpu', without importing jax (it may not be installed for the device)."""
  if os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_NAME") or glob.glob("/dev/accel*") \
      or glob.glob("/dev/vfio/[0-9]*"):
    return "tpu"
  if shutil.which("nvidia-smi"):
    return "gpu"
  return "cpu"


def install_jax(kind: str | None = None) -> str:
  """pip-installs jax for the accelerator ('tpu' -> jax[tpu], 'gpu' -> jax[cuda12]); nothing on a
  CPU. Run it before jax is imported. Returns what it did."""
  kind = kind or accelerator()
  extra = {"tpu": "jax[tpu]", "gpu": "jax[cuda12]"}.get(kind)
  if extra is None:
    return "cpu: the installed jax is used"
  if "jax" in sys.modules:
    raise RuntimeError("jax is already imported: restart the kernel, then install jax first")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-U", extra], check=True)
  return f"installed {extra}"


def download(repo_id: str, local_dir: str) -> str:
  """A Hub snapshot (weights, config, tokenizer) into local_dir; reuses what is already there."""
  from huggingface_hub import snapshot_download
  return snapshot_download(repo_id, local_dir=local_dir, allow_patterns=list(HF_PATTERNS))


def tiny_pair(root: str, seed: int = 0) -> tuple[str, str]:
  """HF directories of a tiny random Qwen3 target and DFlash drafter, written under root: the
  small mode's stand-ins for Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16 (4 heads and KV heads, so
  tensor parallelism over 4 of the 8 fake devices works as it does for the 8B's 32 / 8; a
  vocabulary of 8, so that a random drafter is right often enough for repairs to win)."""
  from cure_jax.analysis import random_models
  arch = random_models.Arch(vocab=8, hidden=64, layers=4, heads=4, kv_heads=4, head_dim=16,
                            draft_layers=2, block_size=8, target_layer_ids=(1, 2))
  target, drafter = random_models.pair(arch, seed)
  target_dir, drafter_dir = random_models.write_hf(root, target, drafter)
  return str(target_dir), str(drafter_dir)


def convert_once(hf_dir: str, out_dir: str, kind: str, dtype: str) -> str:
  """An orbax checkpoint of an HF directory (kind 'target' or 'drafter'), converted on the first
  call only; later calls (and later runs) load the folder directly."""
  from cure_jax.checkpoints import dflash, qwen3, store
  if store.read_metadata(out_dir) is None:
    convert = qwen3.convert_hf if kind == "target" else dflash.convert_hf
    convert(hf_dir, out_dir, dtype, progress=False)
  return out_dir


def _fits(cfg, model: int) -> bool:
  from cure_jax.runtime import sharding
  try:
    sharding.check_config(cfg, types.SimpleNamespace(shape={sharding.MODEL: model}))
  except ValueError:
    return False
  return True


def choose_mesh(target_cfg, drafter_cfg) -> tuple[int, int]:
  """(data, model) for jax.devices(): tensor parallel over as many chips of one host as both
  models split over evenly (the 8B: up to 8), the remaining devices on data."""
  import jax
  n, local = len(jax.devices()), jax.local_device_count()
  model = max(d for d in range(1, local + 1)
              if n % d == 0 and local % d == 0 and _fits(target_cfg, d) and _fits(drafter_cfg, d))
  return n // model, model


def byte_ids(text: str, vocab: int, limit: int) -> list[int]:
  """Token ids for a model without a tokenizer (the small mode's random target): the text's last
  `limit` bytes modulo vocab - 1 (the last id is the drafter's mask token)."""
  return [b % (vocab - 1) for b in text.encode()[-limit:]]


def scale_report(root: str = ".") -> str | None:
  """The path of the newest TPU scale report under root, or None."""
  found = [p for pattern in SCALE_REPORTS for p in glob.glob(str(Path(root) / pattern))]
  return max(found, key=os.path.getmtime) if found else None
