"""The recipe's batches from stored drafter data (`data`): sequences split by prompt uid into
training and held-out, anchors drawn inside the answers, the target's greedy labels and padded
batch arrays. A batch carries the stored features [B, T, F] of its sequences, or, for online
features (training/features.py), their tokens [B, T] and lengths [B].

Multi-host: every process loads its own data folders and builds its rows of each global batch;
what every process must agree on (the padded context length, the number of evaluation batches,
label statistics) is reduced over all processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from cure_jax.training import data as drafter_data


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
    self.online = shards.features is None
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
    features = ("online" if self.online
                else f"{self.features.shape} {self.features.dtype}")
    return (f"{len(self.starts)} sequences ({int(self.generated.sum())} generated), "
            f"{len(self.tokens)} tokens ({int(cont.sum())} answer); features {features}; held "
            f"out {len(self.eval_idx)}")

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
    context = (dict(tokens=np.zeros((b, t), np.int32), lengths=np.ones((b,), np.int32))
               if self.online else                                         # [B, T], [B]
               dict(features=np.zeros((b, t, self.features.shape[1]), self.features.dtype)))
    blocks = np.full((b, a, k), mask_id, np.int32)                         # [B, A, K]
    anchors = np.zeros((b, a), np.int32)                                   # [B, A]
    labels = np.zeros((b, a, k - 1), np.int32)                             # [B, A, K-1]
    label_mask = np.zeros((b, a, k - 1), bool)
    anchor_mask = np.zeros((b, a), bool)
    for r, (i, pos) in enumerate(rows):
      s, e = self.starts[i], self.ends[i]
      m = len(pos)
      if self.online:
        context["tokens"][r, :e - s], context["lengths"][r] = self.tokens[s:e], e - s
      else:
        context["features"][r, :e - s] = self.features[s:e]
      anchors[r, :m] = pos
      blocks[r, :m, 0] = self.tokens[s:e][pos]
      labels[r, :m], label_mask[r, :m] = self.labels(i, pos, k)
      anchor_mask[r, :m] = True
    return dict(context, blocks=blocks, anchors=anchors, labels=labels, label_mask=label_mask,
                anchor_mask=anchor_mask)

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
  online = d.features == "online"
  where = lambda paths: [f.format(process=jax.process_index()) for f in paths]  # noqa: E731
  if d.responses:
    shards = drafter_data.load_responses(where(d.responses))
  else:
    shards = drafter_data.load_shards(where(d.folders), features=not online)
  eval_uids = json.loads(Path(d.eval_uids).read_text())["eval_uids"] if d.eval_uids else None
  return Data(shards, d.eval_seqs, d.split_seed, eval_uids, d.text_weight, d.len_bucket)


def check_data(data: Data, config, target_cfg) -> None:
  """The data must come from this target with the config's feature layers (stored features)."""
  if data.online:
    return
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
