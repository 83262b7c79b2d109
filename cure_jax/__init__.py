"""cure_jax: CURE (local uncertainty repair) for block-parallel speculative decoding, in JAX.

The parts, from the bottom up; each imports only from the ones above it in this list:

  models/    Flax NNX modules: Qwen3/Llama targets, the DFlash block drafter, the KV cache,
             the mesh axis names; models/kernels/: attention kernels per platform.
  checkpoints/  HF safetensors, orbax and GGUF checkpoints in and out of those modules.
  costs/     what a step costs on a device: the efficiency model, device figures and roofline,
             compile-only GPU targets, the HLO traffic and launch counters.
  tree/      the static-shape candidate tree and its verification: the uncertainty gate and
             repair paths, best-first growth, greedy and lossless-sampling verification, the
             online budget.
  methods/   one module per decoding method (ar, ar_draft, chain, cure, ddtree, hybrid) behind
             one interface, and the registry that maps a config's `method` to it.
  runtime/   the jitted loop (draft -> tree -> verify -> commit/resync), the host-side
             generator, sharding over a device mesh, and the pipeline from config to results.
  training/  DFlash drafter data (target features) and training.
  analysis/  diagnostics, the repair-utility scorer, iteration replay, pictures, random models.

checkpoints/ and costs/ sit side by side (each imports models/ at most). Entry points live
outside the package: `convert/` (checkpoint conversion commands) and `experiments/` (decoding,
benchmarks, compiles, training) drive all of it.
"""
