"""What a decoding (or training) step costs on a device: measured here, or counted from compiled
programs.

  efficiency   the paper's efficiency model, tokens/s ∝ (E[a] + 1) / (C_d + C_v(n)), and the
               costs it takes, timed on the running device
  roofline     per-device peak figures; a decode iteration's time from its compiled counts
  gpu_targets  compile-only NVIDIA GPUs (XLA's GPU compiler without a GPU), and TPU topologies
  hlo_text     optimized HLO text read into computations, instructions and shapes
  hlo_traffic  HBM traffic, FLOPs and bytes sent of a compiled program, op by op, under stated
               rules
  refusals     what a compiler's refusal says a program needs
  launches     kernels and host launches per iteration from XLA GPU's thunk sequence

Below the runtime (it imports models at most), so the loop's budgets and the entry points'
projections share it.
"""
