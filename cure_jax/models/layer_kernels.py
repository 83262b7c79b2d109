"""A pre-norm decoder layer over decoding's rows as gpu_layer's five kernels (NVIDIA GPUs).

The target's layers (qwen3.DecoderLayer) and the DFlash drafter's (dflash.DraftLayer) are the
same layer around different attention: input norm, q/k/v with per-head norms and rope, attention
over the caller's cache, o_proj with the residual, the second norm with gate/up and silu,
down_proj with the residual. Through XLA's fusions a layer was about 25 kernels on an H100, with
split-K partials of every GEMM written to HBM and read back; through these, five.
"""

from __future__ import annotations

import jax

from cure_jax.models import numerics
from cure_jax.models.kernels import blocks, gpu_layer
from cure_jax.models.layers import SwiGLU


def on_gpu(gpu, other, *args):
  """gpu(*args) on NVIDIA GPUs, other(*args) elsewhere (the tests' seam to run the GPU form,
  interpreted, on CPU)."""
  return jax.lax.platform_dependent(*args, cuda=gpu, default=other)


def takes(layer, rows: int) -> bool:
  """Whether `layer` over this many rows runs through the kernels: a dense SwiGLU layer whose
  sizes the kernels tile, on one device, in the default numerics."""
  cfg = layer.self_attn.cfg
  return (isinstance(layer.mlp, SwiGLU) and not numerics.invariant() and blocks.one_device()
          and gpu_layer.takes(rows, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim))


def through_kernels(layer, x, cos, sin, attend, *, interpret: bool = False):
  """`layer` over rows x [N, H], rope's phases cos/sin [N, D/2]; attend(q [N, heads, D],
  k, v [N, KVH, D]) -> [N, heads, D] is the caller's attention over its cache. Returns the
  rows after the layer and the rows' k, v [N, KVH, D]."""
  attn, mlp, cfg = layer.self_attn, layer.mlp, layer.self_attn.cfg
  n, d = x.shape[0], cfg.head_dim
  norms = ((attn.q_norm.weight[...], attn.k_norm.weight[...]) if hasattr(attn, "q_norm")
           else (None, None))
  q, k, v = gpu_layer.qkv(x, layer.input_layernorm.weight[...], attn.q_proj.kernel[...],
                          attn.k_proj.kernel[...], attn.v_proj.kernel[...], *norms, cos, sin,
                          eps=cfg.rms_eps, head_dim=d, interpret=interpret)
  k, v = (y.reshape(n, cfg.num_kv_heads, d) for y in (k, v))
  out = attend(q.reshape(n, cfg.num_heads, d), k, v)                      # [N, heads, D]
  x = gpu_layer.project(out.reshape(n, -1), attn.o_proj.kernel[...], x, interpret=interpret)
  h = gpu_layer.swiglu(x, layer.post_attention_layernorm.weight[...], mlp.gate_proj.kernel[...],
                       mlp.up_proj.kernel[...], eps=cfg.rms_eps, interpret=interpret)
  return gpu_layer.project(h, mlp.down_proj.kernel[...], x, interpret=interpret), (k, v)
