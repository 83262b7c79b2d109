"""The target decoder: Qwen3, Qwen3-MoE (sparse MLPs from models/moe.py in the layers its config
marks), and Llama-family models (Qwen3 without the per-head q/k norms).

The forward pass is functional: it reads a KV cache of committed tokens, attends over
[cache slots ; new tokens] under an explicit boolean mask, and returns the new tokens' keys and
values instead of writing them, so one call serves prefill, single-token decoding, block
verification and tree verification alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cure_jax.models.cache import KVCache
from cure_jax.models import layer_kernels, numerics
from cure_jax.models.kernels import blocks, gpu_layer, prefix as prefix_attention
from cure_jax.models.layers import (Linear, RMSNorm, Rope, SwiGLU, attend, einsum_f32,
                                    embed_lookup, linear, max_argmax, rope_from_hf)
from cure_jax.models.moe import MoEConfig, SparseMoE

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_eps: float
  rope: Rope
  tie_embeddings: bool
  moe: MoEConfig | None = None        # Qwen3-MoE: experts and which layers are sparse

  @property
  def qk_norm(self) -> bool:
    return self.model_type in ("qwen3", "qwen3_moe")

  @classmethod
  def from_hf(cls, config: dict) -> "ModelConfig":
    """Reads a transformers config.json dict; rejects what this decoder does not compute."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"config.json has model_type={model_type!r}; this target decoder supports "
                       f"{SUPPORTED_MODEL_TYPES}. Point target.path at a Qwen3, Qwen3-MoE or Llama "
                       "checkpoint.")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
      if config.get(flag):
        raise ValueError(f"config.json sets {flag}=true, which this decoder does not implement.")
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % kv_heads:
      raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    layers = int(config["num_hidden_layers"])
    return cls(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(config, head_dim),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=MoEConfig.from_hf(config, layers) if model_type == "qwen3_moe" else None,
    )


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    h, d = cfg.hidden_size, cfg.head_dim
    self.q_proj = linear(h, cfg.num_heads * d, dtype, rngs)
    self.k_proj = linear(h, cfg.num_kv_heads * d, dtype, rngs)
    self.v_proj = linear(h, cfg.num_kv_heads * d, dtype, rngs)
    self.o_proj = linear(cfg.num_heads * d, h, dtype, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, cfg.rms_eps, dtype)
      self.k_norm = RMSNorm(d, cfg.rms_eps, dtype)

  def __call__(self, x, positions, k_old, v_old, mask, exponents=None):
    """x [B, T, H]; mask as `cached` takes it or a prompt chunk's Prefix; exponents: numerics=
    invariant's bound on the values (layers.attend). Returns the output [B, T, H] and this
    layer's new (k, v) [B, T, KVH, D]; for a Prefix, its cache (k, v) [B, KVH, S, D] with the
    chunk written in."""
    b, t, _ = x.shape
    cfg = self.cfg
    q, k, v = jax.lax.optimization_barrier((self.q_proj(x), self.k_proj(x), self.v_proj(x)))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = cfg.rope(q, positions), cfg.rope(k, positions)
    if isinstance(mask, prefix_attention.Prefix):
      out, k, v = prefix_attention.attend(q, k_old, v_old, k, v, mask, exponents)  # [B,T,H,D]
    else:
      out = cached(q, k, v, k_old, v_old, mask, exponents)
    return self.o_proj(out.reshape(b, t, -1)), (k, v)


def cached(q, k, v, k_old, v_old, mask, exponents=None):
  """Attention of q [B, T, H, D] over the cache and the new k, v [B, T, KVH, D] under mask
  [B, T, S + T] or a pair (over the cache [B, T or 1, S], over the new tokens [B, T, T]):
  [B, T, H, D]."""
  if isinstance(mask, tuple):
    old, new = mask
  else:
    s = k_old.shape[2]
    old, new = mask[..., :s], mask[..., s:]
  return attend(q[:, None], k_old, v_old, k[:, None], v[:, None], old[:, None], new[:, None],
                exponents=exponents)[:, 0]


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, sparse: bool = False):
    self.self_attn = Attention(cfg, dtype, rngs)
    self.mlp = (SparseMoE(cfg.moe, cfg.hidden_size, dtype, rngs) if sparse
                else SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, rngs))
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)

  def __call__(self, x, positions, k_old, v_old, mask, kernels: bool = False):
    """kernels: on an NVIDIA GPU, decoding's rows (up to gpu_layer.MAX_ROWS) go through
    gpu_layer's kernels (`through_kernels`) where they take the layer."""
    if (kernels and not isinstance(mask, prefix_attention.Prefix)
        and layer_kernels.takes(self, x.shape[0] * x.shape[1])):
      return layer_kernels.on_gpu(self.through_kernels, self._xla, x, positions, k_old, v_old,
                                  mask)
    return self._xla(x, positions, k_old, v_old, mask)

  def _xla(self, x, positions, k_old, v_old, mask):
    exponents = self.value_exponents[...] if numerics.invariant() else None
    attn, kv = self.self_attn(self.input_layernorm(x), positions, k_old, v_old, mask, exponents)
    x = x + attn
    return x + self.mlp(self.post_attention_layernorm(x)), kv

  def hold_exponents(self, on: bool) -> None:
    """Holds numerics=invariant's bound on this layer's values (numerics.value_exponents of its
    weights, `value_exponents` [KVH * D]) or drops it. Computed once, when the mode is entered:
    computed in each step instead, it read v_proj's weights again every iteration (XLA does not
    hoist it out of the conditional in decoding's loop: 0.3 GB an iteration for Qwen3-8B)."""
    if not on:
      if hasattr(self, "value_exponents"):
        del self.value_exponents
      return
    args = (self.self_attn.v_proj.kernel_rows.get_value(), self.input_layernorm.weight.get_value())
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in args)   # compile-only models
    bound = (jax.eval_shape(numerics.value_exponents, *args) if abstract
             else numerics.value_exponents(*args))
    self.value_exponents = nnx.Variable(bound)

  def through_kernels(self, x, positions, k_old, v_old, mask, *, interpret: bool = False):
    """__call__ as gpu_layer's kernels (x [B, T, H], B x T rows at most gpu_layer.MAX_ROWS)."""
    cfg = self.self_attn.cfg
    b, t, hidden = x.shape
    cos, sin = (p.reshape(b * t, -1) for p in cfg.rope.phases(positions))

    def rows_attend(q, k, v):            # rows -> the cache's [B, T, heads, D] and back
      out = cached(q.reshape(b, t, cfg.num_heads, -1), k.reshape(b, t, cfg.num_kv_heads, -1),
                   v.reshape(b, t, cfg.num_kv_heads, -1), k_old, v_old, mask)
      return out.reshape(b * t, cfg.num_heads, -1)

    rows, kv = layer_kernels.through_kernels(self, x.reshape(b * t, hidden), cos, sin,
                                             rows_attend, interpret=interpret)
    return rows.reshape(b, t, hidden), tuple(y.reshape(b, t, *y.shape[1:]) for y in kv)


class Output(NamedTuple):
  hidden: jax.Array | None    # [B, T, H] after the final norm (None: a shallower `depth`)
  k: tuple[jax.Array, ...]    # L x [B, T, KVH, D] keys of the new tokens (not yet committed);
                              # for a prompt chunk, L x [B, KVH, S, D] the caches it wrote
  v: tuple[jax.Array, ...]    # as k
  features: jax.Array | None  # [B, T, n * H] chosen hidden states, concatenated in order


class Qwen3(nnx.Module):
  """Qwen3 / Qwen3-MoE / Llama decoder. Parameter names mirror transformers' (kernels
  transposed; experts stacked [E, in, out], stored per expert)."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.cfg = cfg
    self.dtype = dtype
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                  rngs=rngs)
    sparse = cfg.moe.sparse_layers if cfg.moe else (False,) * cfg.num_layers
    self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, s) for s in sparse])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)
    if not cfg.tie_embeddings:
      self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs)
    self._numerics = "default"
    self.layer_kernels = True   # NVIDIA GPUs: decoding's rows through gpu_layer's kernels

  @property
  def numerics(self) -> str:
    """The forward pass's numerics mode (numerics.MODES); the runtime sets it from
    config.numerics. Setting "invariant" holds every projection's kernel as rows
    (Linear.hold_rows), which that mode multiplies, and each layer's bound on its values
    (DecoderLayer.hold_exponents); setting "default" holds them back. Weights changed in
    invariant mode need the mode set again."""
    return self._numerics

  @numerics.setter
  def numerics(self, mode: str) -> None:
    if mode not in numerics.MODES:
      raise ValueError(f"numerics={mode!r}: expected one of {', '.join(numerics.MODES)}")
    if mode == "invariant" and self.cfg.moe:
      raise ValueError("numerics=invariant covers dense targets; this one is a mixture of "
                       "experts (its expert products are not row-invariant): use "
                       "numerics=default")
    for _, module in nnx.iter_modules(self):
      if isinstance(module, Linear):
        module.hold_rows(mode == "invariant")
    for layer in self.layers:
      layer.hold_exponents(mode == "invariant")
    self._numerics = mode

  def embed(self, tokens):
    return embed_lookup(self.embed_tokens.embedding[...], tokens)

  def logits(self, hidden):
    """Float32 logits [..., V] from final hidden states [..., H]."""
    if self.numerics == "invariant":
      return numerics.matmul(hidden, self.head_weight())
    return einsum_f32("...h,vh->...v", hidden, self.head_weight())

  def greedy(self, hidden, ids=None, rows=None):
    """The argmax of logits(hidden) [..., H] -> [...] int32, the first of equal maxima; with
    ids [N] (sorted token ids), the id of the argmax of logits_rows(hidden, ids, rows). On NVIDIA
    GPUs (layer_kernels, default numerics, one device) without writing the float32 logits
    (gpu_layer.head_argmax)."""
    lead, h = hidden.shape[:-1], hidden.shape[-1]
    n = self.cfg.vocab_size if ids is None else len(ids)
    if not (self.layer_kernels and self.numerics == "default" and blocks.one_device()
            and gpu_layer.head_takes(math.prod(lead), h, n)):
      best = self._argmax(hidden, ids, rows)
    else:
      by_rows = self._head_by_rows()
      if ids is not None:
        head = self.head_rows(ids) if rows is None else rows
      else:
        head = self.head_weight() if by_rows else self.lm_head.kernel[...]

      def gpu(x, w, interpret: bool = False):
        return gpu_layer.head_argmax(x.reshape(-1, h), w, by_rows=by_rows,
                                     interpret=interpret).reshape(lead)

      best = layer_kernels.on_gpu(gpu, lambda x, w: self._argmax(x, ids, w), hidden, head)
    return best if ids is None else jnp.asarray(ids, jnp.int32)[best]

  def _argmax(self, hidden, ids=None, rows=None):
    logits = self.logits(hidden) if ids is None else self.logits_rows(hidden, ids, rows)
    return max_argmax(logits)[1]

  def head_weight(self):
    """The head's weights as vocabulary rows [V, H]: the embedding when tied."""
    if self.cfg.tie_embeddings:
      return self.embed_tokens.embedding[...]
    if self.lm_head.held_as_rows:
      return self.lm_head.kernel_rows[...]
    return self.lm_head.kernel[...].T

  def _head_by_rows(self) -> bool:
    return self.cfg.tie_embeddings or self.lm_head.held_as_rows

  def head_rows(self, ids):
    """The head's weights of the vocabulary entries ids [N] only: [N, H] when the head is held
    as rows (tied, or numerics=invariant), else [H, N]."""
    if self._head_by_rows():
      return jnp.take(self.head_weight(), ids, axis=0)
    return jnp.take(self.lm_head.kernel[...], ids, axis=1)

  def logits_rows(self, hidden, ids, rows=None):
    """Float32 logits [..., N] of the vocabulary entries ids [N] only: the head read is N of its
    V rows (a drafter that scores a reduced vocabulary); rows: head_rows(ids), gathered before."""
    w = self.head_rows(ids) if rows is None else rows
    spec = "...h,nh->...n" if self._head_by_rows() else "...h,hn->...n"
    return einsum_f32(spec, hidden, w)

  def __call__(self, tokens, positions, cache: KVCache, mask, feature_layers: tuple[int, ...] = (),
               depth: int | None = None):
    """tokens, positions [B, T]; mask [B, T, S + T] over [cache slots ; new tokens], or the
    pair (over the cache [B, T or 1, S], over the new tokens [B, T, T]), or a Prefix when the
    tokens are a prompt chunk (chunked prefill): then the output's k and v are
    the cache's layers with the chunk written in (`cache.replace(k=.., v=..).advance(count)`).

    feature_layers uses the transformers `hidden_states` index: 0 is the embedding output, i the
    output of layer i, and num_layers the final normed output. depth < num_layers runs the first
    `depth` layers only (features up to hidden_states[depth]; no final hidden state, and the
    cache needs only those layers).
    """
    with numerics.mode(self.numerics):
      return self._forward(tokens, positions, cache, mask, feature_layers,
                           self.cfg.num_layers if depth is None else depth)

  def _forward(self, tokens, positions, cache: KVCache, mask, feature_layers, depth: int):
    x = self.embed(tokens)
    states = {0: x}
    ks, vs = [], []
    for i, layer in enumerate(self.layers[:depth]):
      x, (k, v) = layer(x, positions, cache.k[i], cache.v[i], mask, self.layer_kernels)
      ks.append(k)
      vs.append(v)
      states[i + 1] = x
    hidden = None
    if depth == self.cfg.num_layers:
      hidden = self.norm(x)
      states[depth] = hidden
    features = (jnp.concatenate([states[i] for i in feature_layers], axis=-1)
                if feature_layers else None)
    return Output(hidden, tuple(ks), tuple(vs), features)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.cfg
    return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype)
