"""Drafter training data: the target's own responses, with the target features a drafter reads.

A DFlash drafter conditions on hidden states of the target at a few layers (`target_layer_ids`)
and learns to predict the target's next tokens. The target writes the responses itself (greedy
or sampled, through its chat template) in one batched, jitted while loop that keeps the
features of every token it feeds: no second, teacher-forced pass (on CPU that pass costs as
much per token as decoding). Sequences are written in shards, atomically, as batches finish;
a run skips prompts whose uid a shard already holds, so generation resumes after any stop.

A data folder: `meta.json` (target, target_layer_ids, feature_layers, hidden, feature_dtype,
mode) and `shard_NNNN.npz` with sequences back to back: tokens [N], offsets [S + 1],
prompt_lens [S], uids [S], stopped [S], features [N, F] (bfloat16 stored as its uint16 bits),
greedy [N] (the target's argmax after each token: the label source).

A folder written for online training (the target recomputes features inside the training step,
training/features.py) holds no features: meta feature_dtype "none".

Features take ~5.8 KB per token (bf16, SmolLM2's 5 x 576): too large to keep anywhere but the
data folder. The responses themselves are small: `write_responses` stores the tokens of every
sequence in one compressed file that can be committed, and `rebuild` recomputes the features and
labels from it with one teacher-forced pass per batch, several times faster than decoding on CPU
(the decode step there is bound by attention over the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import random
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cure_jax.runtime import pipeline, prompts as prompts_lib

FEATURE_DTYPE = "bfloat16"
NO_FEATURES = "none"      # meta feature_dtype of a tokens-only folder
_META_KEYS = ("target_layer_ids", "feature_layers", "hidden")


@dataclasses.dataclass
class Shards:
  """Every sequence of one or more data folders, back to back."""
  tokens: np.ndarray       # [N] int32
  features: np.ndarray | None  # [N, F] bfloat16; None: online features (tokens only)
  greedy: np.ndarray       # [N] int32: target argmax after token t
  starts: np.ndarray       # [S] int64
  ends: np.ndarray         # [S] int64
  prompt_lens: np.ndarray  # [S] int32
  uids: np.ndarray         # [S] int64
  stopped: np.ndarray      # [S] bool: ended on a stop token (not at the length cap)
  generated: np.ndarray    # [S] bool: the target's own continuation (not external text)
  meta: dict


def prompt_uid(row: dict) -> int:
  """A prompt's id: its "uid" field, else a hash of its text, so the same prompt in two files or
  two runs is generated once."""
  if "uid" in row:
    return int(row["uid"])
  text = row["prompt"] if "prompt" in row else json.dumps(row["prompt_ids"])
  return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 1


# ----------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------

def save_shard(folder: str | Path, index: int, seqs: list[dict]) -> Path:
  """Writes sequences (dicts: uid, ids, prompt_len, stopped, greedy [n] and, unless the folder
  is tokens-only, features [n, F]) as shard `index`, atomically."""
  lens = [len(s["ids"]) for s in seqs]
  stored = "features" in seqs[0]
  for s, n in zip(seqs, lens):
    rows = len(s["features"]) if stored else n
    if rows != n or len(s["greedy"]) != n:
      raise ValueError(f"sequence {s['uid']}: {n} tokens but {rows} feature rows "
                       f"and {len(s['greedy'])} labels")
  arrays = {}
  if stored:
    features = np.concatenate([np.asarray(s["features"]) for s in seqs])
    arrays["features"] = features.astype(ml_dtypes.bfloat16).view(np.uint16)
  buf = io.BytesIO()
  np.savez(buf, tokens=np.concatenate([np.asarray(s["ids"], np.int32) for s in seqs]),
           offsets=np.cumsum([0] + lens).astype(np.int64),
           prompt_lens=np.array([s["prompt_len"] for s in seqs], np.int32),
           uids=np.array([s["uid"] for s in seqs], np.int64),
           stopped=np.array([s["stopped"] for s in seqs], bool),
           greedy=np.concatenate([np.asarray(s["greedy"], np.int32) for s in seqs]), **arrays)
  path = Path(folder) / f"shard_{index:04d}.npz"
  pipeline.write_atomic(path, buf.getvalue())
  return path


def _shard_paths(folder: Path) -> list[Path]:
  return sorted(folder.glob("shard_*.npz"))


def read_meta(folder: str | Path) -> dict:
  path = Path(folder) / "meta.json"
  if not path.is_file():
    raise FileNotFoundError(f"{folder} is not a drafter data folder (no meta.json); write one "
                            "with `python -m experiments.train_drafter --stage=data`")
  return json.loads(path.read_text())


def write_meta(folder: str | Path, meta: dict) -> None:
  """Writes meta.json; a folder that already holds shards of other target features is refused
  (its shards could not be trained on together with the new ones)."""
  folder = Path(folder)
  if (folder / "meta.json").is_file() and _shard_paths(folder):
    old = read_meta(folder)
    for key in _META_KEYS + ("feature_dtype",):
      if old.get(key) != meta.get(key):
        raise ValueError(f"{folder} holds shards with {key}={old.get(key)}, not {meta.get(key)}; "
                         "use another data folder or delete those shards")
  pipeline.write_json(str(folder / "meta.json"), meta)


def done_uids(folder: str | Path) -> tuple[set[int], int]:
  """uids already in a folder's shards, and the next free shard index."""
  uids, nxt = set(), 0
  for path in _shard_paths(Path(folder)):
    with np.load(path) as z:
      uids.update(int(u) for u in z["uids"])
    nxt = max(nxt, int(path.stem.split("_")[1]) + 1)
  return uids, nxt


def load_shards(folders: list[str] | str, features: bool = True) -> Shards:
  """Every shard of the folders in memory; all folders must hold the same target features.
  features=False (online training) reads tokens and labels only, of any folder."""
  folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
  if not folders:
    raise ValueError("no data folders given")
  meta = read_meta(folders[0])
  parts = {k: [] for k in ("tokens", "features", "greedy", "starts", "prompt_lens", "uids",
                           "stopped", "generated")}
  base = 0
  for folder in folders:
    m = read_meta(folder)
    for key in _META_KEYS:
      if m.get(key) != meta.get(key):
        raise ValueError(f"{folder} has {key}={m.get(key)} but {folders[0]} has "
                         f"{meta.get(key)}: train on folders written for the same drafter")
    if features and m.get("feature_dtype") == NO_FEATURES:
      raise ValueError(f"{folder} holds tokens only (written for online training): train on it "
                       "with --config.data.features=online")
    if features and m.get("feature_dtype") != FEATURE_DTYPE:
      raise ValueError(f"{folder} stores features as {m.get('feature_dtype')}, not "
                       f"{FEATURE_DTYPE}: regenerate it (--stage=data or --stage=rebuild)")
    for path in _shard_paths(Path(folder)):
      with np.load(path) as z:
        if features:
          parts["features"].append(z["features"].view(ml_dtypes.bfloat16))
        parts["tokens"].append(z["tokens"])
        parts["greedy"].append(z["greedy"])
        parts["starts"].append(z["offsets"][:-1] + base)
        parts["prompt_lens"].append(z["prompt_lens"])
        parts["uids"].append(z["uids"])
        parts["stopped"].append(z["stopped"])
        parts["generated"].append(np.full(len(z["uids"]), m.get("mode", "generate") == "generate"))
        base += len(z["tokens"])
  if not parts["tokens"]:
    raise FileNotFoundError(f"no shard_*.npz in {folders}; generate data first "
                            "(`python -m experiments.train_drafter --stage=data`)")
  cat = {k: np.concatenate(v) if v else None for k, v in parts.items()}
  starts = cat.pop("starts")
  return Shards(starts=starts, ends=np.append(starts[1:], len(cat["tokens"])), meta=meta, **cat)


def load_responses(paths: list[str] | str) -> Shards:
  """The sequences of responses files (write_responses) for online training: tokens only, each
  token labelled with the next one (the target's own choice: its argmax when the responses are
  greedy, a sample of its distribution when sampled)."""
  paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
  parts, meta = {k: [] for k in ("tokens", "lengths", "prompt_lens", "uids", "stopped")}, None
  for path in paths:
    if not Path(path).is_file():
      raise FileNotFoundError(f"no responses file {path} (write one with --stage=data and "
                              "--config.generate.responses)")
    with np.load(path) as z:
      meta = meta or json.loads(z["meta"].tobytes())
      for key in parts:
        parts[key].append(z[key])
  cat = {k: np.concatenate(v) for k, v in parts.items()}
  starts = np.concatenate([[0], np.cumsum(cat["lengths"])[:-1]]).astype(np.int64)
  tokens = cat["tokens"].astype(np.int32)
  greedy = np.append(tokens[1:], 0).astype(np.int32)
  greedy[starts[1:] - 1] = 0                   # a sequence's last token has no label
  return Shards(tokens=tokens, features=None, greedy=greedy, starts=starts,
                ends=starts + cat["lengths"], prompt_lens=cat["prompt_lens"], uids=cat["uids"],
                stopped=cat["stopped"], generated=np.ones(len(starts), bool),
                meta={**meta, "feature_dtype": NO_FEATURES})


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("feature_layers", "max_new", "max_len",
                                             "temperature"))
def generate(target, prompt, prompt_len, stops, rng, *, feature_layers: tuple[int, ...],
             max_new: int, max_len: int, temperature: float = 0.0):
  """Decodes a batch, keeping the features of every token it feeds (one forward per token).

  prompt [B, P] right-padded, prompt_len [B], stops [E] stop ids. temperature 0 is greedy.
  Returns new ids [B, N] (0 after a stop), their count [B], prompt features [B, P, F] and
  prompt argmax [B, P], features of the new tokens [B, N, F] (row j: new token j, fed at step
  j + 1) and the argmax after each new token [B, N].
  """
  b, p = prompt.shape
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  causal = jnp.tril(jnp.ones((p, p), bool))[None] & (jnp.arange(p)[None, None] <
                                                     prompt_len[:, None, None])
  # The prompt attends to itself only: an empty cache (a zero-filled one would be constant-
  # folded by XLA, for minutes on CPU).
  out = target(prompt, positions, target.init_cache(b, 0), causal, feature_layers)
  p_greedy = jnp.argmax(target.logits(out.hidden), -1).astype(jnp.int32)     # [B, P]
  last = jnp.take_along_axis(out.hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]

  def pick(hidden, key):
    logits = target.logits(hidden)                                            # [B, V]
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    if temperature == 0.0:
      return greedy, greedy
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32), greedy

  rng, key = jax.random.split(rng)
  first, _ = pick(last, key)
  cache = target.init_cache(b, max_len).append(out.k, out.v, prompt_len)
  n_feat = out.features.shape[-1]
  toks = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(first)
  feats = jnp.zeros((b, max_new, n_feat), jnp.bfloat16)
  greedy = jnp.zeros((b, max_new), jnp.int32)
  done = jnp.isin(first, stops)
  count = jnp.ones((b,), jnp.int32)

  def cond(c):
    i, _, _, _, _, done, _, _ = c
    return (i < max_new) & ~jnp.all(done)

  def body(c):
    i, cache, toks, feats, greedy, done, count, rng = c
    o = target(toks[:, i - 1][:, None], cache.lengths[:, None], cache, jnp.concatenate(
        [cache.visible()[:, None, :], jnp.ones((b, 1, 1), bool)], axis=-1), feature_layers)
    rng, key = jax.random.split(rng)
    nxt, arg = pick(o.hidden[:, 0], key)
    nxt = jnp.where(done, 0, nxt)
    cache = cache.append(o.k, o.v, jnp.ones((b,), jnp.int32))
    toks = toks.at[:, i].set(nxt)
    feats = feats.at[:, i - 1].set(o.features[:, 0].astype(jnp.bfloat16))
    greedy = greedy.at[:, i - 1].set(arg)
    count = count + (~done).astype(jnp.int32)
    return i + 1, cache, toks, feats, greedy, done | jnp.isin(nxt, stops), count, rng

  _, _, toks, feats, greedy, _, count, _ = jax.lax.while_loop(
      cond, body, (jnp.ones((), jnp.int32), cache, toks, feats, greedy, done, count, rng))
  return toks, count, out.features.astype(jnp.bfloat16), p_greedy, feats, greedy


def _sequence(uid: int, prompt: list[int], toks, count: int, p_feats, p_greedy, g_feats,
              g_greedy, stops) -> dict:
  """One stored sequence: prompt + response, a feature row and a label per token. The last
  response token is never fed, so it has neither (zeros / label 0: no anchor reads them)."""
  pl, c = len(prompt), int(count)
  resp = toks[:c]
  feats = np.concatenate([p_feats[:pl], g_feats[:c - 1], np.zeros_like(g_feats[:1])])
  labels = np.concatenate([p_greedy[:pl], g_greedy[:c - 1], [0]]).astype(np.int32)
  return dict(uid=uid, ids=list(prompt) + resp.tolist(), prompt_len=pl,
              stopped=bool(np.isin(resp[-1], stops)), features=feats, greedy=labels)


def _batches(todo: list[tuple[int, list[int]]], batch: int, buckets: list[int], seed: int):
  """Batches of similar prompt length (one compile per bucket), in shuffled order."""
  order = sorted(range(len(todo)), key=lambda k: len(todo[k][1]))
  out = []
  for lo, hi in zip([0] + buckets[:-1], buckets):
    grp = [k for k in order if lo < len(todo[k][1]) <= hi]
    out += [(hi, grp[i:i + batch]) for i in range(0, len(grp), batch)]
  random.Random(seed).shuffle(out)
  return out


def run(target, tokenizer, rows: list[dict], *, out: str | Path, target_dir: str,
        target_layer_ids: tuple[int, ...], stops: tuple[int, ...], batch_size: int = 16,
        max_new_tokens: int = 256, prompt_buckets: tuple[int, ...] = (160, 384),
        temperature: float = 0.0, seed: int = 0, max_minutes: float = 60.0,
        shard_batches: int = 1, responses: str | Path | None = None, log=print) -> dict:
  """Generates responses to every prompt row not yet in `out`, shard by shard, until done or
  `max_minutes` (checked between batches); after each shard, the whole folder's responses go to
  `responses` (see write_responses) when given. Returns throughput figures."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  feature_layers = tuple(int(i) + 1 for i in target_layer_ids)
  if max(feature_layers) > target.cfg.num_layers:
    raise ValueError(f"target_layer_ids {list(target_layer_ids)} go past the target's "
                     f"{target.cfg.num_layers} layers")
  if not stops:
    raise ValueError("no stop token ids: give the target's EOS ids (generation_config.json)")
  write_meta(out, dict(target=str(target_dir), target_layer_ids=list(target_layer_ids),
                       feature_layers=list(feature_layers), hidden=target.cfg.hidden_size,
                       feature_dtype=FEATURE_DTYPE, mode="generate", temperature=temperature,
                       max_new_tokens=max_new_tokens, stops=list(stops)))
  buckets = sorted(int(b) for b in prompt_buckets)
  ids = prompts_lib.encode(rows, tokenizer, True, target.cfg.vocab_size)
  done, shard = done_uids(out)
  seen, todo, too_long = set(done), [], 0
  for row, p in zip(rows, ids):
    uid = prompt_uid(row)
    if uid in seen:
      continue
    seen.add(uid)
    if len(p) > buckets[-1]:
      too_long += 1
      continue
    todo.append((uid, p))
  batches = _batches(todo, batch_size, buckets, seed)
  log(f"{len(rows)} prompts: {len(done)} done already, {len(todo)} to do in {len(batches)} "
      f"batches of {batch_size}, {too_long} longer than {buckets[-1]} tokens skipped")
  stops_arr = jnp.asarray(stops, jnp.int32)
  rng = jax.random.key(seed)
  t0, new_tokens, pending = time.time(), 0, []
  for n, (bucket, members) in enumerate(batches):
    if time.time() - t0 > max_minutes * 60:
      log(f"time budget of {max_minutes} min reached after {n} batches; rerun to resume")
      break
    items = [todo[k] for k in members]
    padded = np.zeros((batch_size, bucket), np.int32)
    plens = np.ones((batch_size,), np.int32)  # pad rows: a 1-token prompt, dropped below
    for r, (_, p) in enumerate(items):
      padded[r, :len(p)], plens[r] = p, len(p)
    res = jax.device_get(generate(
        target, jnp.asarray(padded), jnp.asarray(plens), stops_arr, jax.random.fold_in(rng, n),
        feature_layers=feature_layers, max_new=max_new_tokens,
        max_len=bucket + max_new_tokens, temperature=float(temperature)))
    for r, (uid, p) in enumerate(items):
      pending.append(_sequence(uid, p, *(x[r] for x in res), stops))
      new_tokens += int(res[1][r])
    if (n + 1) % shard_batches == 0 or n == len(batches) - 1:
      save_shard(out, shard, pending)
      shard, pending = shard + 1, []
      if responses:
        write_responses(out, responses)
    el = time.time() - t0
    rate = new_tokens / el
    log(f"batch {n + 1}/{len(batches)} (prompts <= {bucket} tokens): {new_tokens} new tokens, "
        f"{rate:.1f} tok/s, {el / 60:.1f} min, ETA {(len(batches) - n - 1) * el / (n + 1) / 60:.0f}"
        f" min")
  if pending:
    save_shard(out, shard, pending)
  el = time.time() - t0
  return dict(new_tokens=new_tokens, seconds=el, tokens_per_s=new_tokens / max(el, 1e-9))


# ----------------------------------------------------------------------------------------------
# Responses: the small, committable record of a data folder
# ----------------------------------------------------------------------------------------------

def write_responses(folders: list[str] | str, path: str | Path) -> int:
  """Writes the tokens of every stored sequence (no features) to one compressed .npz, atomically;
  returns the number of sequences."""
  folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
  meta = read_meta(folders[0])
  parts = {k: [] for k in ("tokens", "lengths", "prompt_lens", "uids", "stopped")}
  for folder in folders:
    for shard in _shard_paths(Path(folder)):
      with np.load(shard) as z:
        parts["tokens"].append(z["tokens"])
        parts["lengths"].append(np.diff(z["offsets"]))
        for key in ("prompt_lens", "uids", "stopped"):
          parts[key].append(z[key])
  if not parts["tokens"]:
    raise FileNotFoundError(f"no shard_*.npz in {folders}: nothing to record")
  buf = io.BytesIO()
  np.savez_compressed(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                      **{k: np.concatenate(v) for k, v in parts.items()})
  pipeline.write_atomic(path, buf.getvalue())
  return int(sum(len(u) for u in parts["uids"]))


@functools.partial(jax.jit, static_argnames=("feature_layers",))
def teacher_forced(target, tokens, lengths, *, feature_layers: tuple[int, ...]):
  """Features [B, T, F] (bf16) and argmax [B, T] of right-padded sequences tokens [B, T]."""
  b, t = tokens.shape
  causal = jnp.tril(jnp.ones((t, t), bool))[None] & (jnp.arange(t)[None, None] <
                                                     lengths[:, None, None])
  out = target(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), target.init_cache(b, 0), causal,
               feature_layers)
  return (out.features.astype(jnp.bfloat16),
          jnp.argmax(target.logits(out.hidden), -1).astype(jnp.int32))


def rebuild(target, responses: str | Path, out: str | Path, *, target_dir: str,
            batch_size: int = 8, len_bucket: int = 128, log=print) -> int:
  """Recomputes a data folder from a responses file: features and labels by a teacher-forced
  pass (the last token's row zeroed, as decoding leaves it). Sequences already in `out` are
  skipped, so it resumes. Returns the number of sequences written."""
  with np.load(responses) as z:
    rec = {k: z[k] for k in z.files}
  meta = json.loads(rec.pop("meta").tobytes())
  if meta["hidden"] != target.cfg.hidden_size or max(meta["feature_layers"]) > target.cfg.num_layers:
    raise ValueError(f"{responses} was written for a target with hidden {meta['hidden']} and "
                     f"feature layers {meta['feature_layers']}; this target has hidden "
                     f"{target.cfg.hidden_size} and {target.cfg.num_layers} layers")
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  write_meta(out, {**meta, "target": str(target_dir), "feature_dtype": FEATURE_DTYPE,
                   "rebuilt_from": str(responses)})
  done, shard = done_uids(out)
  starts = np.concatenate([[0], np.cumsum(rec["lengths"])[:-1]])
  todo = [i for i in np.argsort(rec["lengths"], kind="stable") if int(rec["uids"][i]) not in done]
  feature_layers = tuple(meta["feature_layers"])
  t0, written, n_tokens = time.time(), 0, 0
  for first in range(0, len(todo), batch_size):
    rows = todo[first:first + batch_size]
    t = -(-int(rec["lengths"][rows].max()) // len_bucket) * len_bucket
    tokens = np.zeros((batch_size, t), np.int32)
    lengths = np.ones((batch_size,), np.int32)
    for r, i in enumerate(rows):
      n = int(rec["lengths"][i])
      tokens[r, :n], lengths[r] = rec["tokens"][starts[i]:starts[i] + n], n
    feats, greedy = jax.device_get(teacher_forced(target, jnp.asarray(tokens),
                                                  jnp.asarray(lengths),
                                                  feature_layers=feature_layers))
    seqs = []
    for r, i in enumerate(rows):
      n = int(lengths[r])
      f, g = feats[r, :n].copy(), greedy[r, :n].copy()
      f[-1], g[-1] = 0, 0  # the last token was never fed while decoding
      seqs.append(dict(uid=int(rec["uids"][i]), ids=tokens[r, :n], features=f, greedy=g,
                       prompt_len=int(rec["prompt_lens"][i]), stopped=bool(rec["stopped"][i])))
    save_shard(out, shard, seqs)
    shard, written = shard + 1, written + len(seqs)
    n_tokens += int(lengths[:len(rows)].sum())
    el = time.time() - t0
    log(f"rebuilt {written}/{len(todo)} sequences, {n_tokens / el:.0f} tok/s, {el / 60:.1f} min")
  return written
