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

import json
import os
import time
from pathlib import Path

# XLA's constant folding of zero-cache forwards takes minutes per shape on CPU; skip it.
os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=constant_folding")

import jax.numpy as jnp
import numpy as np
from absl import flags

from cure_jax.checkpoints import qwen3 as convert_qwen3
from cure_jax.runtime import default_model, distributed, errors
from cure_jax.training import ar_drafter, data as drafter_data
from cure_jax.training.batches import Data

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


def main(argv):
  del argv
  distributed.announce_devices()
  t_start = time.time()
  if Path(FLAGS.export).exists() and any(Path(FLAGS.export).iterdir()):
    raise FileExistsError(f"{FLAGS.export} exists; remove it or pass another --export")
  target_dir = FLAGS.target or default_model.smollm2_dir()
  target = convert_qwen3.load_target(target_dir, jnp.float32, progress=False)
  init_layers = [int(x) for x in FLAGS.init_layers]
  model = ar_drafter.init_drafter(target, FLAGS.num_layers, init_layers)
  del target
  eval_uids = json.load(open(FLAGS.eval_uids))["eval_uids"] if FLAGS.eval_uids else None
  data = Data(drafter_data.load_shards(FLAGS.data), 10, FLAGS.seed, eval_uids)
  # No training sequence shares a prompt with a held-out one.
  train_idx = data.train_idx[~np.isin(data.uids[data.train_idx], data.uids[data.eval_idx])]
  n_train = int(np.minimum(data.ends - data.starts, FLAGS.seq_len)[train_idx].sum())
  print(f"train: {len(train_idx)} sequences, {n_train} tokens; held-out "
        f"{len(data.eval_idx)} sequences; drafter layers from target layers {init_layers}",
        flush=True)
  result = ar_drafter.train(model, data, train_idx, ar_drafter.Schedule(
      lr=FLAGS.lr, weight_decay=FLAGS.weight_decay, warmup=FLAGS.warmup,
      deadline=t_start + FLAGS.max_minutes * 60, log_every=FLAGS.log_every,
      seq_len=FLAGS.seq_len, rows_per_step=FLAGS.rows_per_step,
      vocab_subset=FLAGS.vocab_subset, draft_len=FLAGS.draft_len, seed=FLAGS.seed))
  info = dict(steps=result["steps"], train_minutes=result["train_minutes"],
              train_sequences=len(train_idx), train_tokens=n_train,
              eval_uids=[int(u) for u in data.uids[data.eval_idx]], before=result["before"],
              after=result["after"], log=result["log"],
              flags={k: FLAGS[k].value for k in ("data", "num_layers", "init_layers",
                                                 "vocab_subset", "seq_len", "rows_per_step",
                                                 "lr", "weight_decay", "warmup", "max_minutes",
                                                 "draft_len", "seed")})
  ar_drafter.export(model, FLAGS.export, target_dir, info)
  print(f"exported {FLAGS.export}", flush=True)


if __name__ == "__main__":
  errors.run(main)
