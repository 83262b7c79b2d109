"""XLA options the decoding programs are compiled with: each platform's defaults (what they
fix is measured below) under the user's own, and a compile that tells a user's unknown option
from a default this XLA version lacks."""

from __future__ import annotations

import re

import jax

# XLA options a platform's programs are compiled with unless the user sets them. CPU: copy
# insertion by region analysis. Without it XLA:CPU copied every layer's cache twice an iteration
# (a loop body that reads a buffer and then updates it in place), so a step cost what the
# cache could hold, not what it holds (ar, SmolLM2 at max_len 4,608: 120 copies of 3.5 MB).
# GPU: no dot merging. XLA:GPU merged the drafter's ten context K/V products (one operand, ten
# weights) into one dot over a concatenation of the weights, built inside the loop: a copy of
# 84 MB of Qwen3-8B's drafter written and read back every iteration.
# TPU: memory-space assignment keeps out of on-chip memory a buffer whose uses there move fewer
# bytes than its copies in and out. Without it XLA:TPU staged whole caches in on-chip memory
# around the commit's small scatter and copied them back (Qwen3-8B ar at batch 8 on a v5e 2x2:
# 24 of 72 layer caches in numerics=invariant, 5.40 GB an iteration against 4.99). A ratio of 2
# also dropped buffers that paid (CURE v64 at batch 1: 5.77 GB against 5.67).
PLATFORM_OPTIONS = {"cpu": {"xla_cpu_copy_insertion_use_region_analysis": True},
                    "gpu": {"xla_gpu_dot_merger_threshold_mb": 0},
                    "tpu": {"xla_tpu_msa_inefficient_use_to_copy_ratio": 1}}
_UNKNOWN = re.compile(r"No such compile option: '(\w+)'")


def platform_options(platform: str, options: dict | None = None) -> dict:
  """The platform's default XLA options under the user's `options` (which win)."""
  return {**PLATFORM_OPTIONS.get(platform, {}), **(options or {})}


def compile_with(lowered, options: dict[str, str] | None = None):
  """lowered.compile() with XLA `options`; an option this XLA does not know is a user error,
  unless it is one of PLATFORM_OPTIONS' (another XLA version may not have it): then it is
  left out."""
  try:
    return lowered.compile(options or None)
  except jax.errors.JaxRuntimeError as e:
    if "compile option" not in str(e):
      raise
    unknown = _UNKNOWN.search(str(e))
    name = unknown.group(1) if unknown else None
    if any(name in defaults for defaults in PLATFORM_OPTIONS.values()):
      return compile_with(lowered, {k: v for k, v in options.items() if k != name})
    raise ValueError(f"compiler options {options}: {e} (names are XLA DebugOptions fields, "
                     "e.g. xla_gpu_experimental_force_split_k=1)") from e
