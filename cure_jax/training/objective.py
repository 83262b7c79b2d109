"""The math of one drafter training step: the training forward pass, the loss and the jitted
train and eval steps.

The recipe is DFlash's: a random anchor position p inside the target's own continuation; the
block [token_p, mask x (K-1)] at positions p..p+K-1 sees as context the target features of every
token before p (at inference the anchor's own features arrive only with its verification); the
labels are the target's greedy tokens after p..p+K-2; the loss is cross-entropy with
position-decayed weights w_k = exp(-(k-1)/gamma). Many anchors share one sequence: its context
K/V are projected once and each block sees them under its own context-length mask. The target's
embedding and head are frozen; the training head may be restricted to the most frequent label
ids (remap; the exported drafter uses the full head).

The context features come stored in the batch, or (`Online`) from the frozen target run over the
batch's tokens inside the step (training/features.py), outside the differentiated function.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cure_jax.models.dflash import DFlash
from cure_jax.models.layers import attend, einsum_f32
from cure_jax.training.features import target_features


@dataclasses.dataclass(frozen=True)
class Online:
  """Features computed in the step: the frozen target's graphdef (its parameters are an
  argument), the hidden_states indices and the chunk each sequence is read in."""
  graphdef: Any
  feature_layers: tuple[int, ...]
  chunk: int


def context_features(online: Online | None, target_params, batch):
  """Features [B, T, F] of the batch's context: stored, or computed by the frozen target."""
  if online is None:
    return batch["features"]
  target = nnx.merge(online.graphdef, target_params)
  return target_features(target, batch["tokens"], batch["lengths"], online.feature_layers,
                         online.chunk)


def train_forward(drafter: DFlash, embed, features, blocks, anchors):
  """Block hidden states [B, A, K, H] of blocks [B, A, K] anchored at anchors [B, A]; the
  context of a block is features [B, T, F] of the tokens before its anchor."""
  cfg = drafter.cfg
  b, t, _ = features.shape
  a, k = blocks.shape[1:]
  ck, cv = drafter.context_kv(features, jnp.broadcast_to(jnp.arange(t), (b, t)))
  ck = [x.swapaxes(1, 2) for x in ck]                                  # L x [B, KVH, T, D]
  cv = [x.swapaxes(1, 2) for x in cv]
  pos = anchors[..., None] + jnp.arange(k)                              # [B, A, K]
  ctx_mask = jnp.arange(t)[None, None, None, :] < anchors[:, :, None, None]   # [B, A, 1, T]
  ctx_mask = jnp.broadcast_to(ctx_mask, (b, a, k, t))
  block_mask = jnp.ones((b, a, k, k), bool)                             # bidirectional
  x = embed[blocks].astype(drafter.dtype) * cfg.input_embedding_scale   # [B, A, K, H]
  for i, layer in enumerate(drafter.layers):
    attn = layer.self_attn
    hn = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(hn).reshape(b, a, k, cfg.num_heads, cfg.head_dim))
    q = cfg.rope(q, pos)
    kk, vv = attn.kv(hn, pos)
    out = attend(q, ck[i], cv[i], kk, vv, ctx_mask, block_mask, kernel=False)  # differentiated
    x = x + attn.o_proj(out.reshape(b, a, k, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
  return drafter.norm(x)


def block_logits(drafter: DFlash, hidden, head):
  """Float32 draft logits [..., V'] of hidden states [..., H] through head rows [V', H]."""
  return drafter.scale_logits(
      einsum_f32("...h,vh->...v", hidden, head))


@dataclasses.dataclass(frozen=True)
class Hyper:
  """The optimizer's settings (hashable: one compiled step per distinct value)."""
  lr: float
  end_lr_frac: float
  warmup: int
  steps: int
  b1: float
  b2: float
  weight_decay: float
  clip_norm: float

  @classmethod
  def of(cls, train) -> "Hyper":
    return cls(float(train.lr), float(train.end_lr_frac), int(train.warmup), int(train.steps),
               float(train.b1), float(train.b2), float(train.weight_decay),
               float(train.clip_norm))

  def schedule(self, step):
    """Linear warm-up to lr, then cosine down to end_lr_frac * lr at `steps`."""
    warm = jnp.minimum(1.0, (step + 1) / max(self.warmup, 1))
    frac = jnp.clip((step - self.warmup) / max(self.steps - self.warmup, 1), 0.0, 1.0)
    cos = self.end_lr_frac + (1 - self.end_lr_frac) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return self.lr * warm * cos

  def optimizer(self) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(self.clip_norm),
                       optax.adamw(self.schedule, b1=self.b1, b2=self.b2,
                                   weight_decay=self.weight_decay))


def position_weights(k: int, gamma: float, n: int) -> np.ndarray:
  """w_k = exp(-(k-1)/gamma) for block positions k = 1..n."""
  return np.exp(-np.arange(min(n, k - 1), dtype=np.float32) / gamma)


def loss_fn(drafter, embed, head, remap, features, batch, weights):
  """Weighted CE over the first len(weights) block positions; labels outside the training
  head's ids (remap -1) do not count."""
  hidden = train_forward(drafter, embed, features, batch["blocks"], batch["anchors"])
  n = weights.shape[0]
  logits = block_logits(drafter, hidden[:, :, 1:1 + n], head)           # [B, A, n, V']
  lab = remap[batch["labels"][..., :n]]
  valid = batch["label_mask"][..., :n] & (lab >= 0)
  lab = jnp.maximum(lab, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab)     # [B, A, n]
  w = weights[None, None] * valid
  loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-6)
  correct = (jnp.argmax(logits, -1) == lab) & valid
  return loss, dict(correct=jnp.sum(correct, (0, 1)), count=jnp.sum(valid, (0, 1)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=3)
def train_step(graphdef, hyper: Hyper, online: Online | None, state, frozen, batch):
  """One AdamW step on state {params, opt_state, step}; returns it and the step's metrics.
  frozen: the target's embed, the training head, remap, the position weights and (online)
  the target's parameters."""
  features = context_features(online, frozen["target"], batch)

  def loss_of(params):
    return loss_fn(nnx.merge(graphdef, params), frozen["embed"], frozen["head"], frozen["remap"],
                   features, batch, frozen["weights"])

  (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
  updates, opt_state = hyper.optimizer().update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return dict(params=params, opt_state=opt_state, step=state["step"] + 1), dict(loss=loss, **aux)


@functools.partial(jax.jit, static_argnums=(0, 1))
def eval_step(graphdef, online: Online | None, params, frozen, batch):
  """Full-head greedy drafts vs labels: per-position hits and valid labels [K-1], the summed
  accepted runs and the number of anchors (teacher-forced tau = 1 + runs / anchors).
  frozen: the target's embed, the full head and (online) the target's parameters."""
  drafter = nnx.merge(graphdef, params)
  features = context_features(online, frozen["target"], batch)
  hidden = train_forward(drafter, frozen["embed"], features, batch["blocks"], batch["anchors"])
  pred = jnp.argmax(block_logits(drafter, hidden[:, :, 1:], frozen["head"]), -1)  # [B, A, K-1]
  hit = (pred == batch["labels"]) & batch["label_mask"]
  run = jnp.sum(jnp.cumprod(hit, axis=-1), -1)                          # [B, A]
  return dict(correct=jnp.sum(hit, (0, 1)), count=jnp.sum(batch["label_mask"], (0, 1)),
              runs=jnp.sum(run * batch["anchor_mask"]), anchors=jnp.sum(batch["anchor_mask"]))
