"""A compile-only report: every case of the decoding program (or a drafter's training step)
compiled for a TPU topology, a GPU or the host CPU without the hardware, its costs read
(aot_costs) and written as <output>.json and .md after each program, so a killed run keeps
what it compiled."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import jax
from flax import nnx

from cure_jax.analysis import aot_costs, aot_programs, compiled_report, report
from cure_jax.costs import gpu_targets
from cure_jax.runtime import pipeline, sharding, xla_options
from cure_jax.runtime.generation import platform_prefill_chunk
from cure_jax.training import program


def _log(message: str) -> None:
  print(message, flush=True)


@dataclasses.dataclass(frozen=True)
class Settings:
  """What to compile (experiments.aot's flags, after a config's `aot` field)."""
  target: str
  drafter: str
  topology: str
  output: str
  methods: tuple[str, ...]
  programs: tuple[str, ...]
  v_maxes: tuple[int, ...]
  batches: tuple[int, ...]
  max_len: int
  prompt_len: int
  dump_hlo: str
  compiler_options: tuple[str, ...]
  synthetic_vocab: bool


def _write(output: str, meta: dict, records: list[dict], markdown: str) -> None:
  pipeline.write_json(output + ".json", json.loads(json.dumps(dict(meta=meta, records=records),
                                                              default=str)))
  report.write_text(output + ".md", markdown)


def compile_report(config, s: Settings, log: Callable[[str], None] = _log) -> dict:
  """Compiles every case of `s` for s.topology with the decoding `config`; returns the report
  {meta, records} it wrote. A program the compiler refuses is recorded and the run goes on."""
  if s.topology == "cpu" and config.dtype == "bfloat16":
    log("note: the CPU backend upcasts bf16 weights (temporaries of the model's size); CPU "
        "figures are meaningful in float32 (--config.dtype=float32)")
  dump = aot_programs.gpu_setup(s.topology)
  devices = gpu_targets.topology_devices(s.topology)
  options = xla_options.platform_options(devices[0].platform,
                                      pipeline.compiler_options(list(s.compiler_options)))
  with config.unlocked():   # 0: the compiled-for platform's default, not this host's
    config.prefill_chunk = platform_prefill_chunk(int(config.prefill_chunk), devices[0].platform)
  mesh = sharding.make_mesh(int(config.mesh.data), int(config.mesh.model), devices=devices)
  needs_drafter = any(m != "ar" for m in s.methods)
  target, drafter = aot_programs.abstract_pair(s.target, s.drafter if needs_drafter else None,
                                               pipeline.dtype_of(config))
  target.numerics = config.get("numerics", "default")       # models/numerics.py
  target.layer_kernels = bool(config.get("layer_kernels", True))  # models/kernels/gpu_layer.py
  sharding.check_models(mesh, target, drafter)
  for b in s.batches:
    if b % mesh.shape[sharding.DATA]:
      raise ValueError(f"--batch={b} does not divide by mesh.data={mesh.shape['data']}")
  graphdef, params = nnx.split((target, drafter))
  params = sharding.Placement(mesh).annotate(params)
  vocab, vocab_from = (aot_programs.draft_vocab_ids(config, s.drafter, target.cfg.vocab_size,
                                                    s.synthetic_vocab)
                       if needs_drafter else ((), "all"))
  meta = dict(target=s.target, drafter=s.drafter if needs_drafter else None,
              topology=s.topology, device_kind=devices[0].device_kind,
              mesh=[int(mesh.shape["data"]), int(mesh.shape["model"])], dtype=config.dtype,
              max_len=s.max_len, prompt_len=s.prompt_len, jax=jax.__version__,
              prefill_chunk=int(config.prefill_chunk), numerics=target.numerics,
              layer_kernels=target.layer_kernels,
              compiler_options=options, draft_vocab=len(vocab), draft_vocab_ids=vocab_from)
  chunks = aot_costs.prefill_chunks(s.prompt_len, int(config.prefill_chunk))
  records = []
  for case in aot_programs.cases(s.programs, s.methods, s.v_maxes, s.batches):
    meta["weights"] = aot_costs.weight_bytes(target, drafter, mesh, case.batch, s.max_len,
                                             len(vocab))
    lowered = aot_programs.lower_case(case, graphdef, params, config, mesh, drafter, s.max_len,
                                      s.prompt_len, vocab)
    try:
      rec = aot_costs.analyse(case, lowered, meta["weights"], dump, options,
                              aot_programs.verify_tokens(case, drafter), chunks, s.dump_hlo)
    except jax.errors.JaxRuntimeError as e:   # does not fit, or the compiler failed: on we go
      rec = aot_costs.failure(case, e)
      log(f"{case.name}: did not compile ({compiled_report.mb(rec['bytes_asked'])} MB of "
          f"{rec['memory']} asked): {rec['error'].splitlines()[0][:300]}")
    records.append(rec)
    it = rec.get("iteration")
    if it:
      log(f"{case.name}: compile {rec['compile_s']:.1f} s, HBM {it['hbm_bytes'] / 1e9:.2f} GB "
          f"per iteration ({rec['bounds']['hbm_over_weights_and_kv']:.3f}x weights + KV), XLA "
          f"{rec['xla_bytes_accessed'] / 1e9:.2f} GB, {it['collectives']}")
    _write(s.output, meta, records, compiled_report.markdown(meta, records))
  return dict(meta=meta, records=records)


def train_report(config, target_dir: str, topology: str, output: str, train_len: int,
                 dump_hlo: str = "", log: Callable[[str], None] = _log) -> dict:
  """Compiles the online training step of a drafter training config (training/program.py)
  for `topology` with rows of train_len tokens; returns the record it wrote."""
  aot_programs.gpu_setup(topology)
  devices = gpu_targets.topology_devices(topology)
  target, _ = aot_programs.abstract_pair(target_dir, None, pipeline.DTYPES[config.target.dtype])
  meta, rec = program.compile_train(config, target, devices, topology, train_len,
                                    dump_hlo or None)
  meta["target"] = target_dir
  log(program.summary(rec))
  _write(output, meta, [rec], program.markdown(meta, rec))
  return rec
