"""Training a DFlash block drafter for a Qwen3 / Llama target from stored target features.

The recipe is DFlash's: a random anchor position p inside the target's own continuation; the
block [token_p, mask x (K-1)] at positions p..p+K-1 sees as context the target features of every
token before p (at inference the anchor's own features arrive only with its verification); the
labels are the target's greedy tokens after p..p+K-2; the loss is cross-entropy with
position-decayed weights w_k = exp(-(k-1)/gamma). Many anchors share one sequence: its context
K/V are projected once and each block sees them under its own context-length mask. The target's
embedding and head are frozen; the training head may be restricted to the most frequent label
ids (the exported drafter uses the full head). Drafter layers start from the target's top layers.

Data parallel over a mesh's `data` axis: the batch is split, parameters and optimizer state are
replicated, XLA inserts the gradient all-reduce. Multi-host (jax.distributed): every process
loads its own data folders and builds its rows of each global batch. Batch s is a function of
(seed, process, s) alone, so a checkpoint of (parameters, optimizer state, step) resumes exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from cure_jax import drafter_data, pipeline, sharding
from cure_jax.models.dflash import DFlash, DFlashConfig
from cure_jax.models.layers import attend


def check_config(config) -> None:
  """Fails before anything loads when the config cannot describe a training run."""
  m, t = config.model, config.train
  problems = []
  if not config.target.path:
    problems.append("set target.path to the target's HF directory (or embedded:smollm2)")
  if not list(config.data.folders):
    problems.append("set data.folders to folders written by experiments.train_drafter --stage=data")
  if not config.workdir:
    problems.append("set workdir (checkpoints go to workdir/checkpoints)")
  if m.block_size < 2:
    problems.append(f"model.block_size={m.block_size} < 2 leaves nothing to draft")
  if not list(m.target_layer_ids):
    problems.append("set model.target_layer_ids to the data's (its meta.json target_layer_ids)")
  if not 1 <= t.loss_positions <= m.block_size - 1:
    problems.append(f"train.loss_positions={t.loss_positions} must lie in 1..block_size-1 "
                    f"({m.block_size - 1})")
  for name in ("steps", "seqs_per_step", "anchors_per_seq"):
    if t[name] < 1:
      problems.append(f"train.{name}={t[name]} must be >= 1")
  if not t.lr > 0:
    problems.append(f"train.lr={t.lr} must be > 0")
  for name, value in (("target.dtype", config.target.dtype), ("model.dtype", m.dtype),
                      ("export.dtype", config.export.dtype)):
    if value not in pipeline.DTYPES:
      problems.append(f"{name}={value!r} is not one of {sorted(pipeline.DTYPES)}")
  if problems:
    raise ValueError("bad training config: " + "; ".join(problems) + ".")


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

def _global_max(value: int) -> int:
  """The largest `value` over all processes (shapes every process must agree on)."""
  if jax.process_count() == 1:
    return value
  return int(np.max(multihost_utils.process_allgather(np.int64(value))))


def _global_sum(x: np.ndarray) -> np.ndarray:
  """x summed over all processes (statistics of data split between hosts)."""
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x)).sum(0)


class Data:
  """Sequences of loaded shards, split by prompt uid into training and held-out (generated)
  sequences, with the recipe's labels and batches."""

  def __init__(self, shards, eval_seqs: int, split_seed: int, eval_uids=None,
               text_weight: float = 1.0, len_bucket: int = 128):
    self.meta = shards.meta
    self.tokens, self.features, self.greedy = shards.tokens, shards.features, shards.greedy
    self.starts, self.ends = shards.starts, shards.ends
    self.prompt_lens, self.uids, self.generated = shards.prompt_lens, shards.uids, shards.generated
    self.len_bucket = len_bucket
    # match[t]: the text's next token is the target's greedy choice after token t.
    self.match = np.append(self.tokens[1:] == self.greedy[:-1], False)
    if eval_uids is not None:  # a fixed held-out set, e.g. across data that grew since
      self.eval_idx = np.flatnonzero(self.generated & np.isin(self.uids, eval_uids))
    else:
      rng = np.random.default_rng(split_seed)
      self.eval_idx = np.sort(rng.permutation(np.flatnonzero(self.generated))[:eval_seqs])
    self.train_idx = np.setdiff1d(np.arange(len(self.starts)), self.eval_idx)
    cont = (self.ends - self.starts - self.prompt_lens)[self.train_idx]
    # Sequences are drawn by their number of answer anchors; text-mode answers weigh less.
    w = np.maximum(cont - 1, 0) * np.where(self.generated[self.train_idx], 1.0, text_weight)
    if not w.sum() > 0:
      raise ValueError(f"no training sequence has an answer anchor (a continuation of >= 2 "
                       f"tokens) among {len(self.train_idx)}; generate more data or hold out "
                       "fewer sequences (data.eval_seqs)")
    self.sample_idx, self.sample_p = self.train_idx[w > 0], w[w > 0] / w.sum()

  def summary(self) -> str:
    cont = self.ends - self.starts - self.prompt_lens
    return (f"{len(self.starts)} sequences ({int(self.generated.sum())} generated), "
            f"{len(self.tokens)} tokens ({int(cont.sum())} answer); features "
            f"{self.features.shape} {self.features.dtype}; held out {len(self.eval_idx)}")

  def label_counts(self, vocab: int) -> np.ndarray:
    """How often each id is an answer label in the training sequences (all processes')."""
    counts = np.zeros(vocab, np.int64)
    for i in self.train_idx:
      np.add.at(counts, self.greedy[self.starts[i] + self.prompt_lens[i]:self.ends[i] - 1], 1)
    return _global_sum(counts)

  def labels(self, i: int, pos: np.ndarray, k: int):
    """Labels [A, K-1] and validity for anchors pos of sequence i: label j is the target's
    greedy token after pos + j - 1, valid while the text before it is greedy too."""
    s, e = self.starts[i], self.ends[i]
    n = e - s
    g, m = self.greedy[s:e], self.match[s:e]
    q = pos[:, None] + np.arange(k - 1)[None]                            # [A, K-1]
    qc = np.minimum(q, n - 1)
    first = np.ones((len(pos), 1), bool)
    ok = np.cumprod(np.concatenate([first, m[qc[:, :-1]]], axis=1), axis=1).astype(bool)
    return g[qc].astype(np.int32), ok & (q < n - 1)

  def _length(self, idx) -> int:
    """The padded context length of sequences idx: a multiple of len_bucket, equal on every
    process (one compile per bucket)."""
    n = int(max(self.ends[i] - self.starts[i] for i in idx)) if len(idx) else 1
    return _global_max(-(-n // self.len_bucket) * self.len_bucket)

  def _arrays(self, rows: list[tuple[int, np.ndarray]], b: int, a: int, k: int, mask_id: int,
              t: int):
    """Batch arrays of b rows: rows (sequence, <= a anchors) first; missing anchors and rows
    are masked out."""
    feats = np.zeros((b, t, self.features.shape[1]), self.features.dtype)  # [B, T, F]
    blocks = np.full((b, a, k), mask_id, np.int32)                         # [B, A, K]
    anchors = np.zeros((b, a), np.int32)                                   # [B, A]
    labels = np.zeros((b, a, k - 1), np.int32)                             # [B, A, K-1]
    label_mask = np.zeros((b, a, k - 1), bool)
    anchor_mask = np.zeros((b, a), bool)
    for r, (i, pos) in enumerate(rows):
      s, e = self.starts[i], self.ends[i]
      m = len(pos)
      feats[r, :e - s] = self.features[s:e]
      anchors[r, :m] = pos
      blocks[r, :m, 0] = self.tokens[s:e][pos]
      labels[r, :m], label_mask[r, :m] = self.labels(i, pos, k)
      anchor_mask[r, :m] = True
    return dict(features=feats, blocks=blocks, anchors=anchors, labels=labels,
                label_mask=label_mask, anchor_mask=anchor_mask)

  def train_batch(self, rows: int, a: int, k: int, mask_id: int, prompt_frac: float, rng):
    """This process's rows of a training batch: `a` anchors per sequence inside the answer (a
    prompt_frac share inside the prompt)."""
    idx = rng.choice(self.sample_idx, size=rows, p=self.sample_p,
                     replace=len(self.sample_idx) < rows)
    out = []
    for i in idx:
      n, pl = self.ends[i] - self.starts[i], self.prompt_lens[i]
      cand = np.arange(pl, n - 1)
      n_prompt = rng.binomial(a, prompt_frac) if pl > 2 else 0
      pos = np.concatenate([
          rng.choice(cand, size=a - n_prompt, replace=len(cand) < a - n_prompt),
          rng.integers(1, pl - 1, size=n_prompt) if n_prompt else np.zeros(0, int)])
      pos = pos.astype(np.int32)
      out.append((i, pos))
    return self._arrays(out, rows, a, k, mask_id, self._length(idx))

  def eval_batches(self, rows: int, a: int, k: int, mask_id: int, stride: int):
    """Every stride-th answer anchor of the held-out sequences, `a` per row, `rows` rows per
    batch; every process yields the same number of batches."""
    chunks = []
    for i in self.eval_idx:
      pos = np.arange(self.prompt_lens[i], self.ends[i] - self.starts[i] - 1, stride)
      chunks += [(i, pos[c:c + a].astype(np.int32)) for c in range(0, len(pos), a)]
    t = self._length(self.eval_idx)
    count = _global_max(-(-len(chunks) // rows))
    for c in range(count):
      yield self._arrays(chunks[c * rows:(c + 1) * rows], rows, a, k, mask_id, t)


def load_data(config) -> Data:
  """The data of config.data (folders may hold `{process}`: each host reads its own)."""
  d = config.data
  folders = [f.format(process=jax.process_index()) for f in d.folders]
  eval_uids = json.loads(Path(d.eval_uids).read_text())["eval_uids"] if d.eval_uids else None
  return Data(drafter_data.load_shards(folders), d.eval_seqs, d.split_seed, eval_uids,
              d.text_weight, d.len_bucket)


def check_data(data: Data, config, target_cfg) -> None:
  """The data must come from this target with the config's feature layers."""
  meta, ids = data.meta, list(config.model.target_layer_ids)
  if list(meta["target_layer_ids"]) != ids:
    raise ValueError(f"data {list(config.data.folders)} holds features of target_layer_ids "
                     f"{meta['target_layer_ids']}, the config asks for {ids}; set --config.model."
                     f"target_layer_ids='{tuple(meta['target_layer_ids'])}' or regenerate the data")
  width = len(ids) * target_cfg.hidden_size
  if int(meta["hidden"]) != target_cfg.hidden_size or data.features.shape[1] != width:
    raise ValueError(f"data features are [N, {data.features.shape[1]}] (hidden {meta['hidden']}), "
                     f"the target needs [N, {width}] (hidden {target_cfg.hidden_size}); was the "
                     f"data written for this target ({meta.get('target')})?")


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def drafter_config(target_cfg, model) -> DFlashConfig:
  """A DFlash drafter as wide as the target, with config.model's depth and block."""
  return DFlashConfig(
      hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
      num_layers=model.num_layers, num_heads=target_cfg.num_heads,
      num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
      rms_eps=target_cfg.rms_eps, rope=target_cfg.rope, block_size=model.block_size,
      mask_token_id=model.mask_token_id, target_layer_ids=tuple(model.target_layer_ids),
      num_target_layers=target_cfg.num_layers)


def init_from_target(drafter: DFlash, target, first_layer: int, seed: int) -> None:
  """Copies target layers first_layer.. into the drafter and the final norm; fc/hidden_norm
  reproduce that layer's input when hidden_states[first_layer] is among the features."""
  h = target.cfg.hidden_size
  for i, layer in enumerate(drafter.layers):
    src = target.layers[first_layer + i]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      getattr(layer.self_attn, name).kernel[...] = getattr(src.self_attn, name).kernel[...]
    if target.cfg.qk_norm:  # a Llama target has none: the drafter's stay at 1
      for name in ("q_norm", "k_norm"):
        getattr(layer.self_attn, name).weight[...] = getattr(src.self_attn, name).weight[...]
    for name in ("gate_proj", "up_proj", "down_proj"):
      getattr(layer.mlp, name).kernel[...] = getattr(src.mlp, name).kernel[...]
    layer.input_layernorm.weight[...] = src.input_layernorm.weight[...]
    layer.post_attention_layernorm.weight[...] = src.post_attention_layernorm.weight[...]
  drafter.norm.weight[...] = target.norm.weight[...]
  feature_layers = drafter.cfg.feature_layers
  n = len(feature_layers)
  fc = np.random.default_rng(seed).normal(0, 0.02 / math.sqrt(n), (n * h, h)).astype(np.float32)
  if first_layer in feature_layers:
    j = feature_layers.index(first_layer)
    fc[j * h:(j + 1) * h] += np.eye(h, dtype=np.float32)
    drafter.hidden_norm.weight[...] = target.layers[first_layer].input_layernorm.weight[...]
  drafter.fc.kernel[...] = jnp.asarray(fc, drafter.dtype)


def train_forward(drafter: DFlash, embed, features, blocks, anchors):
  """Block hidden states [B, A, K, H] of blocks [B, A, K] anchored at anchors [B, A]; the
  context of a block is features [B, T, F] of the tokens before its anchor."""
  cfg = drafter.cfg
  b, t, _ = features.shape
  a, k = blocks.shape[1:]
  ck, cv = drafter.context_kv(features, jnp.broadcast_to(jnp.arange(t), (b, t)))
  ck, cv = ck.swapaxes(2, 3), cv.swapaxes(2, 3)                         # [L, B, KVH, T, D]
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
  return drafter.draft_logits(
      hidden, lambda h: jnp.einsum("...h,vh->...v", h, head, preferred_element_type=jnp.float32))


# --------------------------------------------------------------------------------------------
# Optimisation
# --------------------------------------------------------------------------------------------

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


def loss_fn(drafter, embed, head, remap, batch, weights):
  """Weighted CE over the first len(weights) block positions; labels outside the training
  head's ids (remap -1) do not count."""
  hidden = train_forward(drafter, embed, batch["features"], batch["blocks"], batch["anchors"])
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


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def train_step(graphdef, hyper: Hyper, state, embed, head, remap, weights, batch):
  """One AdamW step on state {params, opt_state, step}; returns it and the step's metrics."""
  def loss_of(params):
    return loss_fn(nnx.merge(graphdef, params), embed, head, remap, batch, weights)

  (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
  updates, opt_state = hyper.optimizer().update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return dict(params=params, opt_state=opt_state, step=state["step"] + 1), dict(loss=loss, **aux)


@functools.partial(jax.jit, static_argnums=0)
def eval_step(graphdef, params, embed, head, batch):
  """Full-head greedy drafts vs labels: per-position hits and valid labels [K-1], the summed
  accepted runs and the number of anchors (teacher-forced tau = 1 + runs / anchors)."""
  drafter = nnx.merge(graphdef, params)
  hidden = train_forward(drafter, embed, batch["features"], batch["blocks"], batch["anchors"])
  pred = jnp.argmax(block_logits(drafter, hidden[:, :, 1:], head), -1)  # [B, A, K-1]
  hit = (pred == batch["labels"]) & batch["label_mask"]
  run = jnp.sum(jnp.cumprod(hit, axis=-1), -1)                          # [B, A]
  return dict(correct=jnp.sum(hit, (0, 1)), count=jnp.sum(batch["label_mask"], (0, 1)),
              runs=jnp.sum(run * batch["anchor_mask"]), anchors=jnp.sum(batch["anchor_mask"]))


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

def hf_config(cfg: DFlashConfig, target_dir: str, dtype_name: str) -> dict:
  """The drafter's config.json as `DFlashDraftModel.from_pretrained` reads it."""
  from convert.checkpoint import read_hf_config
  tcfg = read_hf_config(target_dir)
  return {
      "architectures": ["DFlashDraftModel"],
      "model_type": "qwen3",
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope.theta,
      "rope_scaling": tcfg.get("rope_scaling"),
      "max_position_embeddings": tcfg.get("max_position_embeddings", 8192),
      "vocab_size": tcfg["vocab_size"],
      "attention_bias": False,
      "attention_dropout": 0.0,
      "tie_word_embeddings": False,
      "use_sliding_window": False,
      "torch_dtype": dtype_name,
      "block_size": cfg.block_size,
      "num_target_layers": cfg.num_target_layers,
      "dflash_config": {"mask_token_id": cfg.mask_token_id,
                        "target_layer_ids": list(cfg.target_layer_ids)},
  }


def export(params: nnx.State, cfg: DFlashConfig, out_dir, target_dir: str, dtype,
           extra: dict | None = None) -> Path:
  """Writes host parameters as a DFlash HF directory (config.json, model.safetensors,
  training.json) in `dtype`; it replaces out_dir only once complete."""
  from convert import checkpoint
  out = Path(out_dir).resolve()
  staged = out.parent / f".{out.name}.new-{uuid.uuid4().hex[:8]}"
  try:
    checkpoint.export_hf(params, staged, checkpoint.hf_name,
                         hf_config(cfg, target_dir, jnp.dtype(dtype).name), dtype=dtype)
    if extra is not None:
      (staged / "training.json").write_text(json.dumps(extra, indent=1))
      (staged / "training.json").chmod(0o644)
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    if out.exists():
      os.replace(out, old)
    os.replace(staged, out)
    shutil.rmtree(old, ignore_errors=True)
  finally:
    shutil.rmtree(staged, ignore_errors=True)
  return out


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def make_mesh(config) -> jax.sharding.Mesh:
  """A data-parallel mesh over config.mesh.data devices (0: all of them)."""
  n = int(config.mesh.data) or jax.device_count()
  if n > jax.device_count() or (n < jax.device_count() and jax.process_count() > 1):
    raise ValueError(f"mesh.data={n} but {jax.device_count()} devices are available; use 0 "
                     "(all) or, on one host, at most that many")
  return sharding.make_mesh(n, 1, jax.devices()[:n])


def _log(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


class Trainer:
  """One training run: target, data, drafter, optimizer and checkpoints of config.

  A workdir that already holds checkpoints resumes from the latest one.
  """

  def __init__(self, config):
    from convert.qwen3 import load_target
    check_config(config)
    self.config = config
    self.mesh = make_mesh(config)
    data_axis = self.mesh.shape[sharding.DATA]
    for name, rows in (("train.seqs_per_step", config.train.seqs_per_step),
                       ("eval.rows", config.eval.rows)):
      if rows % data_axis or rows % jax.process_count():
        raise ValueError(f"{name}={rows} must be a multiple of the {data_axis} data-parallel "
                         f"devices and of the {jax.process_count()} processes")
    self.target_dir = pipeline.resolve_path(config.target.path)
    self.data = load_data(config)
    target = load_target(self.target_dir, pipeline.DTYPES[config.target.dtype], progress=False,
                         placement=sharding.placement(self.mesh))
    check_data(self.data, config, target.cfg)
    self.cfg = drafter_config(target.cfg, config.model)
    self.cfg.check_against(target.cfg)
    _log(f"data: {self.data.summary()}")
    self._set_heads(target)
    self.hyper = Hyper.of(config.train)
    self.graphdef, params = nnx.split(self._initial_drafter(target), nnx.Param)
    del target
    replicated = NamedSharding(self.mesh, P())
    params = sharding.shard_state(params, self.mesh)
    opt_state = jax.jit(self.hyper.optimizer().init, out_shardings=replicated)(params)
    self.state = dict(params=params, opt_state=opt_state,
                      step=jax.device_put(jnp.int32(0), replicated))
    self.history: list[dict] = []
    self._next: tuple[int, dict] | None = None  # (step, this process's rows of its batch)
    self.ckpt = ocp.CheckpointManager(
        Path(config.workdir).resolve() / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=int(config.checkpoint.keep)))
    if self.ckpt.latest_step() is not None:
      self._restore(self.ckpt.latest_step())
    elif jax.process_index() == 0:
      pipeline.write_json(os.path.join(config.workdir, "eval_uids.json"),
                          dict(eval_uids=[int(u) for u in self.data.uids[self.data.eval_idx]]))

  def _set_heads(self, target) -> None:
    """The frozen embedding, the full head [V, H] (evaluation, export) and the training head
    over train.vocab_subset ids with remap [V] (id -> its row, -1 outside)."""
    t = self.config.train
    replicated = NamedSharding(self.mesh, P())
    self.embed = target.embed_tokens.embedding[...]
    head = self.embed if target.cfg.tie_embeddings else target.lm_head.kernel[...].T  # [V, H]
    self.head = jax.device_put(head, replicated)
    vocab = head.shape[0]
    subset = np.arange(vocab)
    if t.vocab_subset:
      counts = self.data.label_counts(vocab)
      subset = np.sort(np.argsort(-counts, kind="stable")[:t.vocab_subset])
      _log(f"training head: {len(subset)} ids cover "
           f"{counts[subset].sum() / max(counts.sum(), 1):.4f} of the answer labels")
    remap = np.full(vocab, -1, np.int32)
    remap[subset] = np.arange(len(subset))
    self.train_head = jax.device_put(head[jnp.asarray(subset)], replicated)
    self.remap = jax.device_put(remap, replicated)
    self.weights = jax.device_put(position_weights(self.cfg.block_size, t.gamma,
                                                   t.loss_positions), replicated)

  def _initial_drafter(self, target) -> DFlash:
    m = self.config.model
    dtype = pipeline.DTYPES[m.dtype]
    if m.init_drafter:
      from convert.dflash import load_drafter
      drafter = load_drafter(m.init_drafter, dtype, progress=False, target_cfg=target.cfg)
      if drafter.cfg != self.cfg:
        raise ValueError(f"model.init_drafter={m.init_drafter} is {drafter.cfg}; the config "
                         f"describes {self.cfg}")
      return drafter
    drafter = DFlash(self.cfg, dtype, rngs=nnx.Rngs(self.config.train.seed))
    first = m.init_from if m.init_from >= 0 else target.cfg.num_layers - m.num_layers
    if not 0 <= first <= target.cfg.num_layers - m.num_layers:
      raise ValueError(f"model.init_from={m.init_from}: target layers {first}.."
                       f"{first + m.num_layers - 1} do not exist ({target.cfg.num_layers} layers)")
    init_from_target(drafter, target, first, self.config.train.seed)
    _log(f"init: drafter layers <- target layers {first}..{first + m.num_layers - 1}; features "
         f"hidden_states{list(self.cfg.feature_layers)}")
    return drafter

  @property
  def step(self) -> int:
    return int(self.state["step"])

  def _put(self, batch: dict) -> dict:
    """This process's batch rows -> global arrays split over `data`."""
    return {k: jax.make_array_from_process_local_data(
        NamedSharding(self.mesh, P(sharding.DATA, *(None,) * (v.ndim - 1))), v)
        for k, v in batch.items()}

  def batch(self, step: int) -> dict:
    """This process's rows of batch `step` (a function of seed, process and step only)."""
    t, m = self.config.train, self.config.model
    rng = np.random.default_rng([t.seed, jax.process_index(), step])
    return self.data.train_batch(t.seqs_per_step // jax.process_count(), t.anchors_per_seq,
                                 m.block_size, m.mask_token_id, self.config.data.prompt_anchor_frac,
                                 rng)

  def take_step(self) -> dict:
    """One training step; the next step's batch is built while this one runs."""
    step = self.step
    batch = self._next[1] if self._next and self._next[0] == step else self.batch(step)
    self.state, metrics = train_step(self.graphdef, self.hyper, self.state, self.embed,
                                     self.train_head, self.remap, self.weights, self._put(batch))
    self._next = (step + 1, self.batch(step + 1))
    metrics = jax.device_get(metrics)
    row = dict(step=step + 1, loss=float(metrics["loss"]), lr=float(self.hyper.schedule(step)),
               train_acc=(metrics["correct"] / np.maximum(metrics["count"], 1)).tolist())
    self.history.append(row)
    return row

  def evaluate(self) -> dict:
    """Held-out per-position accuracy (full head) and teacher-forced tau."""
    e, m = self.config.eval, self.config.model
    total = None
    for batch in self.data.eval_batches(e.rows // jax.process_count(), e.anchors, m.block_size,
                                        m.mask_token_id, e.stride):
      out = jax.device_get(eval_step(self.graphdef, self.state["params"], self.embed, self.head,
                                     self._put(batch)))
      total = out if total is None else {k: total[k] + out[k] for k in out}
    if total is None or not total["anchors"]:
      return {}
    row = dict(step=self.step, eval_acc=(total["correct"] / np.maximum(total["count"], 1)).tolist(),
               eval_tau=float(1 + total["runs"] / total["anchors"]))
    self.history.append(row)
    _log(f"eval step {row['step']}: held-out acc/pos {np.round(row['eval_acc'], 3).tolist()} "
         f"teacher-forced tau {row['eval_tau']:.3f}")
    return row

  def save(self) -> None:
    """Checkpoints the state and the history (orbax publishes a step only once complete)."""
    self.ckpt.save(self.step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(self.state),
        history=ocp.args.JsonSave(dict(rows=self.history))))

  def _restore(self, step: int) -> None:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self.state)
    got = self.ckpt.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
    self.state, self.history = got["state"], list(got["history"]["rows"])
    _log(f"resumed from {self.ckpt.directory} step {step}")

  def run(self, until: int | None = None) -> list[dict]:
    """Trains to train.steps (or step `until`, or the time budget), evaluating every
    eval.every steps and checkpointing every checkpoint.every; returns the history."""
    c = self.config
    last = min(c.train.steps, until or c.train.steps)
    budget_s = c.train.max_minutes * 60 or math.inf
    t0 = time.time()
    if self.step == 0 and c.eval.every:
      self.evaluate()
    while self.step < last:
      row = self.take_step()
      step, out_of_time = self.step, time.time() - t0 > budget_s
      if step % c.train.log_every == 0:
        acc = np.round(row["train_acc"][:4], 3).tolist()
        _log(f"step {step} loss {row['loss']:.4f} lr {row['lr']:.2e} train acc pos1-4 {acc} | "
             f"{(time.time() - t0) / 60:.1f} min")
      if c.eval.every and (step % c.eval.every == 0 or step == c.train.steps):
        self.evaluate()
      if step % c.checkpoint.every == 0 or step == last or out_of_time:
        self.save()
      if out_of_time:
        _log(f"time budget of {c.train.max_minutes} min reached at step {step}")
        break
    self.ckpt.wait_until_finished()
    if c.export.path and self.step == c.train.steps:
      self.export()
    return self.history

  def export(self, path: str | None = None) -> Path:
    """The current drafter as a DFlash HF directory (export.path, in export.dtype)."""
    c = self.config
    out = path or c.export.path
    # Replicated: every process holds the whole value, no collective needed.
    params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), self.state["params"])
    if jax.process_index() == 0:
      export(params, self.cfg, out, self.target_dir, pipeline.DTYPES[c.export.dtype],
             extra=dict(step=self.step, history=self.history, config=c.to_dict()))
      _log(f"exported step {self.step} to {out}")
    return Path(out)
