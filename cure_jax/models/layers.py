"""Building blocks shared by the target decoder and the block drafter.

Everything numerically sensitive (norms, softmax, rotary phases) runs in float32 whatever the
parameter dtype, the way the Hugging Face reference does it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from cure_jax.models import numerics
from cure_jax.models.axes import DATA, MODEL
from cure_jax.models.kernels import cpu_attention, gpu_attention, tpu_attention


def max_argmax(x):
  """(max, index of its first occurrence) over the last axis of x [..., N] -> ([...], [...]
  int32), as jnp.max and jnp.argmax (a NaN counts as the maximum).

  XLA:CPU reduces argmax's (value, index) pairs one element at a time, unvectorized (~0.5 ms
  over SmolLM2's 15 x 8,192 draft logits); there it is two plain reductions, a max and a min
  over the indices that hold it. Other platforms keep jnp.argmax."""
  def reductions(x):
    top = jnp.max(x, axis=-1)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top[..., None]) | jnp.isnan(x)
    return top, jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)

  def pairs(x):
    i = jnp.argmax(x, axis=-1)
    return jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0], i.astype(jnp.int32)
  return jax.lax.platform_dependent(x, cpu=reductions, default=pairs)


class RMSNorm(nnx.Module):
  """RMSNorm with the HF parameter name `weight`: normalise in float32, cast, then scale."""

  def __init__(self, dim: int, eps: float, dtype):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    squares = x32 * x32
    mean = (numerics.tree_sum(squares)[..., None] / x.shape[-1] if numerics.invariant() else
            jnp.mean(squares, axis=-1, keepdims=True))
    x32 = x32 * jax.lax.rsqrt(mean + self.eps)
    return self.weight[...] * x32.astype(x.dtype)


class Linear(nnx.Linear):
  """nnx.Linear whose one-row products stay GEMMs on NVIDIA GPUs. XLA's GPU compiler rewrites a
  one-row matmul ("dot strength reduction") into a multiply that writes a weight-sized
  intermediate and a reduce that reads it back: three times the weight's traffic
  (Qwen3-Coder-30B-A3B, ar at batch 1, compiled for an H200: 3.3 of the step's 10.4 GB). There a
  zero second row keeps it a GEMM that reads the weight once; its output row is dropped. Other
  platforms multiply the one row as it is: on CPU the second row doubles the work of a
  projection (target-only decoding 1.3x slower).

  In numerics=invariant the kernel is held as rows, [out, in] (`kernel_rows`, set by
  hold_rows), and multiplied weight-first (numerics.matmul): XLA:CPU runs a product of a few
  rows by a [in, out] kernel through a GEMM that repacks the kernel on every call (30 layers of
  the embedded default's projections at two rows: 1.4x the one-row GEMV's time), and one by
  [out, in] rows, read in place, at the GEMV's speed."""

  def __call__(self, x):
    if numerics.invariant():
      return numerics.matmul(x, self.kernel_rows[...], self.dtype)
    if math.prod(x.shape[:-1]) != 1:
      return super().__call__(x)
    return jax.lax.platform_dependent(x, cuda=self._two_rows, default=super().__call__)

  def _two_rows(self, x):
    two = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0)))                   # [2, in]
    return super().__call__(two)[:1].reshape(x.shape[:-1] + (-1,))

  @property
  def held_as_rows(self) -> bool:
    return hasattr(self, "kernel_rows")

  def hold_rows(self, rows: bool) -> None:
    """Holds the kernel as [out, in] `kernel_rows` (rows=True) or as nnx's [in, out] `kernel`:
    one transposed copy, made once; a parameter is held one way only."""
    if rows == self.held_as_rows:
      return
    if rows:
      self.kernel_rows = nnx.Param(_transposed(self.kernel.get_value()))
      del self.kernel
    else:
      self.kernel = nnx.Param(_transposed(self.kernel_rows.get_value()))
      del self.kernel_rows

  def columns(self):
    """The kernel as [in, out], however it is held."""
    return _transposed(self.kernel_rows[...]) if self.held_as_rows else self.kernel[...]


def _transposed(x):
  """x.T of an array, or of an abstract one (nnx.eval_shape's parameters, for compile-only)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape[::-1], x.dtype)
  return x.T


def linear(din: int, dout: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free projection; kernels are [in, out] (HF stores [out, in])."""
  return Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class SwiGLU(nnx.Module):
  def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
    self.gate_proj = linear(hidden, intermediate, dtype, rngs)
    self.up_proj = linear(hidden, intermediate, dtype, rngs)
    self.down_proj = linear(intermediate, hidden, dtype, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary embedding settings from a checkpoint's config.json: default, linear, llama3 and yarn
  (Qwen3's 131,072-token context: factor 4 over its original 32,768), as transformers computes
  them."""

  head_dim: int
  theta: float
  kind: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  beta_fast: float = 32.0           # yarn: rotations bounding the extrapolated band
  beta_slow: float = 1.0            # yarn: rotations bounding the interpolated band
  truncate: bool = True             # yarn: round the band's ends outward
  attention_factor: float = 1.0     # yarn: cos and sin are scaled by this

  def inv_freq(self) -> jnp.ndarray:
    inv = 1.0 / (self.theta ** (jnp.arange(0, self.head_dim, 2, dtype=jnp.float32) / self.head_dim))
    if self.kind == "linear":
      return inv / self.factor
    if self.kind == "llama3":
      wavelen = 2 * math.pi / inv
      low_wavelen = self.original_max_position / self.low_freq_factor
      high_wavelen = self.original_max_position / self.high_freq_factor
      smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
          self.high_freq_factor - self.low_freq_factor)
      mid = (1 - smooth) * inv / self.factor + smooth * inv
      scaled = jnp.where(wavelen > low_wavelen, inv / self.factor, inv)
      is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
      return jnp.where(is_mid, mid, scaled)
    if self.kind == "yarn":
      low, high = (self._yarn_dim(r) for r in (self.beta_fast, self.beta_slow))
      if self.truncate:
        low, high = math.floor(low), math.ceil(high)
      low, high = max(low, 0), min(high, self.head_dim - 1)
      high = high + 0.001 if low == high else high
      ramp = jnp.clip((jnp.arange(self.head_dim // 2, dtype=jnp.float32) - low) / (high - low),
                      0, 1)                                   # 0: extrapolate, 1: interpolate
      return inv / self.factor * ramp + inv * (1 - ramp)
    return inv

  def _yarn_dim(self, rotations: float) -> float:
    """The dimension whose wavelength fits `rotations` times in the original window."""
    return (self.head_dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) /
            (2 * math.log(self.theta)))

  def phases(self, positions):
    """cos and sin [..., T, D/2] float32 of positions [..., T]: both halves of a head turn by
    the same angles."""
    angles = positions.astype(jnp.float32)[..., None] * self.inv_freq()  # [..., T, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if self.attention_factor != 1.0:
      cos, sin = cos * self.attention_factor, sin * self.attention_factor
    return cos, sin

  def __call__(self, x, positions):
    """Rotates x [..., T, heads, D] by positions [..., T] (HF's rotate_half layout)."""
    cos, sin = (jnp.concatenate([p, p], axis=-1)[..., None, :]             # [..., T, 1, D]
                for p in self.phases(positions))
    x32 = x.astype(jnp.float32)
    half = self.head_dim // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_from_hf(config: dict, head_dim: int) -> Rope:
  """Reads rope_theta / rope_scaling (or transformers 5's rope_parameters) from config.json."""
  params = dict(config.get("rope_parameters") or {})
  scaling = config.get("rope_scaling") or {}
  params.update(scaling)
  kind = params.get("rope_type", params.get("type", "default")) or "default"
  theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
  if kind not in ROPE_KINDS:
    raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)}); "
                     "edit rope_scaling in config.json or add the variant to cure_jax/models/layers.py")
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported (every head dimension rotates)")
  original = int(params.get("original_max_position_embeddings")
                 or config.get("max_position_embeddings") or 8192)
  factor = params.get("factor")
  if factor is None:
    factor = config.get("max_position_embeddings", original) / original if kind == "yarn" else 1.0
  factor = float(factor)
  attention_factor = 1.0
  if kind == "yarn":
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
      mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
      attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                          if mscale and mscale_all else _yarn_mscale(factor))
  return Rope(
      head_dim=head_dim,
      theta=theta,
      kind=kind,
      factor=factor,
      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
      original_max_position=original,
      beta_fast=float(params.get("beta_fast") or 32.0),
      beta_slow=float(params.get("beta_slow") or 1.0),
      truncate=bool(params.get("truncate", True)),
      attention_factor=float(attention_factor),
  )


def embed_lookup(table, tokens):
  """Rows of an embedding table [V, H] for tokens [B, ...] -> [B, ..., H].

  Under a mesh whose `model` axis splits the vocabulary (the runtime's partition rules), each
  shard looks the tokens up in its own rows, zeros the rest, and a sum over `model` adds the
  shards' rows (Megatron's vocabulary-parallel embedding): one [B, ..., H] all-reduce. Left to
  itself, XLA's GPU partitioner all-gathers the whole table instead, every iteration (1.2 GB
  for Qwen3-8B at 8-way tensor parallelism).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get(MODEL, 1) == 1:
    return table[tokens]

  def local(rows, ids):                          # rows [V / model, H], ids [B / data, ...]
    ids = ids - jax.lax.axis_index(MODEL) * rows.shape[0]
    mine = (ids >= 0) & (ids < rows.shape[0])
    out = jnp.where(mine[..., None], rows[jnp.clip(ids, 0, rows.shape[0] - 1)], 0)
    return jax.lax.psum(out, MODEL)

  batch = P(DATA) if DATA in mesh.shape else P()
  return jax.shard_map(local, mesh=mesh, in_specs=(P(MODEL, None), batch), out_specs=batch,
                       check_vma=False)(table, tokens)


def einsum_f32(spec: str, a, b):
  """jnp.einsum(spec, a, b) summed in and returned as float32: every float32-result product of
  the models (attention scores and value sums, logits) goes through here.

  GPU and TPU take bfloat16 operands as they are (their native dot). XLA:CPU runs most bfloat16 x
  bfloat16 -> float32 dots in its YNNPACK fusions, but one it leaves to its generic dot thunk
  fails at run time ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"; at
  batch > 1 the decode loop's probabilities x cached values, which contracts the cache's slot
  axis). Which dots those are depends on the shapes and layouts XLA picks, so on CPU every such
  product upcasts its operands first: exact (every bfloat16 is a float32), the same products
  summed in float32, as XLA:CPU already does for its bfloat16-result dots. Float32 operands take
  the plain einsum on every platform, decided here from the static dtypes: their programs are
  unchanged.
  """
  dot = functools.partial(jnp.einsum, spec, preferred_element_type=jnp.float32)
  if jnp.result_type(a, b) == jnp.float32:
    return dot(a, b)
  return jax.lax.platform_dependent(
      a, b, cpu=lambda a, b: dot(a.astype(jnp.float32), b.astype(jnp.float32)), default=dot)


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, *, kernel: bool = True,
           exponents=None):
  """Grouped-query attention over [old slots ; new tokens] without concatenating the caches.

  q: [B, A, T, H, D] queries (A = independent blocks that share the same old context);
  k_old/v_old: [B, KVH, S, D] cached keys/values (the cache's layout); k_new/v_new: [B, A, U, KVH, D];
  mask_old: [B, A, T, S], mask_new: [B, A, T, U] booleans (True = visible).
  Returns [B, A, T, H, D].
  exponents: numerics=invariant's bound on the values, [KVH * D] (numerics.value_exponents).

  On TPU this is tpu_attention's Pallas kernel and on NVIDIA GPUs gpu_attention's (Triton), which
  keep the scores on chip; on CPU it is cpu_attention's, which reads the cache in its own layout
  and, for a short context in a long cache, only the blocks in use. Elsewhere it is xla_attend,
  and so it is with kernel=False (the kernels and the CPU form's loop of dynamic length have no
  gradient: training passes False) and for caches a kernel does not tile (an empty one, as in
  prefill, or one not in whole blocks of slots).
  """
  args = (q, k_old, v_old, k_new, v_new, mask_old, mask_new)
  if numerics.invariant():
    return numerics.attend(*args, exponents)
  if not kernel:
    return xla_attend(*args)
  s, groups, head_dim = k_old.shape[2], q.shape[3] // k_old.shape[1], q.shape[4]
  platforms = {"cpu": cpu_attention.attend}
  if tpu_attention.tiles(s):
    platforms["tpu"] = tpu_attention.attend
  if gpu_attention.tiles(s, groups, head_dim):
    platforms["cuda"] = gpu_attention.attend
  return jax.lax.platform_dependent(*args, **platforms, default=xla_attend)


def xla_attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new):
  """attend as XLA tensors.

  The softmax is normalised after the value products (as flash attention does): the two parts'
  exponentials feed their own products directly, so no [.., S + U] probability tensor is built.
  Built as one normalised tensor, XLA's TPU compiler wrote it to HBM and read it back in every
  layer (CURE's re-draft at batch 8: ~80 MB a drafter layer).
  """
  b, a, t, h, d = q.shape
  kvh = k_old.shape[1]
  qg = q.reshape(b, a, t, kvh, h // kvh, d)
  scale = 1.0 / math.sqrt(d)
  s_old = einsum_f32("batkgd,bksd->bakgts", qg, k_old)
  s_new = einsum_f32("batkgd,baukd->bakgtu", qg, k_new)
  neg = jnp.finfo(jnp.float32).min
  s_old = jnp.where(mask_old[:, :, None, None], s_old * scale, neg)
  s_new = jnp.where(mask_new[:, :, None, None], s_new * scale, neg)
  # initial: an empty part (a prompt's empty cache) has no maximum of its own
  top = jnp.maximum(s_old.max(-1, initial=neg), s_new.max(-1, initial=neg))[..., None]
  e_old, e_new = jnp.exp(s_old - top), jnp.exp(s_new - top)
  total = e_old.sum(-1) + e_new.sum(-1)                                  # [B, A, KVH, G, T]
  out = (einsum_f32("bakgts,bksd->batkgd", e_old.astype(v_old.dtype), v_old) +
         einsum_f32("bakgtu,baukd->batkgd", e_new.astype(v_new.dtype), v_new))
  out = out / total.transpose(0, 1, 4, 2, 3)[..., None]                  # [B, A, T, KVH, G, D]
  return out.reshape(b, a, t, h, d).astype(q.dtype)
