"""The DFlash block drafter: a Qwen3-style stack that drafts a whole block in one pass.

It has no embedding or output head of its own (it borrows the target's). Every layer attends
with queries from the block only and keys/values from [context ; block], where the context is
`hidden_norm(fc(concat(target hidden_states[id + 1] for id in target_layer_ids)))` of verified
tokens. The context keys/values are projected once per layer and cached (`context_kv`); the
block is bidirectional and sees all of the context.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.models import layer_kernels
from cure_jax.models.cache import KVCache
from cure_jax.models.layers import RMSNorm, Rope, SwiGLU, attend, linear, rope_from_hf


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """DFlash's default: draft layers spread evenly over target layers 1..L-3."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_eps: float
  rope: Rope
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]
  num_target_layers: int
  input_embedding_scale: float = 1.0
  output_multiplier: float = 1.0
  logit_softcap: float | None = None

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The target `hidden_states` indices that feed the drafter (the +1 convention)."""
    return tuple(i + 1 for i in self.target_layer_ids)

  @classmethod
  def from_hf(cls, config: dict) -> "DFlashConfig":
    dflash = config.get("dflash_config") or {}

    def value(name, default=None):
      return dflash.get(name, config.get(name, default))

    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    layers = int(config["num_hidden_layers"])
    num_target_layers = int(value("num_target_layers", 0) or 0)
    ids = value("target_layer_ids")
    if ids is None:
      if not num_target_layers:
        raise ValueError("drafter config.json has neither dflash_config.target_layer_ids nor "
                         "num_target_layers; add one of them.")
      ids = default_target_layer_ids(num_target_layers, layers)
    if value("mask_token_id") is None:
      raise ValueError("drafter config.json lacks dflash_config.mask_token_id.")
    if config.get("layer_types") and any(t != "full_attention" for t in config["layer_types"]):
      raise ValueError("sliding-window drafter layers are not supported; use full attention.")
    if config.get("is_causal"):
      raise ValueError("a causal DFlash drafter is not supported: the block must be bidirectional.")
    softcap = value("final_logit_softcapping")
    return cls(
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(config, head_dim),
        block_size=int(value("block_size", 16)),
        mask_token_id=int(value("mask_token_id")),
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=num_target_layers,
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        output_multiplier=float(value("output_multiplier", 1.0)),
        logit_softcap=float(softcap) if softcap else None,
    )

  def check_against(self, target_cfg) -> None:
    """Fails before anything compiles when the drafter cannot sit on this target."""
    problems = []
    if self.hidden_size != target_cfg.hidden_size:
      problems.append(f"drafter hidden_size {self.hidden_size} != target hidden_size "
                      f"{target_cfg.hidden_size}")
    bad = [i for i in self.target_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
      problems.append(f"target_layer_ids {bad} are outside the target's {target_cfg.num_layers} "
                      "layers")
    if not 0 <= self.mask_token_id < target_cfg.vocab_size:
      problems.append(f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                      f"({target_cfg.vocab_size})")
    if self.block_size < 2:
      problems.append(f"block_size {self.block_size} < 2 leaves nothing to draft")
    if problems:
      raise ValueError("drafter does not fit the target: " + "; ".join(problems) +
                       ". Use the drafter trained for this target.")


class DraftAttention(nnx.Module):
  def __init__(self, cfg: DFlashConfig, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    h, d = cfg.hidden_size, cfg.head_dim
    self.q_proj = linear(h, cfg.num_heads * d, dtype, rngs)
    self.k_proj = linear(h, cfg.num_kv_heads * d, dtype, rngs)
    self.v_proj = linear(h, cfg.num_kv_heads * d, dtype, rngs)
    self.o_proj = linear(cfg.num_heads * d, h, dtype, rngs)
    self.q_norm = RMSNorm(d, cfg.rms_eps, dtype)
    self.k_norm = RMSNorm(d, cfg.rms_eps, dtype)

  def kv(self, x, positions):
    """x [..., T, H], positions [..., T] -> rotated k, v [..., T, KVH, D]."""
    shape = x.shape[:-1] + (self.cfg.num_kv_heads, self.cfg.head_dim)
    k = self.k_norm(self.k_proj(x).reshape(shape))
    return self.cfg.rope(k, positions), self.v_proj(x).reshape(shape)

  def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, block_mask):
    """x [B, A, K, H] block states; ctx_k/v [B, KVH, S, D]; masks [B, 1, K, S], [B, A, K, K]."""
    b, a, t, _ = x.shape
    q = self.q_norm(self.q_proj(x).reshape(b, a, t, self.cfg.num_heads, self.cfg.head_dim))
    q = self.cfg.rope(q, positions[:, None])
    k, v = self.kv(x, positions[:, None])
    out = attend(q, ctx_k, ctx_v, k, v, ctx_mask, block_mask)            # [B, A, K, H, D]
    return self.o_proj(out.reshape(b, a, t, -1))


class DraftLayer(nnx.Module):
  def __init__(self, cfg: DFlashConfig, dtype, rngs: nnx.Rngs):
    self.self_attn = DraftAttention(cfg, dtype, rngs)
    self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)

  def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, block_mask, kernels: bool = False):
    """kernels: on an NVIDIA GPU, the blocks' rows go through gpu_layer's kernels
    (`through_kernels`) where they take the layer."""
    if kernels and layer_kernels.takes(self, math.prod(x.shape[:-1])):
      return layer_kernels.on_gpu(self.through_kernels, self._xla, x, positions, ctx_k, ctx_v,
                                  ctx_mask, block_mask)
    return self._xla(x, positions, ctx_k, ctx_v, ctx_mask, block_mask)

  def _xla(self, x, positions, ctx_k, ctx_v, ctx_mask, block_mask):
    x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_mask, block_mask)
    return x + self.mlp(self.post_attention_layernorm(x))

  def through_kernels(self, x, positions, ctx_k, ctx_v, ctx_mask, block_mask, *,
                      interpret: bool = False):
    """__call__ as gpu_layer's kernels (x [B, A, K, H], B x A x K rows at most
    gpu_layer.MAX_ROWS)."""
    cfg = self.self_attn.cfg
    b, a, t, hidden = x.shape
    cos, sin = (jnp.broadcast_to(p[:, None], (b, a, t, p.shape[-1])).reshape(b * a * t, -1)
                for p in cfg.rope.phases(positions))                     # positions [B, K]

    def rows_attend(q, k, v):            # rows -> the blocks' [B, A, K, heads, D] and back
      q, k, v = (y.reshape(b, a, t, *y.shape[1:]) for y in (q, k, v))
      return attend(q, ctx_k, ctx_v, k, v, ctx_mask, block_mask).reshape(b * a * t, *q.shape[3:])

    rows, _ = layer_kernels.through_kernels(self, x.reshape(b * a * t, hidden), cos, sin,
                                            rows_attend, interpret=interpret)
    return rows.reshape(x.shape)


def vocab_positions(vocab: tuple[int, ...], vocab_size: int):
  """[V] int32: each token's position among the sorted draft vocabulary `vocab` (draft_rows'
  last axis), 0 for a token outside it."""
  where = np.zeros(vocab_size, np.int32)
  where[np.asarray(vocab, np.int32)] = np.arange(len(vocab), dtype=np.int32)
  return where


class DFlash(nnx.Module):
  """Parameter names mirror the DFlash checkpoint (`layers.{i}...`, `fc`, `hidden_norm`, `norm`)."""

  def __init__(self, cfg: DFlashConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.cfg = cfg
    self.dtype = dtype
    n_feat = len(cfg.target_layer_ids)
    self.layers = nnx.List([DraftLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)
    self.fc = linear(n_feat * cfg.hidden_size, cfg.hidden_size, dtype, rngs)
    self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.cfg
    return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype)

  def context_kv(self, features, positions):
    """Target features [B, T, n*H] of verified tokens -> context k, v (L x [B, T, KVH, D])."""
    c = self.hidden_norm(self.fc(features.astype(self.dtype)))
    kvs = [layer.self_attn.kv(c, positions) for layer in self.layers]
    return tuple(k for k, _ in kvs), tuple(v for _, v in kvs)

  def __call__(self, block_embeds, positions, cache: KVCache, block_len, window: int = 0,
               kernels: bool = False):
    """Drafts blocks that share one context.

    block_embeds: [B, A, K, H] target embeddings of the block tokens (anchor, then mask or known
    tokens); positions: [B, K] absolute positions; block_len: [B] keys of the block at index
    >= block_len are hidden (a block shortened near the end of generation); window: the block
    sees only the last `window` context positions (0: all of them), as SGLang's DFlash draft
    window does (block drafters' acceptance is reported to fall past ~16k tokens of context); the
    target's verification keeps the output exact whatever the drafter sees; kernels: on an
    NVIDIA GPU each layer's rows go through gpu_layer's kernels (the target's layer_kernels).
    Returns normed hidden states [B, A, K, H].
    """
    k = block_embeds.shape[2]
    x = block_embeds.astype(self.dtype) * self.cfg.input_embedding_scale
    ctx_mask = cache.visible()                                             # [B, S]
    if window:
      ctx_mask &= jnp.arange(cache.max_len)[None] >= (cache.lengths - window)[:, None]
    ctx_mask = ctx_mask[:, None, None, :]                                  # [B, 1, 1, S]
    ctx_mask = jnp.broadcast_to(ctx_mask, (x.shape[0], 1, k, cache.max_len))
    block_mask = jnp.arange(k)[None, :] < block_len[:, None]               # [B, K]
    block_mask = jnp.broadcast_to(block_mask[:, None, None, :], x.shape[:2] + (k, k))
    for i, layer in enumerate(self.layers):
      x = layer(x, positions, cache.k[i], cache.v[i], ctx_mask, block_mask, kernels)
    return self.norm(x)

  def scale_logits(self, logits):
    """The drafter's output multiplier and soft cap on head logits [..., N]."""
    logits = logits * self.cfg.output_multiplier
    if self.cfg.logit_softcap:
      logits = jnp.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
    return logits

  def draft_argmax(self, hidden, target, vocab: tuple[int, ...] = ()):
    """The argmax of draft_logits(hidden, target, vocab) [...] int32 (greedy drafting). Where
    scale_logits keeps the logits as they are, target.greedy's: on GPUs the logits are not
    written (Qwen3-8B CURE's re-draft at batch 8: 0.31 GB an iteration)."""
    if self.cfg.output_multiplier != 1 or self.cfg.logit_softcap:
      return jnp.argmax(self.draft_logits(hidden, target, vocab), axis=-1).astype(jnp.int32)
    if not vocab:
      return target.greedy(hidden)
    return target.greedy(hidden, np.asarray(vocab, np.int32), self._held_rows(vocab))

  def _held_rows(self, vocab: tuple[int, ...]):
    """The head rows hold_head_rows gathered, when they are `vocab`'s; else None."""
    return self.held_rows if getattr(self, "held_vocab", None) == tuple(vocab) else None

  def hold_head_rows(self, target, vocab: tuple[int, ...], rows=None):
    """Gathers the head rows of `vocab` now (or takes them: rows, target.head_rows gathered
    before), for this module object's later draft_logits to reuse. decoding.decode calls it
    before its loop: XLA's GPU compiler leaves the gather inside the while loop, where it
    re-reads the N rows and writes a copy of them every iteration. Only for a module merged
    inside a traced function that does not split it again."""
    self.held_vocab = tuple(vocab)
    self.held_rows = nnx.data(target.head_rows(np.asarray(vocab, np.int32)) if rows is None
                              else rows)

  def draft_rows(self, hidden, target, vocab: tuple[int, ...] = ()):
    """Float32 draft logits [..., N] of block hidden states [..., H] for the N tokens of `vocab`
    (sorted ids; empty: all V, in id order): only their head rows are read (gathered here, or
    once by hold_head_rows). The compact form a top-k takes: on GPUs XLA's TopK kernel needs
    its input written, and draft_logits' [..., V] would be (ddtree at 256 nodes with a
    32,768-token vocabulary: 0.04 GB an iteration)."""
    if not vocab:
      return self.scale_logits(target.logits(hidden))
    ids = np.asarray(vocab, np.int32)
    return self.scale_logits(target.logits_rows(hidden, ids, self._held_rows(vocab)))

  def draft_logits(self, hidden, target, vocab: tuple[int, ...] = ()):
    """Float32 draft logits [..., V]: draft_rows with every token outside `vocab` at -inf, so
    argmax, top-k and sampling see probability 0 there and the target's verification keeps the
    output exact."""
    rows = self.draft_rows(hidden, target, vocab)                          # [..., N]
    if not vocab:
      return rows
    # each token's logit read from its place in rows (a gather XLA fuses into the consumer; a
    # scatter into a -inf array wrote and copied [..., V] first: 0.35 GB an iteration at
    # Qwen3-8B chain batch 8)
    kept = np.zeros(target.cfg.vocab_size, bool)
    kept[np.asarray(vocab)] = True
    where = vocab_positions(vocab, target.cfg.vocab_size)
    return jnp.where(kept, jnp.take(rows, where, axis=-1, mode="clip"), -jnp.inf)
