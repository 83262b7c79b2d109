"""A DFlash drafter training run: config checks, the drafter's start from the target, and the
Trainer (the optax loop, held-out evaluation, orbax checkpoints, export). The step's math is in
`objective`, the batches in `batches`, the HF export in `export`.

Drafter layers start from the target's top layers. The mesh is the decoder's (data, model): the
batch is split over `data`; the drafter, its AdamW state, the frozen target (online features)
and the heads are split over `model` by the decoder's partition rules (runtime/sharding.py) and
replicated over `data`; XLA inserts the collectives (the gradient all-reduce over `data`, the
tensor-parallel all-reduces over `model`). Multi-host (jax.distributed): every process loads
its own data folders and builds its rows of each global batch. Batch s is a function of (seed,
process, s) alone, so a checkpoint of (parameters, optimizer state, step) resumes exactly.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cure_jax.models import numerics
from cure_jax.models.dflash import DFlash, DFlashConfig
from cure_jax.runtime import pipeline, sharding
from cure_jax.training.batches import check_data, load_data
from cure_jax.training.export import export
from cure_jax.training.objective import (Hyper, Online, eval_step, position_weights,
                                         train_step)

FEATURES = ("stored", "online")


def _step_problems(config) -> list[str]:
  """What keeps the config from describing a training step (model, optimizer, dtypes)."""
  m, t = config.model, config.train
  problems = []
  if config.target.numerics not in numerics.MODES:
    problems.append(f"target.numerics={config.target.numerics!r} is not one of "
                    f"{list(numerics.MODES)}")
  if t.target_chunk < 1:
    problems.append(f"train.target_chunk={t.target_chunk} must be >= 1")
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
  return problems


def _raise(problems: list[str]) -> None:
  if problems:
    raise ValueError("bad training config: " + "; ".join(problems) + ".")


def check_program_config(config) -> None:
  """Fails when the config cannot describe a training step (to compile it, no data needed)."""
  _raise(_step_problems(config))


def check_config(config) -> None:
  """Fails before anything loads when the config cannot describe a training run."""
  problems = []
  if not config.target.path:
    problems.append("set target.path to the target's HF directory (or embedded:smollm2)")
  d = config.data
  if d.features not in FEATURES:
    problems.append(f"data.features={d.features!r} is not one of {list(FEATURES)}")
  if list(d.responses) and d.features != "online":
    problems.append("data.responses (tokens only) needs data.features=online")
  if not list(d.folders) and not list(d.responses):
    problems.append("set data.folders to folders written by experiments.train_drafter --stage=data"
                    " (or, with data.features=online, data.responses to responses files)")
  if not config.workdir:
    problems.append("set workdir (checkpoints go to workdir/checkpoints)")
  _raise(problems + _step_problems(config))


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
      getattr(layer.self_attn, name).kernel[...] = getattr(src.self_attn, name).columns()
    if target.cfg.qk_norm:  # a Llama target has none: the drafter's stay at 1
      for name in ("q_norm", "k_norm"):
        getattr(layer.self_attn, name).weight[...] = getattr(src.self_attn, name).weight[...]
    for name in ("gate_proj", "up_proj", "down_proj"):
      getattr(layer.mlp, name).kernel[...] = getattr(src.mlp, name).columns()
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


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  """A (data, model) mesh: config.mesh.model devices split each matrix, config.mesh.data
  (0: all the rest) split the batch; on one host a mesh may leave devices out."""
  devices = list(jax.devices() if devices is None else devices)
  model = int(config.mesh.model)
  if model < 1 or len(devices) % model:
    raise ValueError(f"mesh.model={model} must be >= 1 and divide the {len(devices)} devices")
  n = int(config.mesh.data) or len(devices) // model
  if n * model > len(devices) or (n * model < len(devices) and jax.process_count() > 1):
    raise ValueError(f"mesh.data * mesh.model = {n} * {model} but {len(devices)} devices are "
                     "available; use mesh.data=0 (all) or, on one host, at most that many")
  return sharding.make_mesh(n, model, devices[:n * model])


def opt_state_shardings(optimizer, params, mesh):
  """AdamW's moments sharded as the parameters (arrays or ShapeDtypeStructs with shardings)
  they follow; its counters replicated."""
  abstract = jax.eval_shape(optimizer.init, params)
  return optax.tree_map_params(optimizer, lambda _, s: s, abstract,
                               jax.tree.map(lambda x: x.sharding, params),
                               transform_non_params=lambda _: NamedSharding(mesh, P()))


def _log(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


class Trainer:
  """One training run: target, data, drafter, optimizer and checkpoints of config.

  A workdir that already holds checkpoints resumes from the latest one.
  """

  def __init__(self, config):
    from cure_jax.checkpoints.qwen3 import load_target
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
    target.numerics = config.target.numerics
    check_data(self.data, config, target.cfg)
    self.cfg = drafter_config(target.cfg, config.model)
    self.cfg.check_against(target.cfg)
    sharding.check_models(self.mesh, target)
    _log(f"data: {self.data.summary()}")
    self._set_heads(target)
    self.hyper = Hyper.of(config.train)
    self.graphdef, params = nnx.split(self._initial_drafter(target), nnx.Param)
    self.online, self.target = None, None                    # the frozen target (online)
    if self.data.online:
      target_graphdef, self.target = nnx.split(target)
      self.online = Online(target_graphdef, self.cfg.feature_layers, int(config.train.target_chunk))
    del target
    params = sharding.shard_state(params, self.mesh)
    optimizer = self.hyper.optimizer()
    opt_state = jax.jit(optimizer.init, out_shardings=opt_state_shardings(
        optimizer, params, self.mesh))(params)
    self.state = dict(params=params, opt_state=opt_state,
                      step=jax.device_put(jnp.int32(0), NamedSharding(self.mesh, P())))
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
    by_vocab = NamedSharding(self.mesh, P(sharding.MODEL, None))       # vocabulary-parallel
    self.embed = target.embed_tokens.embedding[...]
    head = target.head_weight()                                         # [V, H]
    self.head = jax.device_put(head, by_vocab)
    vocab = head.shape[0]
    subset = np.arange(vocab)
    if t.vocab_subset:
      counts = self.data.label_counts(vocab)
      subset = np.sort(np.argsort(-counts, kind="stable")[:t.vocab_subset])
      _log(f"training head: {len(subset)} ids cover "
           f"{counts[subset].sum() / max(counts.sum(), 1):.4f} of the answer labels")
    remap = np.full(vocab, -1, np.int32)
    remap[subset] = np.arange(len(subset))
    if len(subset) % self.mesh.shape[sharding.MODEL]:
      raise ValueError(f"train.vocab_subset={len(subset)} must divide by mesh.model="
                       f"{self.mesh.shape[sharding.MODEL]}")
    self.train_head = jax.device_put(head[jnp.asarray(subset)], by_vocab)
    self.remap = jax.device_put(remap, replicated)
    self.weights = jax.device_put(position_weights(self.cfg.block_size, t.gamma,
                                                   t.loss_positions), replicated)

  def _initial_drafter(self, target) -> DFlash:
    m = self.config.model
    dtype = pipeline.DTYPES[m.dtype]
    if m.init_drafter:
      from cure_jax.checkpoints.dflash import load_drafter
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

  def batch(self, step: int, process: int | None = None, processes: int | None = None) -> dict:
    """The rows of batch `step` that process `process` of `processes` (default: this one of
    this job) builds: a function of seed, process and step only."""
    t, m = self.config.train, self.config.model
    process = jax.process_index() if process is None else process
    processes = jax.process_count() if processes is None else processes
    rng = np.random.default_rng([t.seed, process, step])
    return self.data.train_batch(t.seqs_per_step // processes, t.anchors_per_seq,
                                 m.block_size, m.mask_token_id, self.config.data.prompt_anchor_frac,
                                 rng)

  def take_step(self, batch: dict | None = None) -> dict:
    """One training step on this process's rows of `batch` (default: its rows of batch
    `step`, built while the previous step ran)."""
    step, t0 = self.step, time.perf_counter()
    if batch is None:
      batch = self._next[1] if self._next and self._next[0] == step else self.batch(step)
    frozen = dict(embed=self.embed, head=self.train_head, remap=self.remap,
                  weights=self.weights, target=self.target)
    self.state, metrics = train_step(self.graphdef, self.hyper, self.online, self.state, frozen,
                                     self._put(batch))
    self._next = (step + 1, self.batch(step + 1))
    metrics = jax.device_get(metrics)
    row = dict(step=step + 1, loss=float(metrics["loss"]), lr=float(self.hyper.schedule(step)),
               train_acc=(metrics["correct"] / np.maximum(metrics["count"], 1)).tolist(),
               step_s=time.perf_counter() - t0)  # wall time, the next batch's rows included
    self.history.append(row)
    return row

  def evaluate(self) -> dict:
    """Held-out per-position accuracy (full head) and teacher-forced tau."""
    e, m = self.config.eval, self.config.model
    total = None
    for batch in self.data.eval_batches(e.rows // jax.process_count(), e.anchors, m.block_size,
                                        m.mask_token_id, e.stride):
      frozen = dict(embed=self.embed, head=self.head, target=self.target)
      out = jax.device_get(eval_step(self.graphdef, self.online, self.state["params"], frozen,
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
             f"{(time.time() - t0) / 60:.1f} min, this step {row['step_s']:.2f} s")
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
    params = sharding.to_host(self.state["params"])   # all processes take part
    if jax.process_index() == 0:
      export(params, self.cfg, out, self.target_dir, pipeline.DTYPES[c.export.dtype],
             extra=dict(step=self.step, history=self.history, config=c.to_dict()))
      _log(f"exported step {self.step} to {out}")
    return Path(out)
