"""Distils a small autoregressive (AR) drafter for the `ar_draft` baseline of SmolLM2-135M-Instruct.

The drafter is the target's Llama architecture cut to --num_layers layers, initialised from the
target layers --init_layers, the target's final norm and its (tied) embedding, which stays
frozen. Loss: cross-entropy against the target's greedy token after every position of every
training sequence (prompt and answer), from the train_drafter --stage=data shards; sequences are packed
into rows of --seq_len tokens. During training the head is restricted to the --vocab_subset most
frequent labels (CPU speed); evaluation and the exported drafter use the full head. The result is
an HF Llama directory (config.json + model.safetensors, bfloat16, tied) plus training.json.

    nice python -m experiments.train_ar_drafter --max_minutes=12 \
        --export=cure_jax/assets/smollm2_ar_drafter
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

# XLA's constant folding of zero-cache forwards takes minutes per shape on CPU; skip it.
os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=constant_folding")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

from cure_jax.checkpoints import qwen3 as convert_qwen3, store
from cure_jax.runtime import default_model, distributed, errors
from cure_jax.training import data as drafter_data
from cure_jax.training.batches import Data
from cure_jax.models.qwen3 import Qwen3

FLAGS = flags.FLAGS
flags.DEFINE_list("data", ["runs/drafter_data", "runs/drafter_text"],
                  "Folders written by train_drafter --stage=data (generate and text modes).")
flags.DEFINE_string("eval_uids", "runs/drafter_eval_uids.json", "JSON file {eval_uids: [...]}: "
                    "held-out sequences by prompt uid (empty: a seeded split of 10).")
flags.DEFINE_string("target", None, "Target HF dir (default: the converted packaged SmolLM2).")
flags.DEFINE_string("export", "cure_jax/assets/smollm2_ar_drafter", "Output HF directory.")
flags.DEFINE_integer("num_layers", 2, "Drafter layers.")
flags.DEFINE_integer("vocab_subset", 8192, "Training head: most frequent label ids (0 = full).")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
flags.DEFINE_integer("warmup", 20, "Warm-up steps.")
flags.DEFINE_float("max_minutes", 12.0, "Training time budget (cosine schedule spans it).")
flags.DEFINE_integer("log_every", 10, "Steps between log lines.")
flags.DEFINE_integer("seed", 0, "Seed (held-out split and batch order).")
flags.DEFINE_list("init_layers", ["0", "1"], "Target layer copied into each drafter layer (the "
                  "bottom layers: with a top layer, e.g. 0,29, the drafter starts at 0% agreement "
                  "and learns several times slower).")
flags.DEFINE_integer("seq_len", 512, "Packed row length (longer sequences are cropped).")
flags.DEFINE_integer("rows_per_step", 4, "Packed rows per step.")
flags.DEFINE_integer("draft_len", 4, "Drafted tokens per iteration (gamma) of the teacher-forced "
                     "tau.")


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Model and training step
# --------------------------------------------------------------------------------------------

TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))


def init_drafter(target: Qwen3, num_layers: int, init_layers: list[int]) -> Qwen3:
  """The target cut to num_layers layers, layer i copied from target layer init_layers[i]."""
  drafter = Qwen3(dataclasses.replace(target.cfg, num_layers=num_layers), jnp.float32, rngs=nnx.Rngs(0))
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
  hidden = hidden_states(model, batch["tokens"], batch["seg"], batch["positions"])
  logits = jnp.einsum("bth,vh->btv", hidden, head_w, preferred_element_type=jnp.float32)
  lab = remap[batch["labels"]]                                           # -1 = outside subset
  valid = (batch["seg"] > 0) & (lab >= 0)
  lab = jnp.maximum(lab, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab)
  n = jnp.maximum(valid.sum(), 1)
  acc = jnp.sum((jnp.argmax(logits, -1) == lab) & valid) / n
  return jnp.sum(ce * valid) / n, acc


@nnx.jit
def train_step(model, opt, head_w, remap, batch, lr):
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


# --------------------------------------------------------------------------------------------
# Evaluation, export
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def main(argv):
  del argv
  distributed.announce_devices()
  t_start = time.time()
  if Path(FLAGS.export).exists() and any(Path(FLAGS.export).iterdir()):
    raise FileExistsError(f"{FLAGS.export} exists; remove it or pass another --export")
  target_dir = FLAGS.target or default_model.smollm2_dir()
  target = convert_qwen3.load_target(target_dir, jnp.float32, progress=False)
  init_layers = [int(x) for x in FLAGS.init_layers]
  model = init_drafter(target, FLAGS.num_layers, init_layers)
  del target
  eval_uids = json.load(open(FLAGS.eval_uids))["eval_uids"] if FLAGS.eval_uids else None
  data = Data(drafter_data.load_shards(FLAGS.data), 10, FLAGS.seed, eval_uids)
  # No training sequence shares a prompt with a held-out one.
  train_idx = data.train_idx[~np.isin(data.uids[data.train_idx], data.uids[data.eval_idx])]
  n_train = int(np.minimum(data.ends - data.starts, FLAGS.seq_len)[train_idx].sum())
  print(f"train: {len(train_idx)} sequences, {n_train} tokens; held-out "
        f"{len(data.eval_idx)} sequences", flush=True)

  vocab = model.cfg.vocab_size
  in_train = np.zeros(len(data.tokens), bool)
  for i in train_idx:
    in_train[data.starts[i]:data.ends[i]] = True
  counts = np.bincount(data.greedy[in_train], minlength=vocab)
  subset = np.argsort(-counts)[:FLAGS.vocab_subset or vocab]
  print(f"training head: {len(subset)} ids cover {counts[subset].sum() / counts.sum():.4f} of "
        "training labels", flush=True)
  remap = np.full(vocab, -1, np.int32)
  remap[subset] = np.arange(len(subset))
  head_w = model.embed_tokens.embedding[...][jnp.asarray(subset)]         # [V', H]
  remap = jnp.asarray(remap)

  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.inject_hyperparams(optax.adamw)(learning_rate=FLAGS.lr, b1=0.9, b2=0.98,
                                                         weight_decay=FLAGS.weight_decay))
  opt = nnx.Optimizer(model, tx, wrt=TRAINABLE)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, TRAINABLE)))
  print(f"drafter: {FLAGS.num_layers} layers from target layers {init_layers}, "
        f"{n_params / 1e6:.2f}M trainable params", flush=True)

  before = evaluate(model, data, FLAGS.draft_len)
  print(f"eval before: {before}", flush=True)
  rows = packed_rows(data, train_idx, FLAGS.seq_len, np.random.default_rng(FLAGS.seed))

  def next_batch():
    cols = list(zip(*(next(rows) for _ in range(FLAGS.rows_per_step))))
    return {k: jnp.asarray(np.stack(c)) for k, c in
            zip(("tokens", "labels", "seg", "positions"), cols)}

  # The learning rate follows the clock (CPU contention changes the step time): warm-up over the
  # first steps, then cosine over the fraction of the training budget spent (floor 5%).
  t_train = time.time()
  budget = max(FLAGS.max_minutes * 60 - (t_train - t_start) - 60, 30)     # a minute for eval
  step, losses, accs, log = 0, [], [], []
  batch = next_batch()
  while time.time() - t_train < budget:
    frac = (time.time() - t_train) / budget
    lr = FLAGS.lr * min(1.0, (step + 1) / FLAGS.warmup) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
    loss, acc = train_step(model, opt, head_w, remap, batch, jnp.float32(lr))
    batch = next_batch()  # overlaps with the async step
    losses.append(float(loss))
    accs.append(float(acc))
    step += 1
    if step % FLAGS.log_every == 0:
      el = time.time() - t_train
      row = dict(step=step, loss=float(np.mean(losses[-FLAGS.log_every:])),
                 acc=float(np.mean(accs[-FLAGS.log_every:])), lr=lr, minutes=el / 60)
      log.append(row)
      print(f"step {step} loss {row['loss']:.4f} acc {row['acc']:.3f} lr {lr:.2e} | "
            f"{el / step:.2f} s/step, {el / 60:.1f} min", flush=True)
  minutes = (time.time() - t_train) / 60
  after = evaluate(model, data, FLAGS.draft_len)
  print(f"eval after {step} steps ({minutes:.1f} min): {after}", flush=True)
  info = dict(steps=step, train_minutes=minutes, train_sequences=len(train_idx),
              train_tokens=n_train, eval_uids=[int(u) for u in data.uids[data.eval_idx]],
              before=before, after=after, log=log,
              flags={k: FLAGS[k].value for k in ("data", "num_layers", "init_layers",
                                                 "vocab_subset", "seq_len", "rows_per_step",
                                                 "lr", "weight_decay", "warmup", "max_minutes",
                                                 "draft_len", "seed")})
  export(model, FLAGS.export, target_dir, info)
  print(f"exported {FLAGS.export}", flush=True)


if __name__ == "__main__":
  errors.run(main)
