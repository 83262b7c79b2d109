"""Trains a DFlash block drafter for SmolLM2-135M-Instruct on data from make_drafter_data.

DFlash training as the paper does it: a random anchor position p inside the target's own
continuation; the block is [token_p, mask x (K-1)] at positions p..p+K-1; the context is the
target features of every token before p (the anchor's own features are not in the context, as at
inference); the labels are tokens p+1..p+K-1; the loss is cross-entropy with position-decayed
weights w_k = exp(-(k-1)/gamma). Many anchors share one sequence: its context K/V are projected
once and each block sees them under its own context-length mask. The target's embedding and
(tied) head are frozen; the head is restricted to the most frequent label ids during training
only (the exported drafter uses the full head). Drafter layers start from the target's top
layers, `norm` from the target's final norm, and fc/hidden_norm so that the context equals the
input of the first copied layer (hidden_states[L0] through that layer's input_layernorm).

    PYTHONPATH=. python -m experiments.train_drafter --data=runs/drafter_data \
        --out=runs/drafter_ckpt --export=cure_jax/assets/smollm2_dflash --max_minutes=45
"""

from __future__ import annotations

import glob
import json
import math
import os
import tempfile
import time

# XLA's constant folding of zero-cache prefills takes minutes per shape on CPU; skip it.
os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=constant_folding")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from cure_jax import default_model
from cure_jax.models.dflash import DFlash, DFlashConfig
from cure_jax.models.layers import attend

FLAGS = flags.FLAGS
flags.DEFINE_list("data", ["runs/drafter_data", "runs/drafter_text"],
                  "Folders written by make_drafter_data (generate and text modes).")
flags.DEFINE_float("text_weight", 0.5, "Sampling weight of a text-mode answer token relative to "
                   "a generated one.")
flags.DEFINE_string("out", "runs/drafter_ckpt", "Checkpoint folder (HF DFlash format).")
flags.DEFINE_string("export", None, "Also write the final drafter here (bfloat16).")
flags.DEFINE_string("target", None, "Target HF dir (default: the converted packaged SmolLM2).")
flags.DEFINE_integer("num_layers", 2, "Drafter layers.")
flags.DEFINE_integer("init_from", -1, "First target layer to copy (-1: the top num_layers).")
flags.DEFINE_integer("block_size", 16, "DFlash block size K.")
flags.DEFINE_integer("mask_token_id", 15, "Mask token (<jupyter_script>, never emitted).")
flags.DEFINE_integer("vocab_subset", 8192, "Training head: most frequent label ids (0 = full).")
flags.DEFINE_integer("seqs_per_step", 8, "Sequences per step.")
flags.DEFINE_integer("anchors_per_seq", 32, "Anchors (blocks) per sequence per step.")
flags.DEFINE_float("prompt_anchor_frac", 0.0, "Fraction of anchors drawn inside the prompt.")
flags.DEFINE_float("lr", 6e-4, "Peak learning rate.")
flags.DEFINE_float("fc_lr_mult", 1.0, "Learning-rate multiplier for fc / hidden_norm.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
flags.DEFINE_integer("warmup", 30, "Warm-up steps.")
flags.DEFINE_integer("steps", 100000, "Step cap (the time budget usually ends training).")
flags.DEFINE_float("max_minutes", 45.0, "Training time budget (cosine schedule spans it).")
flags.DEFINE_float("gamma", 4.0, "Position decay of the loss weights.")
flags.DEFINE_integer("loss_positions", 15, "Train the first N block positions only (the head is "
                     "the costliest part on CPU and later positions weigh little).")
flags.DEFINE_integer("eval_seqs", 24, "Held-out sequences (by uid) for evaluation.")
flags.DEFINE_integer("eval_every", 100, "Steps between evaluations / checkpoints.")
flags.DEFINE_integer("eval_stride", 3, "Evaluate every n-th continuation anchor.")
flags.DEFINE_integer("log_every", 10, "Steps between log lines.")
flags.DEFINE_integer("seed", 0, "Seed (init and batch sampling).")
flags.DEFINE_integer("split_seed", 0, "Seed of the held-out split (keep it when resuming).")
flags.DEFINE_string("eval_uids", None, "JSON file {eval_uids: [...]}: held-out sequences by prompt "
                    "uid (overrides the seeded split; keeps it fixed when the data grows).")
flags.DEFINE_string("resume", None, "Start from this HF DFlash directory instead of the target.")
flags.DEFINE_string("measure", None, "Skip training: measure chain / cure tau of this DFlash "
                    "directory on HumanEval prompts 0-19 (float32, greedy, chat template).")
flags.DEFINE_integer("measure_prompts", 20, "HumanEval prompts 0..N-1 for --measure.")
flags.DEFINE_integer("measure_new_tokens", 128, "New tokens per prompt for --measure.")
flags.DEFINE_list("measure_methods", ["ar", "chain", "cure:margin", "cure:earliest",
                                      "cure:expected_gain"], "Methods for --measure.")
flags.DEFINE_integer("measure_batch", 10, "Prompts per batch for --measure.")
flags.DEFINE_string("measure_out", None, "JSON file for --measure results.")

_LEN_BUCKET = 128


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

class Data:
  """All shards of one or more data folders in memory (features float16)."""

  def __init__(self, folders: list[str], eval_seqs: int, seed: int, eval_uids=None):
    self.meta = json.load(open(os.path.join(folders[0], "meta.json")))
    toks, feats, greedy, offs, plens, gen, uids = [], [], [], [], [], [], []
    base = 0
    for folder in folders:
      meta = json.load(open(os.path.join(folder, "meta.json")))
      if meta["target_layer_ids"] != self.meta["target_layer_ids"]:
        raise ValueError(f"{folder} has target_layer_ids {meta['target_layer_ids']}, expected "
                         f"{self.meta['target_layer_ids']}")
      generated = meta.get("mode", "generate") == "generate"
      paths = sorted(glob.glob(os.path.join(folder, "shard_*.npz")))
      for path in paths:
        with np.load(path) as z:
          toks.append(z["tokens"])
          feats.append(z["features"])
          greedy.append(z["greedy"])
          offs.append(z["offsets"][:-1] + base)
          plens.append(z["prompt_lens"])
          uids.append(z["uids"])
          gen.append(np.full(len(z["prompt_lens"]), generated))
          base += len(z["tokens"])
      print(f"data: {folder}: {len(paths)} shards", flush=True)
    if not toks:
      raise FileNotFoundError(f"no shard_*.npz in {folders}; run make_drafter_data first")
    self.tokens = np.concatenate(toks)
    self.features = np.concatenate(feats)
    self.greedy = np.concatenate(greedy)
    # match[t]: the text's next token is the target's greedy choice after token t.
    self.match = np.append(self.tokens[1:] == self.greedy[:-1], False)
    self.starts = np.concatenate(offs)
    self.ends = np.append(self.starts[1:], len(self.tokens))
    self.prompt_lens = np.concatenate(plens)
    self.generated = np.concatenate(gen)
    self.uids = np.concatenate(uids)
    n = len(self.starts)
    gen_idx = np.flatnonzero(self.generated)
    if eval_uids is not None:  # a fixed held-out set, e.g. across data that grew since
      self.eval_idx = np.flatnonzero(self.generated & np.isin(self.uids, eval_uids))
    else:
      rng = np.random.default_rng(seed)
      self.eval_idx = np.sort(rng.permutation(gen_idx)[:eval_seqs])
    self.train_idx = np.setdiff1d(np.arange(n), self.eval_idx)
    lens = self.ends - self.starts
    self.cont = lens - self.prompt_lens
    ans = self.match[np.concatenate([np.arange(s + p, e - 1) for s, e, p in
                                     zip(self.starts, self.ends, self.prompt_lens)])]
    print(f"data: {n} sequences ({int(self.generated.sum())} generated), {len(self.tokens)} "
          f"tokens ({int(self.cont.sum())} answer, {int(self.cont[self.generated].sum())} "
          f"generated); target agrees with answer text on {ans.mean():.3f}; features "
          f"{self.features.shape} {self.features.dtype}; eval {len(self.eval_idx)} seqs", flush=True)

  def label_counts(self, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for i in self.train_idx:
      s, e = self.starts[i], self.ends[i]
      np.add.at(counts, self.greedy[s + self.prompt_lens[i]:e - 1], 1)
    return counts

  def labels(self, i: int, pos: np.ndarray, k: int):
    """Labels [A, K-1] and validity for anchors pos (relative to sequence i): label j is the
    target's greedy token after pos + j - 1, valid while the text before it is greedy too."""
    s, e = self.starts[i], self.ends[i]
    n = e - s
    g, m = self.greedy[s:e], self.match[s:e]
    q = pos[:, None] + np.arange(k - 1)[None]                            # token whose next we want
    inside = q < n - 1
    qc = np.minimum(q, n - 1)
    lab = g[qc]
    ok = np.cumprod(np.concatenate([np.ones((len(pos), 1), bool), m[qc[:, :-1]]], axis=1),
                    axis=1).astype(bool) & inside
    return lab.astype(np.int32), ok

  def batch(self, idx: np.ndarray, anchors_per_seq: int, k: int, mask_id: int, prompt_frac: float,
            rng):
    """Arrays for one step: sequences idx, A anchors each inside the answer (a prompt_frac share
    inside the prompt)."""
    n_max = int(max(self.ends[i] - self.starts[i] for i in idx))
    t = -(-n_max // _LEN_BUCKET) * _LEN_BUCKET
    b, a = len(idx), anchors_per_seq
    feats = np.zeros((b, t, self.features.shape[1]), np.float16)
    blocks = np.full((b, a, k), mask_id, np.int32)
    labels = np.zeros((b, a, k - 1), np.int32)
    lmask = np.zeros((b, a, k - 1), bool)
    anchors = np.zeros((b, a), np.int32)
    for r, i in enumerate(idx):
      s, e, pl = self.starts[i], self.ends[i], self.prompt_lens[i]
      n = e - s
      feats[r, :n] = self.features[s:e]
      seq = self.tokens[s:e]
      cand = np.arange(pl, n - 1)
      n_prompt = rng.binomial(a, prompt_frac) if pl > 2 else 0
      pos = np.concatenate([
          rng.choice(cand, size=a - n_prompt, replace=len(cand) < a - n_prompt),
          rng.integers(1, pl - 1, size=n_prompt) if n_prompt else np.zeros(0, int)])
      anchors[r] = pos
      blocks[r, :, 0] = seq[pos]
      labels[r], lmask[r] = self.labels(i, pos, k)
    return dict(features=feats, blocks=blocks, anchors=anchors, labels=labels, label_mask=lmask)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def make_config(target_cfg, num_layers: int, block_size: int, mask_token_id: int,
                target_layer_ids) -> DFlashConfig:
  return DFlashConfig(
      hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
      num_layers=num_layers, num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
      head_dim=target_cfg.head_dim, rms_eps=target_cfg.rms_eps, rope=target_cfg.rope,
      block_size=block_size, mask_token_id=mask_token_id,
      target_layer_ids=tuple(target_layer_ids), num_target_layers=target_cfg.num_layers)


def init_from_target(drafter: DFlash, target, first_layer: int, feature_layers, seed: int):
  """Copies target layers first_layer.. into the drafter; fc/hidden_norm reproduce that layer's
  context input when hidden_states[first_layer] is among the features."""
  h = target.cfg.hidden_size
  for i, layer in enumerate(drafter.layers):
    src = target.layers[first_layer + i]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      getattr(layer.self_attn, name).kernel[...] = getattr(src.self_attn, name).kernel[...]
    for name in ("gate_proj", "up_proj", "down_proj"):
      getattr(layer.mlp, name).kernel[...] = getattr(src.mlp, name).kernel[...]
    layer.input_layernorm.weight[...] = src.input_layernorm.weight[...]
    layer.post_attention_layernorm.weight[...] = src.post_attention_layernorm.weight[...]
  drafter.norm.weight[...] = target.norm.weight[...]
  rng = np.random.default_rng(seed)
  n = len(feature_layers)
  fc = rng.normal(0, 0.02 / math.sqrt(n), (n * h, h)).astype(np.float32)
  if first_layer in feature_layers:
    j = list(feature_layers).index(first_layer)
    fc[j * h:(j + 1) * h] += np.eye(h, dtype=np.float32)
    drafter.hidden_norm.weight[...] = target.layers[first_layer].input_layernorm.weight[...]
  drafter.fc.kernel[...] = jnp.asarray(fc)


def train_forward(drafter: DFlash, embed, features, blocks, anchors):
  """Block hidden states [B, A, K, H] for blocks [B, A, K] anchored at anchors [B, A], with the
  context = features [B, T, F] of tokens before each anchor."""
  b, t, _ = features.shape
  a, k = blocks.shape[1:]
  ctx_pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  ck, cv = drafter.context_kv(features, ctx_pos)                        # [L, B, T, KVH, D]
  pos = anchors[..., None] + jnp.arange(k)                              # [B, A, K]
  ctx_mask = jnp.arange(t)[None, None, None, :] < anchors[:, :, None, None]   # [B, A, 1, T]
  ctx_mask = jnp.broadcast_to(ctx_mask, (b, a, k, t))
  block_mask = jnp.ones((b, a, k, k), bool)
  x = embed[blocks].astype(drafter.dtype)
  cfg = drafter.cfg
  for i, layer in enumerate(drafter.layers):
    attn = layer.self_attn
    hn = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(hn).reshape(b, a, k, cfg.num_heads, cfg.head_dim))
    q = cfg.rope(q, pos)
    kk, vv = attn.kv(hn, pos)
    out = attend(q, ck[i], cv[i], kk, vv, ctx_mask, block_mask)
    x = x + attn.o_proj(out.reshape(b, a, k, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
  return drafter.norm(x)


def position_weights(k: int, gamma: float) -> jnp.ndarray:
  return jnp.exp(-jnp.arange(k - 1, dtype=jnp.float32) / gamma)


def loss_fn(drafter, embed, head_w, remap, batch, weights):
  hidden = train_forward(drafter, embed, batch["features"], batch["blocks"], batch["anchors"])
  n = weights.shape[0]
  logits = jnp.einsum("bakh,vh->bakv", hidden[:, :, 1:1 + n], head_w,
                      preferred_element_type=jnp.float32)
  lab = remap[batch["labels"][..., :n]]                                 # -1 = outside subset
  valid = batch["label_mask"][..., :n] & (lab >= 0)
  lab = jnp.maximum(lab, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab)
  w = weights[None, None] * valid
  loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-6)
  correct = (jnp.argmax(logits, -1) == lab) & valid
  return loss, (jnp.sum(correct, (0, 1)), jnp.sum(valid, (0, 1)),
                jnp.sum(ce * valid, (0, 1)))


@nnx.jit
def train_step(drafter, opt, embed, head_w, remap, batch, weights, lr):
  opt.opt_state[1].hyperparams["learning_rate"][...] = lr
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, aux), grads = grad_fn(drafter, embed, head_w, remap, batch, weights)
  opt.update(drafter, grads)
  return loss, aux


@nnx.jit
def _predict(drafter, embed, feats, blocks, anchors):
  """Full-vocabulary greedy drafts [B, A, K-1] (the shipped head)."""
  hidden = train_forward(drafter, embed, feats, blocks, anchors)
  logits = jnp.einsum("bakh,vh->bakv", hidden[:, :, 1:], embed, preferred_element_type=jnp.float32)
  return jnp.argmax(logits, -1)


def evaluate(drafter, embed, data: Data, k: int, mask_id: int, a: int = 64, stride: int = 1):
  """Every continuation anchor of the held-out generated sequences, full head: per-position
  accuracy (over valid labels) and the teacher-forced chain tau (mean accepted run + 1)."""
  correct = np.zeros(k - 1)
  count = np.zeros(k - 1)
  runs = []
  for i in data.eval_idx:
    s, e, pl = data.starts[i], data.ends[i], data.prompt_lens[i]
    n = e - s
    all_pos = np.arange(pl, n - 1, stride)
    t = -(-n // _LEN_BUCKET) * _LEN_BUCKET
    feats = np.zeros((1, t, data.features.shape[1]), np.float16)
    feats[0, :n] = data.features[s:e]
    seq = data.tokens[s:e]
    for c0 in range(0, len(all_pos), a):
      pos = all_pos[c0:c0 + a]
      m = len(pos)
      pos_p = np.concatenate([pos, np.full(a - m, pos[0])])
      blocks = np.full((1, a, k), mask_id, np.int32)
      blocks[0, :, 0] = seq[pos_p]
      pred = np.asarray(_predict(drafter, embed, jnp.asarray(feats), jnp.asarray(blocks),
                                 jnp.asarray(pos_p[None].astype(np.int32))))[0, :m]
      lab, ok = data.labels(i, pos, k)
      hit = (pred == lab) & ok
      correct += hit.sum(0)
      count += ok.sum(0)
      runs.extend((np.cumprod(hit, axis=1).sum(1) + 1).tolist())
  return correct / np.maximum(count, 1), float(np.mean(runs)) if runs else 0.0


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

def hf_config(cfg: DFlashConfig, target_dir: str) -> dict:
  tcfg = json.load(open(os.path.join(target_dir, "config.json")))
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
      "torch_dtype": "bfloat16",
      "block_size": cfg.block_size,
      "num_target_layers": cfg.num_target_layers,
      "dflash_config": {"mask_token_id": cfg.mask_token_id,
                        "target_layer_ids": list(cfg.target_layer_ids)},
  }


def export(drafter: DFlash, out_dir: str, target_dir: str, dtype=jnp.bfloat16, extra=None) -> str:
  """Writes config.json + model.safetensors (HF [out, in] layout, no prefix) atomically."""
  from safetensors.numpy import save_file

  tensors = {}
  for path, value in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
    names = [str(p) for p in path]
    arr = np.asarray(jnp.asarray(value.get_value(), dtype))
    if names[-1] == "kernel":
      names[-1] = "weight"
      arr = arr.T
    tensors[".".join(names)] = np.ascontiguousarray(arr)
  out_dir = os.path.abspath(out_dir)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
  cfg = hf_config(drafter.cfg, target_dir)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
  if extra:
    with open(os.path.join(tmp, "training.json"), "w") as f:
      json.dump(extra, f, indent=1)
  os.chmod(tmp, 0o755)
  for n in os.listdir(tmp):
    os.chmod(os.path.join(tmp, n), 0o644)
  if os.path.exists(out_dir):
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    import shutil
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.replace(tmp, out_dir)
  return out_dir


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def measure(drafter_dir: str, target_dir: str) -> dict:
  """Chain and cure tau on HumanEval 0..N-1 with our decoder; checks outputs against target AR."""
  from transformers import AutoTokenizer

  from convert.dflash import load_drafter
  from convert.qwen3 import load_target
  from cure_jax import prompts as prompts_lib, repair
  from cure_jax.generation import Generator

  target = load_target(target_dir, jnp.float32, progress=False)
  drafter = load_drafter(drafter_dir, jnp.float32, progress=False, target_cfg=target.cfg)
  tok = AutoTokenizer.from_pretrained(target_dir)
  rows = prompts_lib.humaneval_prompts()[:FLAGS.measure_prompts]
  ids = prompts_lib.encode(rows, tok, True, target.cfg.vocab_size)
  out, ref = {}, None
  for m in FLAGS.measure_methods:
    method, _, select = m.partition(":")
    cure = repair.RepairConfig(select=select, max_depth=drafter.cfg.block_size - 1) \
        if method == "cure" else None
    gen = Generator(target, drafter if method != "ar" else None, method=method,
                    max_new_tokens=FLAGS.measure_new_tokens, stop_ids=(2,), cure=cure)
    t0 = time.time()
    res = []
    for i in range(0, len(ids), FLAGS.measure_batch):
      res.extend(gen.generate(ids[i:i + FLAGS.measure_batch]))
    lens = [a for r in res for a in r.accept_lengths]
    row = dict(tau=float(np.mean(lens)), iterations=len(lens),
               tokens=sum(len(r.output_ids) for r in res), wall_s=time.time() - t0)
    if method == "ar":
      ref = [r.output_ids for r in res]
    elif ref is not None:
      row["equal_to_ar"] = sum(r.output_ids == a for r, a in zip(res, ref))
    if method == "cure":
      gains = [s["repair_gain"] for r in res for s in r.stats]
      row["repair_won"] = int(sum(g > 0 for g in gains))
      row["repair_gain_tokens"] = int(sum(gains))
    out[m] = row
    print(f"measure {m}: {row}", flush=True)
  if FLAGS.measure_out:
    with open(FLAGS.measure_out, "w") as f:
      json.dump(out, f, indent=1)
  return out


def main(argv):
  del argv
  from convert.qwen3 import load_target

  if FLAGS.measure:
    measure(FLAGS.measure, FLAGS.target or default_model.smollm2_dir())
    return

  t_start = time.time()
  target_dir = FLAGS.target or default_model.smollm2_dir()
  target = load_target(target_dir, jnp.float32, progress=False)
  eval_uids = (json.load(open(FLAGS.eval_uids))["eval_uids"] if FLAGS.eval_uids else None)
  data = Data(FLAGS.data, FLAGS.eval_seqs, FLAGS.split_seed, eval_uids)
  json.dump(dict(eval_uids=[int(u) for u in data.uids[data.eval_idx]]),
            open(os.path.join(os.path.dirname(os.path.abspath(FLAGS.out)),
                              os.path.basename(FLAGS.out) + ".eval_uids.json"), "w"))
  layer_ids = data.meta["target_layer_ids"]
  feature_layers = [i + 1 for i in layer_ids]
  k = FLAGS.block_size
  cfg = make_config(target.cfg, FLAGS.num_layers, k, FLAGS.mask_token_id, layer_ids)
  if FLAGS.resume:
    from convert.dflash import load_drafter
    drafter = load_drafter(FLAGS.resume, jnp.float32, progress=False, target_cfg=target.cfg)
  else:
    drafter = DFlash(cfg, jnp.float32, rngs=nnx.Rngs(FLAGS.seed))
    first = FLAGS.init_from if FLAGS.init_from >= 0 else target.cfg.num_layers - FLAGS.num_layers
    init_from_target(drafter, target, first, feature_layers, FLAGS.seed)
    print(f"init: drafter layers <- target layers {first}..{first + FLAGS.num_layers - 1}; "
          f"features hidden_states{feature_layers}", flush=True)
  embed = target.embed_tokens.embedding[...]
  vocab = embed.shape[0]
  if FLAGS.vocab_subset:
    counts = data.label_counts(vocab)
    subset = np.argsort(-counts)[:FLAGS.vocab_subset]
    cover = counts[subset].sum() / max(counts.sum(), 1)
    print(f"training head: {len(subset)} ids cover {cover:.4f} of continuation labels", flush=True)
  else:
    subset = np.arange(vocab)
  remap = np.full(vocab, -1, np.int32)
  remap[subset] = np.arange(len(subset))
  head_w = embed[jnp.asarray(subset)]
  remap = jnp.asarray(remap)
  weights = position_weights(k, FLAGS.gamma)[:FLAGS.loss_positions]

  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
  print(f"drafter: {cfg.num_layers} layers, {n_params / 1e6:.2f}M params", flush=True)

  rng = np.random.default_rng(FLAGS.seed)
  train_idx = data.train_idx
  w_seq = np.maximum(data.cont[train_idx] - 1, 1).astype(np.float64)
  w_seq *= np.where(data.generated[train_idx], 1.0, FLAGS.text_weight)
  w_seq /= w_seq.sum()

  def sample_batch():
    idx = rng.choice(train_idx, size=FLAGS.seqs_per_step, p=w_seq, replace=False)
    return data.batch(idx, FLAGS.anchors_per_seq, k, FLAGS.mask_token_id,
                      FLAGS.prompt_anchor_frac, rng)

  budget_s = FLAGS.max_minutes * 60
  total_steps = FLAGS.steps

  # The learning rate follows the clock, not the step count: CPU contention from other jobs
  # changes the step time several-fold, and a time budget is what ends training. Warm-up over
  # the first steps, then cosine over the fraction of the training time budget spent (floor 5%).
  def lr_at(step, frac):
    warm = min(1.0, (step + 1) / FLAGS.warmup)
    frac = min(max(frac, 0.0), 1.0)
    return FLAGS.lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.inject_hyperparams(optax.adamw)(learning_rate=FLAGS.lr, b1=0.9, b2=0.98,
                                                         weight_decay=FLAGS.weight_decay))
  opt = nnx.Optimizer(drafter, tx, wrt=nnx.Param)
  log = []
  acc0, tau0 = evaluate(drafter, embed, data, k, FLAGS.mask_token_id,
                          stride=FLAGS.eval_stride)
  print(f"eval step 0: held-out acc/pos {np.round(acc0, 3).tolist()} teacher-forced tau "
        f"{tau0:.3f}", flush=True)
  t_train = time.time()
  train_budget = max(budget_s - (t_train - t_start) - 60, 60)  # keep a minute for eval/export
  frac = 0.0
  lr = lr_at(0, 0.0)
  corr = np.zeros(FLAGS.loss_positions)
  cnt = np.zeros(FLAGS.loss_positions)
  losses = []
  step = 0
  next_batch = sample_batch()
  while step < total_steps:
    batch = {kk: jnp.asarray(v) for kk, v in next_batch.items()}
    frac = (time.time() - t_train) / train_budget
    lr = lr_at(step, frac)
    loss, (c, n, _) = train_step(drafter, opt, embed, head_w, remap, batch, weights,
                                 jnp.float32(lr))
    next_batch = sample_batch()  # overlaps with the async step
    loss = float(loss)
    step += 1
    corr += np.asarray(c)
    cnt += np.asarray(n)
    losses.append(loss)
    el = time.time() - t_train
    if step == 5:
      t5 = time.time()
    if step == 15:
      per = (time.time() - t5) / 10
      print(f"measured {per:.2f} s/step; the time budget allows ~"
            f"{int(train_budget / per)} steps", flush=True)
    if step % FLAGS.log_every == 0:
      acc = corr / np.maximum(cnt, 1)
      print(f"step {step} loss {np.mean(losses[-FLAGS.log_every:]):.4f} lr "
            f"{lr:.2e} train acc pos1-4 {np.round(acc[:4], 3).tolist()} "
            f"mean {acc.mean():.3f} | {el / step:.2f} s/step, {el / 60:.1f} min", flush=True)
      log.append(dict(step=step, loss=float(np.mean(losses[-FLAGS.log_every:])),
                      train_acc=acc.tolist(), t=el))
      corr[:] = 0
      cnt[:] = 0
    out_of_time = time.time() - t_train > train_budget
    if step % FLAGS.eval_every == 0 or step == total_steps or out_of_time:
      acc, tau = evaluate(drafter, embed, data, k, FLAGS.mask_token_id,
                          stride=FLAGS.eval_stride)
      print(f"eval step {step}: held-out acc/pos {np.round(acc, 3).tolist()} "
            f"teacher-forced tau {tau:.3f}", flush=True)
      log.append(dict(step=step, eval_acc=acc.tolist(), eval_tau=tau))
      export(drafter, FLAGS.out, target_dir, jnp.float32,
             extra=dict(step=step, log=log, flags=FLAGS.flag_values_dict()))
      if out_of_time:
        break
  if FLAGS.export:
    export(drafter, FLAGS.export, target_dir, jnp.bfloat16)
    print(f"exported {FLAGS.export}", flush=True)
  print(f"done: {step} steps in {(time.time() - t_train) / 60:.1f} min", flush=True)


if __name__ == "__main__":
  app.run(main)
