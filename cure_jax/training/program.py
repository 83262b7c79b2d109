"""The training step as a program for hardware we do not hold, and what it costs.

`lower` builds every input of `objective.train_step` abstractly (ShapeDtypeStructs carrying the
Trainer's shardings: drafter and AdamW moments split over `model` by the decoder's rules, the
frozen target likewise, heads vocabulary-parallel, the batch over `data`) and lowers the step
exactly as the Trainer calls it; experiments.aot --programs=train compiles it for TPU topologies
and GPUs. `model_flops` counts the step's useful FLOPs from the shapes alone, the numerator of
its MFU.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cure_jax.costs import hlo_traffic, refusals, roofline
from cure_jax.models.dflash import DFlash
from cure_jax.runtime import pipeline, sharding
from cure_jax.training import objective, trainer
from cure_jax.training.trainer import drafter_config, opt_state_shardings


def _struct(shape, dtype, mesh, spec) -> jax.ShapeDtypeStruct:
  """An abstract array, sharded by spec over mesh (unsharded without one)."""
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=NamedSharding(mesh, spec) if mesh is not None else None)


def abstract_batch(config, seq_len: int, mesh) -> dict:
  """One global batch of the online mode: train.seqs_per_step sequences of seq_len tokens."""
  t, k = config.train, int(config.model.block_size)
  rows, a = int(t.seqs_per_step), int(t.anchors_per_seq)
  spec = lambda ndim: P(sharding.DATA, *(None,) * (ndim - 1))  # noqa: E731
  shapes = dict(tokens=((rows, seq_len), jnp.int32), lengths=((rows,), jnp.int32),
                blocks=((rows, a, k), jnp.int32), anchors=((rows, a), jnp.int32),
                labels=((rows, a, k - 1), jnp.int32), label_mask=((rows, a, k - 1), bool),
                anchor_mask=((rows, a), bool))
  return {name: _struct(shape, dtype, mesh, spec(len(shape)))
          for name, (shape, dtype) in shapes.items()}


def lower(config, target, mesh, seq_len: int):
  """The lowered online training step of config for an abstract target (nnx.eval_shape) on
  mesh, over sequences padded to seq_len tokens."""
  cfg = drafter_config(target.cfg, config.model)
  cfg.check_against(target.cfg)
  sharding.check_models(mesh, target)
  place = sharding.Placement(mesh)
  dtype = pipeline.DTYPES[config.model.dtype]
  drafter = nnx.eval_shape(lambda: DFlash(cfg, dtype, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(drafter, nnx.Param)
  params = place.annotate(params)
  hyper = objective.Hyper.of(config.train)
  optimizer = hyper.optimizer()
  opt_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(optimizer.init, params), opt_state_shardings(optimizer, params, mesh))
  state = dict(params=params, opt_state=opt_state, step=_struct((), jnp.int32, mesh, P()))
  target_graphdef, target_params = nnx.split(target)
  target_params = place.annotate(target_params)
  vocab, h = target.cfg.vocab_size, target.cfg.hidden_size
  head_rows = int(config.train.vocab_subset) or vocab
  weights = objective.position_weights(cfg.block_size, config.train.gamma,
                                       config.train.loss_positions)
  frozen = dict(embed=_struct((vocab, h), target.dtype, mesh, P(sharding.MODEL, None)),
                head=_struct((head_rows, h), target.dtype, mesh, P(sharding.MODEL, None)),
                remap=_struct((vocab,), jnp.int32, mesh, P()),
                weights=_struct(weights.shape, jnp.float32, mesh, P()), target=target_params)
  online = objective.Online(target_graphdef, cfg.feature_layers, int(config.train.target_chunk))
  with jax.set_mesh(mesh):   # the TPU attention kernel runs per shard of this mesh
    return objective.train_step.lower(graphdef, hyper, online, state, frozen,
                                      abstract_batch(config, seq_len, mesh))


def _layer_flops(h: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 keys: float) -> float:
  """Forward FLOPs of one decoder layer for one token attending to `keys` keys."""
  proj = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
  return 2 * (proj + 3 * h * inter) + 4 * keys * heads * head_dim


def _bullets(doc: str) -> str:
  """A docstring's bullet list, dedented (for reports)."""
  lines = [line.strip() for line in doc.split("\n\n", 1)[1].strip().splitlines()]
  return "\n".join(line if line.startswith("- ") else "  " + line for line in lines)


def model_flops(config, target_cfg, seq_len: int) -> dict:
  """The step's useful FLOPs, counted from shapes (2 per multiply-add), over the global batch:

  - target: the forward of every context token through the deepest feature layer, attending
    causally (on average (T + 1) / 2 keys);
  - drafter forward: fc over the concatenated features, each layer's context keys and values,
    every block token through each layer attending to the T context slots and its K block
    tokens (the training forward masks, it does not skip, context past the anchor), and the
    training head at the loss positions;
  - drafter backward: twice its forward, except fc and the head (frozen), which need one
    product each (fc's weights, the head's input), not two.
  """
  cfg = drafter_config(target_cfg, config.model)
  t = config.train
  rows, a, k = int(t.seqs_per_step), int(t.anchors_per_seq), cfg.block_size
  tokens, block_tokens = rows * seq_len, rows * a * k
  h, heads, kvh, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  depth = max(cfg.feature_layers)
  target = tokens * depth * _layer_flops(h, heads, kvh, d, target_cfg.intermediate_size,
                                         (seq_len + 1) / 2)
  target_attention = tokens * depth * 4 * (seq_len + 1) / 2 * heads * d
  fc = 2 * tokens * len(cfg.feature_layers) * h * h
  context_kv = cfg.num_layers * 2 * tokens * h * 2 * kvh * d
  blocks = block_tokens * cfg.num_layers * _layer_flops(h, heads, kvh, d, cfg.intermediate_size,
                                                        seq_len + k)
  head = 2 * rows * a * min(int(t.loss_positions), k - 1) * h * (
      int(t.vocab_subset) or target_cfg.vocab_size)
  drafter_fwd = fc + context_kv + blocks + head
  drafter_bwd = 2 * (context_kv + blocks) + fc + head
  total = target + drafter_fwd + drafter_bwd
  return dict(total=float(total), target_forward=float(target),
              target_attention=float(target_attention), drafter_forward=float(drafter_fwd),
              drafter_backward=float(drafter_bwd), tokens=tokens,
              block_tokens=block_tokens, rule=_RULE)



_RULE = _bullets(model_flops.__doc__)


def entry_labels(lowered) -> dict[int, str]:
  """HLO entry parameter number -> traffic label: drafter_weights, optimizer (AdamW moments),
  target_weights, target_head (embedding and training head) or input (batch, step, remap)."""
  leaves = jax.tree_util.tree_flatten_with_path(lowered.args_info)[0]
  kept = sorted(lowered._lowering.compile_args["kept_var_idx"])

  def label(path: str) -> str:
    for key, name in (("['params']", "drafter_weights"), ("['opt_state']", "optimizer"),
                      ("['target']", "target_weights"), ("['embed']", "target_head"),
                      ("['head']", "target_head")):
      if key in path:
        return name
    return "input"
  return {k: label(jax.tree_util.keystr(leaves[i][0])) for k, i in enumerate(kept)}


def record(config, target_cfg, lowered, compiled, device: str, chips: int, seq_len: int) -> dict:
  """What one compiled step costs per chip: memory, counted FLOPs (the program's and the
  model's), HBM traffic and bytes sent (costs.hlo_traffic), the projected step time and the MFU
  it implies, with perfect overlap (mfu) and with none (mfu_serial)."""
  mem, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
  traffic = hlo_traffic.count(compiled.as_text(), entry_labels(lowered))["program"]
  flops = model_flops(config, target_cfg, seq_len)
  # The program's dots, loops times their trips (XLA's cost analysis counts a loop body once);
  # a Pallas attention kernel's FLOPs are not in the HLO: the model's count of the target's
  # attention stands in for them.
  chip_flops = traffic["dot_flops"] + (flops["target_attention"] / chips if traffic["kernels"]
                                       else 0.0)
  sent = float(sum(traffic["collective_bytes"].values()))
  time = roofline.step_seconds(chip_flops, traffic["hbm_bytes"], sent, device)
  peak = roofline.DEVICES[device][1] * 1e12
  return dict(
      program="train", seqs_per_step=int(config.train.seqs_per_step), seq_len=seq_len,
      anchors_per_seq=int(config.train.anchors_per_seq), chips=chips,
      argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
      output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
      per_chip_bytes=mem.argument_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
      + mem.output_size_in_bytes, flops=flops["total"], model_flops=flops,
      xla_flops_per_chip=float(cost.get("flops", 0.0)), dot_flops_per_chip=traffic["dot_flops"],
      flops_per_chip=chip_flops, kernels=traffic["kernels"], hbm_bytes=traffic["hbm_bytes"],
      hbm_by_label=traffic["by_label"], collectives=traffic["collectives"],
      collective_bytes=traffic["collective_bytes"], collective_rule=hlo_traffic.COLLECTIVE_RULE,
      **time, mfu=flops["total"] / (chips * peak * time["step_s"]),
      mfu_serial=flops["total"] / (chips * peak * time["serial_s"]),
      tokens_per_s=flops["tokens"] / time["step_s"])


def compile_train(config, target, devices, topology: str, seq_len: int,
                  dump: str | None = None) -> tuple[dict, dict]:
  """(meta, record) of config's online training step compiled for `devices` (compile-only
  ones of `topology`); a program the compiler refuses is recorded with what it asked for.
  Raises ValueError for a config or mesh that cannot describe the step."""
  trainer.check_program_config(config)
  if seq_len < 2:
    raise ValueError(f"--train_len={seq_len} must be >= 2")
  mesh = trainer.make_mesh(config, devices)
  if config.train.seqs_per_step % mesh.shape[sharding.DATA]:
    raise ValueError(f"train.seqs_per_step={config.train.seqs_per_step} does not divide by "
                     f"mesh.data={mesh.shape[sharding.DATA]}")
  device = roofline.device_named(topology) if topology != "cpu" else "v5e"
  bw, peak, source = roofline.DEVICES[device]
  meta = dict(topology=topology, device_kind=devices[0].device_kind,
              mesh=[int(mesh.shape[sharding.DATA]), int(mesh.shape[sharding.MODEL])],
              jax=jax.__version__, drafter_dtype=config.model.dtype,
              target_dtype=config.target.dtype, figures_of=device,
              device_figures=dict(hbm_gbps=bw, bf16_tflops=peak,
                                  interconnect_gbps=roofline.INTERCONNECT[device][0],
                                  sources=[source, roofline.INTERCONNECT[device][1]]))
  case = f"train/b{config.train.seqs_per_step}/t{seq_len}"
  lowered = lower(config, target, mesh, seq_len)
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    return meta, dict(case=case, program="train", **refusals.read(e))
  if dump:
    Path(dump).mkdir(parents=True, exist_ok=True)
    (Path(dump) / "train.hlo").write_text(compiled.as_text())
  return meta, dict(case=case, compile_s=round(time.perf_counter() - t0, 2),
                    **record(config, target.cfg, lowered, compiled, device, len(devices),
                             seq_len))


def summary(rec: dict) -> str:
  """One line of a record: what it holds, its projected step and MFU, or why it failed."""
  if rec.get("failed"):
    asked = rec["bytes_asked"]
    return (f"{rec['case']}: did not compile ({asked / 1e9 if asked else float('nan'):.2f} GB "
            f"of {rec['memory']} asked): {rec['error'].splitlines()[0][:300]}")
  return (f"{rec['case']}: compile {rec['compile_s']:.0f} s, {rec['per_chip_bytes'] / 1e9:.2f} GB "
          f"per chip, step {rec['step_s']:.3f} s ({rec['bound']}; FLOPs {rec['flop_s']:.3f} s, "
          f"HBM {rec['hbm_s']:.3f} s, collectives {rec['collective_s']:.3f} s), MFU "
          f"{rec['mfu']:.3f} (serial {rec['mfu_serial']:.3f})")


def markdown(meta: dict, rec: dict) -> str:
  """The record as a short markdown report."""
  lines = [f"# Training step compiled: {meta['target']} on {meta['topology']}", "",
           f"mesh data={meta['mesh'][0]} model={meta['mesh'][1]}, jax {meta['jax']}, drafter "
           f"{meta['drafter_dtype']}, target {meta['target_dtype']}; figures of "
           f"{meta['figures_of']}: {meta['device_figures']}", "", summary(rec), ""]
  if not rec.get("failed"):
    flops = rec["model_flops"]
    lines += ["| per chip | value |", "|---|---|",
              f"| memory (arguments + temporaries + outputs - aliased) | "
              f"{rec['per_chip_bytes'] / 1e9:.2f} GB |",
              f"| program FLOPs (dots, loops x trips) | {rec['dot_flops_per_chip'] / 1e12:.2f} T |",
              f"| FLOPs timed (+ kernels' attention) | {rec['flops_per_chip'] / 1e12:.2f} T |",
              f"| model FLOPs / chips | {flops['total'] / rec['chips'] / 1e12:.2f} T |",
              f"| HBM traffic | {rec['hbm_bytes'] / 1e9:.2f} GB |",
              f"| bytes sent | {sum(rec['collective_bytes'].values()) / 1e9:.2f} GB |",
              f"| step: max / serial | {rec['step_s']:.3f} / {rec['serial_s']:.3f} s |",
              f"| MFU: overlap / serial | {rec['mfu']:.3f} / {rec['mfu_serial']:.3f} |",
              f"| tokens/s (context tokens, whole job) | {rec['tokens_per_s']:,.0f} |", "",
              "Model FLOPs:", "", flops["rule"], ""]
  return "\n".join(lines)


def random_inputs(config, target, seq_len: int, seed: int = 0):
  """Every argument of the online train_step on the default device, at random: the drafter
  (config.model, float32 by default) with its AdamW state, the target as given, a batch of
  train.seqs_per_step random sequences of seq_len tokens. For timing the step on a device, where
  what the numbers are does not change what a step costs. Returns (static, arrays) for
  train_step(*static[:3], *arrays)."""
  cfg = drafter_config(target.cfg, config.model)
  graphdef, params = nnx.split(DFlash(cfg, pipeline.DTYPES[config.model.dtype],
                                      rngs=nnx.Rngs(seed)), nnx.Param)
  hyper = objective.Hyper.of(config.train)
  state = dict(params=params, opt_state=hyper.optimizer().init(params), step=jnp.int32(0))
  target_graphdef, target_params = nnx.split(target)
  frozen = dict(embed=target.embed_tokens.embedding[...], head=target.head_weight(),
                remap=jnp.arange(target.cfg.vocab_size, dtype=jnp.int32),
                weights=jnp.asarray(objective.position_weights(
                    cfg.block_size, config.train.gamma, config.train.loss_positions)),
                target=target_params)
  rng = np.random.default_rng(seed)
  batch = {k: jnp.asarray(rng.integers(1, max(seq_len - cfg.block_size, 2), v.shape)
                          if k == "anchors" else
                          np.full(v.shape, seq_len) if k == "lengths" else
                          np.ones(v.shape, bool) if v.dtype == bool else
                          rng.integers(0, target.cfg.vocab_size - 1, v.shape), v.dtype)
           for k, v in abstract_batch(config, seq_len, None).items()}
  online = objective.Online(target_graphdef, cfg.feature_layers, int(config.train.target_chunk))
  return (graphdef, hyper, online), (state, frozen, batch)
