"""Distilling a small autoregressive (AR) drafter for the `ar_draft` baseline: the target's
Llama architecture cut to a few layers, initialised from some of the target's layers, its final
norm and its (tied) embedding, which stays frozen; trained by cross-entropy against the
target's greedy token after every position of packed training sequences (prompt and answer),
with the head restricted to the most frequent labels (CPU speed). Evaluation and the exported
drafter use the full head (`experiments.train_ar_drafter` runs it)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cure_jax.checkpoints import qwen3 as convert_qwen3, store
from cure_jax.models.qwen3 import Qwen3
from cure_jax.training.batches import Data


def packed_rows(data: Data, idx: np.ndarray, seq_len: int, rng):
  """Endless packed rows: (tokens, labels, segment ids (0 = padding), positions), each [T];
  every pass over idx in a fresh order, each sequence cropped to seq_len tokens."""
  row = []
  while True:
    for i in rng.permutation(idx):
      s = data.starts[i]
      n = min(data.ends[i] - s, seq_len)
      if sum(m for _, m in row) + n > seq_len:
        yield _row(data, row, seq_len)
        row = []
      row.append((s, n))


def _row(data: Data, row, seq_len: int):
  """The arrays of one packed row of (start, length) sequences."""
  tokens, labels, seg, pos = (np.zeros(seq_len, np.int32) for _ in range(4))
  t = 0
  for j, (s, n) in enumerate(row):
    tokens[t:t + n] = data.tokens[s:s + n]
    labels[t:t + n] = data.greedy[s:s + n]
    seg[t:t + n] = j + 1
    pos[t:t + n] = np.arange(n)
    t += n
  return tokens, labels, seg, pos


def segment_mask(seg):
  """Causal attention within each packed sequence: [B, T, T] from segment ids [B, T]."""
  t = seg.shape[1]
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  return same & jnp.tril(jnp.ones((t, t), bool))[None]


TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))


def init_drafter(target: Qwen3, num_layers: int, init_layers: list[int]) -> Qwen3:
  """The target cut to num_layers layers, layer i copied from target layer init_layers[i]. Its
  layers run as XLA's ops: training differentiates them, and the GPU layer kernels (traced on
  every platform by platform_dependent) have no derivative."""
  drafter = Qwen3(dataclasses.replace(target.cfg, num_layers=num_layers), jnp.float32,
                  rngs=nnx.Rngs(0))
  drafter.layer_kernels = False
  nnx.update(drafter.embed_tokens, nnx.state(target.embed_tokens))
  nnx.update(drafter.norm, nnx.state(target.norm))
  for layer, src in zip(drafter.layers, init_layers, strict=True):
    nnx.update(layer, nnx.state(target.layers[src]))
  return drafter


def hidden_states(model: Qwen3, tokens, seg, positions):
  """Final hidden states [B, T, H] of packed rows tokens [B, T]."""
  b = tokens.shape[0]
  return model(tokens, positions, model.init_cache(b, 0), segment_mask(seg)).hidden


def loss_fn(model, head_w, remap, batch):
  """Cross-entropy against the target's greedy tokens over the head rows head_w (remap: label
  id -> row, -1 outside the subset), and the accuracy of those labels."""
  hidden = hidden_states(model, batch["tokens"], batch["seg"], batch["positions"])
  logits = jnp.einsum("bth,vh->btv", hidden, head_w, preferred_element_type=jnp.float32)
  lab = remap[batch["labels"]]                                           # -1 = outside subset
  valid = (batch["seg"] > 0) & (lab >= 0)
  lab = jnp.maximum(lab, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab)
  n = jnp.maximum(valid.sum(), 1)
  acc = jnp.sum((jnp.argmax(logits, -1) == lab) & valid) / n
  return jnp.sum(ce * valid) / n, acc


def optimizer(model: Qwen3, lr: float, weight_decay: float) -> nnx.Optimizer:
  """AdamW over the trainable parameters (not the embedding), clipped at norm 1, its learning
  rate a hyperparameter that train_step sets every step."""
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b1=0.9, b2=0.98,
                                                         weight_decay=weight_decay))
  return nnx.Optimizer(model, tx, wrt=TRAINABLE)


@nnx.jit
def train_step(model, opt, head_w, remap, batch, lr):
  """One AdamW step at learning rate lr (the schedule follows the clock: `train`)."""
  opt.opt_state[1].hyperparams["learning_rate"][...] = lr
  grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, TRAINABLE), has_aux=True)
  (loss, acc), grads = grad_fn(model, head_w, remap, batch)
  opt.update(model, grads)
  return loss, acc


@nnx.jit
def predict(model, tokens):
  """Full-vocabulary greedy next tokens [1, T] of one sequence tokens [1, T] (padding last)."""
  t = tokens.shape[1]
  hidden = hidden_states(model, tokens, jnp.ones_like(tokens), jnp.arange(t)[None])
  return jnp.argmax(model.logits(hidden), -1)


def evaluate(model: Qwen3, data: Data, gamma: int) -> dict:
  """Held-out agreement with the target's greedy token (all positions, answer positions) and
  the teacher-forced tau of gamma drafts per iteration along the answer (mean accepted + 1)."""
  t = -(-int(max(data.ends[data.eval_idx] - data.starts[data.eval_idx])) // 128) * 128
  hits_all, hits_ans, runs = [], [], []
  for i in data.eval_idx:
    s, e, pl = data.starts[i], data.ends[i], data.prompt_lens[i]
    n = e - s
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = data.tokens[s:e]
    hit = np.asarray(predict(model, jnp.asarray(tokens)))[0, :n] == data.greedy[s:e]
    hits_all.append(hit)
    hits_ans.append(hit[pl:])
    pos = np.arange(pl, n - 1)                                           # anchors
    _, ok = data.labels(i, pos, gamma + 1)                               # [A, gamma]
    q = np.minimum(pos[:, None] + np.arange(gamma)[None], n - 1)
    runs.append(np.cumprod(hit[q] & ok, axis=1).sum(1) + 1)
  return dict(agree_all=float(np.concatenate(hits_all).mean()),
              agree_answer=float(np.concatenate(hits_ans).mean()),
              tau=float(np.concatenate(runs).mean()))


def export(model: Qwen3, out_dir: str, target_dir: str, info: dict) -> None:
  """Writes the HF Llama directory (bfloat16) and training.json, then renames it into place."""
  config = store.read_hf_config(target_dir)
  config.update(num_hidden_layers=model.cfg.num_layers, torch_dtype="bfloat16")
  dest = Path(out_dir).resolve()
  tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
  store.export_hf(nnx.state(model, nnx.Param), tmp, convert_qwen3.hf_name, config,
                       dtype=jnp.bfloat16)
  (tmp / "training.json").write_text(json.dumps(info, indent=1) + "\n")
  os.replace(tmp, dest)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The optimiser and its clock: AdamW at peak lr after `warmup` steps, cosine over the seconds
  left before `deadline` (time.time()), a minute kept for the final evaluation."""
  lr: float
  weight_decay: float
  warmup: int
  deadline: float
  log_every: int
  seq_len: int
  rows_per_step: int
  vocab_subset: int
  draft_len: int
  seed: int


def _log(message: str) -> None:
  print(message, flush=True)


def train(model: Qwen3, data: Data, train_idx: np.ndarray, s: Schedule,
          log: Callable[[str], None] = _log) -> dict:
  """Trains `model` in place on the sequences train_idx of `data` until the schedule's deadline;
  returns the steps, the minutes, the held-out evaluation before and after, and the log."""
  vocab = model.cfg.vocab_size
  in_train = np.zeros(len(data.tokens), bool)
  for i in train_idx:
    in_train[data.starts[i]:data.ends[i]] = True
  counts = np.bincount(data.greedy[in_train], minlength=vocab)
  subset = np.argsort(-counts)[:s.vocab_subset or vocab]
  log(f"training head: {len(subset)} ids cover {counts[subset].sum() / counts.sum():.4f} of "
      "training labels")
  remap = np.full(vocab, -1, np.int32)
  remap[subset] = np.arange(len(subset))
  head_w = model.embed_tokens.embedding[...][jnp.asarray(subset)]         # [V', H]
  remap = jnp.asarray(remap)

  opt = optimizer(model, s.lr, s.weight_decay)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, TRAINABLE)))
  log(f"drafter: {model.cfg.num_layers} layers, {n_params / 1e6:.2f}M trainable params")

  before = evaluate(model, data, s.draft_len)
  log(f"eval before: {before}")
  rows = packed_rows(data, train_idx, s.seq_len, np.random.default_rng(s.seed))

  def next_batch():
    cols = list(zip(*(next(rows) for _ in range(s.rows_per_step))))
    return {k: jnp.asarray(np.stack(c)) for k, c in
            zip(("tokens", "labels", "seg", "positions"), cols)}

  # The learning rate follows the clock (CPU contention changes the step time): warm-up over the
  # first steps, then cosine over the fraction of the training budget spent (floor 5%).
  t_train = time.time()
  budget = max(s.deadline - t_train - 60, 30)                              # a minute for eval
  step, losses, accs, history = 0, [], [], []
  batch = next_batch()
  while time.time() - t_train < budget:
    frac = (time.time() - t_train) / budget
    lr = s.lr * min(1.0, (step + 1) / s.warmup) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
    loss, acc = train_step(model, opt, head_w, remap, batch, jnp.float32(lr))
    batch = next_batch()  # overlaps with the async step
    losses.append(float(loss))
    accs.append(float(acc))
    step += 1
    if step % s.log_every == 0:
      el = time.time() - t_train
      row = dict(step=step, loss=float(np.mean(losses[-s.log_every:])),
                 acc=float(np.mean(accs[-s.log_every:])), lr=lr, minutes=el / 60)
      history.append(row)
      log(f"step {step} loss {row['loss']:.4f} acc {row['acc']:.3f} lr {lr:.2e} | "
          f"{el / step:.2f} s/step, {el / 60:.1f} min")
  minutes = (time.time() - t_train) / 60
  after = evaluate(model, data, s.draft_len)
  log(f"eval after {step} steps ({minutes:.1f} min): {after}")
  return dict(steps=step, train_minutes=minutes, before=before, after=after, log=history)
