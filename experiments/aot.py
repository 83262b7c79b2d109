"""Compile the real decoding program for an accelerator we do not have, and read what it costs.

With libtpu installed (`pip install "jax[tpu]==<jax version>"`, no TPU needed),
`jax.experimental.topologies` gives compile-only TPU devices, and XLA's real TPU compiler builds
the program for them on this CPU host. Target and drafter are built abstractly
(`nnx.eval_shape`) from their config.json, so nothing is allocated and no checkpoint is read.
For each method (ar, chain, cure at each v_max) and batch this compiles prefill and the decode
loop exactly as `experiments.decode` would (`decoding.lower_sharded`), plus a 1-token target
forward, and records compile seconds, per-chip memory, collectives, fusions, XLA's cost
analysis and an independent count of the HBM traffic of one loop iteration
(`cure_jax.costs.hlo_traffic`), weights apart.

  python -m experiments.aot --config=configs/qwen3_8b.py --topology=v5e:2x2 --config.mesh.model=4
  python -m experiments.aot --config=configs/qwen3_8b.py --topology=cpu --config.dtype=float32 \
    --methods=ar,chain,cure --v_max=64 --batch=1

With a drafter training config, --programs=train compiles its online training step instead
(cure_jax/training/program.py), e.g. `--config=configs/train/qwen3_8b.py --programs=train
--topology=v5e:4x4 --config.mesh.model=4 --config.train.seqs_per_step=16`.

A config may carry an `aot` field (configs/qwen3_coder_30b_a3b.py): its target, drafter,
topology, methods, v_max, batch and output replace these flags' defaults; flags given on the
command line still win. Writes <output>.json and <output>.md (atomically). libtpu takes a lock
file: run one TPU compile process per machine at a time. The work is the library's
(cure_jax/analysis/aot.py: aot_programs, what is compiled; aot_costs, what it costs).
"""

from __future__ import annotations

import os

# The CUDA plugin (jax[cuda12], for compile-only GPU topologies) refuses to load without a driver
# unless told not to check; it must be told before jax starts.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from absl import app, flags

from cure_jax.analysis import aot, aot_costs
from cure_jax.analysis.aot_programs import METHODS, PROGRAMS
from cure_jax.runtime import errors

_CONFIG = errors.config_flag("configs/qwen3_8b.py", "decoding config (dtype, mesh, cure settings)")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU topology (v5e:2x2, v6e:2x2, "
                                "v5p:2x2x1, ...) or 'cpu' for the host's CPU backend")
_TARGET = flags.DEFINE_string("target", "configs/hf/qwen3_8b", "HF directory of the target "
                              "(only config.json is read)")
_DRAFTER = flags.DEFINE_string("drafter", "configs/hf/qwen3_8b_dflash_b16", "DFlash directory "
                               "(only config.json is read)")
_METHODS = flags.DEFINE_list("methods", ["ar", "chain", "cure"], "methods to compile")
_V_MAX = flags.DEFINE_list("v_max", ["16", "32", "64"], "cure tree sizes")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "batch sizes")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "static cache length")
_PROMPT = flags.DEFINE_integer("prompt_len", 256, "prompt bucket (prefill length)")
_PROGRAMS = flags.DEFINE_list("programs", ["prefill", "decode", "forward"],
                              "what to compile: prefill, decode (the loop), forward (one "
                              "1-token target forward), or train (alone, with a drafter "
                              "training config)")
_TRAIN_LEN = flags.DEFINE_integer("train_len", 3072, "train: tokens per sequence (the padded "
                                  "context of one training row)")
_OUTPUT = flags.DEFINE_string("output", "results/aot/qwen3_8b", "output path without extension")
_DUMP_HLO = flags.DEFINE_string("dump_hlo", "", "folder: also write each optimized HLO module")
_OPTIONS = flags.DEFINE_list("compiler_options", [], "XLA options for every compile, name=value "
                             "(e.g. xla_gpu_experimental_force_split_k=1), kept in the report")
_SYNTHETIC_VOCAB = flags.DEFINE_bool("synthetic_vocab", False, "with --config.drafter.vocab=N "
                                      "and no token counts for this target: N seeded-random "
                                      "token ids stand in for the N most frequent, for the "
                                      "compile-only count (the bytes read depend on N, not on "
                                      "which ids); the report says so")
_RECOUNT = flags.DEFINE_bool("recount", False, "compile nothing: recount the HLO modules a run "
                             "dumped into --dump_hlo and rewrite its --output report")


def setting(holder, config):
  """A flag's value: the command line's, else the config's `aot.<flag name>`, else the default."""
  aot = config.get("aot") or {}
  if holder.present or holder.name not in aot:
    return holder.value
  value = aot[holder.name]
  return value.split(",") if isinstance(holder.value, list) else value


def main(argv):
  del argv
  if _RECOUNT.value:
    n = aot_costs.recount(_OUTPUT.value, _DUMP_HLO.value)
    print(f"recounted {n} programs into {_OUTPUT.value}.json and .md")
    return
  config = _CONFIG.value
  programs = [p.strip() for p in _PROGRAMS.value]
  if "train" in programs or "train" in config:
    if programs != ["train"] or "train" not in config:
      raise app.UsageError("--programs=train goes alone, with a drafter training config "
                           "(configs/train/...); other programs take a decoding config")
    target_dir, topology, output = (setting(f, config) for f in (_TARGET, _TOPOLOGY, _OUTPUT))
    aot.train_report(config, target_dir, topology, output, _TRAIN_LEN.value, _DUMP_HLO.value)
    print(f"wrote {output}.json and .md")
    return
  names = [m.strip() for m in setting(_METHODS, config)]
  bad = [m for m in names if m not in METHODS]
  if bad:
    raise app.UsageError(f"--methods: unknown {bad}; choose from {METHODS}")
  if [p for p in programs if p not in PROGRAMS]:
    raise app.UsageError(f"--programs={_PROGRAMS.value}; choose from {PROGRAMS}")
  try:
    v_maxes = [int(v) for v in setting(_V_MAX, config)]
    batches = [int(b) for b in setting(_BATCH, config)]
  except ValueError as e:
    raise app.UsageError(f"--v_max and --batch take integers: {e}") from e
  if _PROMPT.value >= _MAX_LEN.value:
    raise app.UsageError(f"--prompt_len={_PROMPT.value} must be below --max_len={_MAX_LEN.value}")
  s = aot.Settings(*(setting(f, config) for f in (_TARGET, _DRAFTER, _TOPOLOGY, _OUTPUT)),
                   methods=tuple(names), programs=tuple(programs), v_maxes=tuple(v_maxes),
                   batches=tuple(batches), max_len=_MAX_LEN.value, prompt_len=_PROMPT.value,
                   dump_hlo=_DUMP_HLO.value, compiler_options=tuple(_OPTIONS.value),
                   synthetic_vocab=_SYNTHETIC_VOCAB.value)
  aot.compile_report(config, s)
  print(f"wrote {s.output}.json and .md")


if __name__ == "__main__":
  errors.run(main)
