"""The Qwen3-MoE sparse MLP: a softmax router picks top_k of num_experts SwiGLU experts per token.

Experts are stacked ([E, in, out] kernels) and run as grouped matmuls, never as a Python loop
over experts nor as one dense pass through all of them. On NVIDIA GPUs every call is
kernels/gpu_grouped's Triton grouped matmul over rows sorted by expert (only routed experts'
weights are read, once, and nothing is copied); on TPUs the grouped calls below are megablox's
gmm (kernels/tpu_grouped), which skips experts no row routes to. Otherwise two lowerings, chosen
by the static token count N (batch x tokens of the call):

* 3 * N * top_k > num_experts (prefill, verification of blocks and trees): tokens are sorted by
  expert and the three projections are `jax.lax.ragged_dot` over the sorted rows with
  per-expert group sizes. On TPU XLA makes this a grouped-matmul kernel. On GPU, XLA (jax
  0.10.2) lowers ragged_dot densely: a masked copy of the rows per expert and one dot over every
  expert (measured for the Qwen3-MoE target on an H100: 128 tokens x 128 experts became a
  [128, 128, 2048] copy), so it reads every expert once.
* 3 * N * top_k <= num_experts (decoding a few tokens): each token's routed experts' weight
  slices are gathered and contracted per token. XLA's GPU compiler does not fuse the gather (nor
  a dynamic-slice) into the GEMM, so each slice is read, written as a copy and read again: three
  slices' traffic per token-slot (measured, H200 compile of Qwen3-Coder-30B-A3B: AR at batch 1
  moved 15.1 GB per step for 5.5 GB of weights read; a 16-token chain verify that gathered, 141
  GB). Gathering pays while that is below one read of every expert: up to 5 tokens per call for
  128 experts and 8 per token (AR at batch 1-5), ragged_dot above.

Numerics follow transformers' Qwen3MoeSparseMoeBlock: router logits in the activation dtype,
softmax in float32, top-k of the probabilities, renormalised when norm_topk_prob, cast back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from cure_jax.models.axes import DATA, MODEL
from cure_jax.models.kernels import gpu_grouped, tpu_grouped
from cure_jax.models.layers import linear


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int
  top_k: int
  intermediate_size: int              # each expert's (HF moe_intermediate_size)
  norm_topk_prob: bool
  sparse_layers: tuple[bool, ...]     # per decoder layer: sparse MLP (True) or dense SwiGLU

  @classmethod
  def from_hf(cls, config: dict, num_layers: int) -> "MoEConfig":
    """HF Qwen3-MoE fields; layer i is sparse unless listed in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0 (transformers' rule). transformers 5 saves num_experts
    as num_local_experts; the Hub configs say num_experts."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step", 1))
    dense = set(config.get("mlp_only_layers") or ())
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                   for i in range(num_layers))
    return cls(num_experts=experts, top_k=int(config["num_experts_per_tok"]),
               intermediate_size=int(config["moe_intermediate_size"]),
               norm_topk_prob=bool(config.get("norm_topk_prob", False)), sparse_layers=sparse)

  def gathers(self, tokens: int) -> bool:
    """Whether a call over `tokens` rows gathers expert slices (each costs 3 slice transfers,
    see above) instead of ragged_dot (every expert once on GPU)."""
    return 3 * tokens * self.top_k <= self.num_experts


class Kernel(nnx.Module):
  """One stacked projection [E, in, out]; named `kernel` so it is stored like nnx.Linear's
  (per expert [out, in] in HF files)."""

  def __init__(self, experts: int, din: int, dout: int, dtype, rngs: nnx.Rngs):
    init = jax.nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
    self.kernel = nnx.Param(init(rngs.params(), (experts, din, dout), dtype))


class Experts(nnx.Module):
  def __init__(self, cfg: MoEConfig, hidden: int, dtype, rngs: nnx.Rngs):
    e, i = cfg.num_experts, cfg.intermediate_size
    self.gate_proj = Kernel(e, hidden, i, dtype, rngs)
    self.up_proj = Kernel(e, hidden, i, dtype, rngs)
    self.down_proj = Kernel(e, i, hidden, dtype, rngs)

  def kernels(self):
    """(gate [E, H, I], up [E, H, I], down [E, I, H])."""
    return self.gate_proj.kernel[...], self.up_proj.kernel[...], self.down_proj.kernel[...]


def gathered(x, experts, wg, wu, wd):
  """x [N, H], experts [N, k] -> [N, k, H]: each token through its own experts' slices."""
  g = jnp.einsum("nh,nkhi->nki", x, wg[experts])                        # wg[experts] [N, k, H, I]
  u = jnp.einsum("nh,nkhi->nki", x, wu[experts])
  return jnp.einsum("nki,nkih->nkh", jax.nn.silu(g) * u, wd[experts])


def grouped(x, experts, wg, wu, wd, matmul=jax.lax.ragged_dot, pad: int = 0, swiglu=None):
  """x [N, H], experts [N, k] -> [N, k, H] through grouped matmuls (ragged_dot's contract) over
  rows sorted by expert; `pad` rows (copies of token 0) follow them for a matmul that wants
  them (gpu_grouped's). swiglu(x, source, wg, wu, sizes), if given, computes the experts' first
  half from the tokens and each sorted row's token `source` (no sorted copy of x)."""
  n, k = experts.shape
  flat = experts.reshape(-1)                                             # [N*k]
  order = jnp.argsort(flat, stable=True)
  source = jnp.concatenate([order // k, jnp.zeros((pad,), order.dtype)])  # [N*k + pad]
  sizes = jnp.bincount(flat, length=wg.shape[0]).astype(jnp.int32)       # [E]
  if swiglu is None:
    rows = x[source]                                                     # [N*k + pad, H] sorted
    h = jax.nn.silu(matmul(rows, wg, sizes)) * matmul(rows, wu, sizes)   # [N*k + pad, I]
  else:
    h = swiglu(x, source, wg, wu, sizes)
  y = matmul(h, wd, sizes)                                               # [N*k + pad, H]
  return y[jnp.argsort(order)].reshape(n, k, -1)


def mix(x, experts, weights, wg, wu, wd, gather: bool):
  """The weighted sum over each token's experts [N, H]. On NVIDIA GPUs every call goes through
  gpu_grouped's kernels (routed experts read once, no copies: below both XLA lowerings); on TPUs
  the grouped calls go through megablox's gmm (tpu_grouped), which skips unrouted experts."""
  n, k = experts.shape
  weigh = lambda y: jnp.einsum("nkh,nk->nh", y, weights)                 # noqa: E731
  xla = lambda *a: weigh((gathered if gather else grouped)(*a))          # noqa: E731
  platforms = {}
  if gpu_grouped.tiles(*wg.shape[1:]) and gpu_grouped.tiles(*wd.shape[1:]):
    gpu = functools.partial(gpu_grouped.grouped_matmul, tokens=n, top_k=k)
    gate_up = functools.partial(gpu_grouped.swiglu, tokens=n, top_k=k)
    platforms["cuda"] = lambda *a: weigh(grouped(*a, matmul=gpu, pad=gpu_grouped.PAD_ROWS,
                                                 swiglu=gate_up))
  if not gather:
    tpu = functools.partial(tpu_grouped.grouped_matmul, tokens=n, top_k=k)
    pad = -(n * k) % tpu_grouped.row_tile(n * k)
    platforms["tpu"] = lambda *a: weigh(grouped(*a, matmul=tpu, pad=pad))
  if not platforms:
    return xla(x, experts, wg, wu, wd)
  return jax.lax.platform_dependent(x, experts, wg, wu, wd, **platforms, default=xla)


class SparseMoE(nnx.Module):
  """HF names: `gate` (the router, [E, H] in HF files) and `experts.{gate,up,down}_proj`."""

  def __init__(self, cfg: MoEConfig, hidden: int, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    self.gate = linear(hidden, cfg.num_experts, dtype, rngs)
    self.experts = Experts(cfg, hidden, dtype, rngs)

  def route(self, x):
    """x [N, H] -> routing weights [N, k] (x's dtype) and expert ids [N, k]."""
    probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)   # [N, E]
    weights, experts = jax.lax.top_k(probs, self.cfg.top_k)
    if self.cfg.norm_topk_prob:
      weights = weights / weights.sum(-1, keepdims=True)
    return weights.astype(x.dtype), experts

  def __call__(self, x):
    """x [..., H] -> [..., H].

    Under a mesh whose `model` axis splits the experts' intermediate axis (the runtime's
    partition rules), each shard runs its slice of every expert in a shard_map and a psum over
    `model` adds the partial outputs, as after a dense down_proj: the dispatch is explicit
    rather than left to how sharding propagation partitions ragged_dot (on v6e 2x4, chain at
    batch 8, both compile to the same per-chip traffic, each ragged-dot reading its quarter of
    every expert).
    """
    flat = x.reshape(-1, x.shape[-1])                                    # [N, H]
    weights, experts = self.route(flat)
    run = functools.partial(mix, gather=self.cfg.gathers(flat.shape[0]))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(MODEL, 1) == 1:
      return run(flat, experts, weights, *self.experts.kernels()).reshape(x.shape)
    rows = P(DATA) if DATA in mesh.shape and flat.shape[0] % mesh.shape[DATA] == 0 else P()
    split = (P(None, None, MODEL), P(None, None, MODEL), P(None, MODEL, None))
    out = jax.shard_map(lambda *a: jax.lax.psum(run(*a), MODEL), mesh=mesh,
                        in_specs=(rows, rows, rows) + split, out_specs=rows,
                        check_vma=False)(flat, experts, weights, *self.experts.kernels())
    return out.reshape(x.shape)
