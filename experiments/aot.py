"""Compile the real decoding program for an accelerator we do not have, and read what it costs.

With libtpu installed (`pip install "jax[tpu]==<jax version>"`, no TPU needed),
`jax.experimental.topologies` gives compile-only TPU devices, and XLA's real TPU compiler builds
the program for them on this CPU host. Target and drafter are built abstractly
(`nnx.eval_shape`) from their config.json, so nothing is allocated and no checkpoint is read.
For each method (ar, chain, cure at each v_max) and batch this compiles prefill and the decode
loop exactly as `experiments.decode` would (`decoding.lower_sharded`), plus a 1-token target
forward, and records compile seconds, per-chip memory, collectives, fusions, XLA's cost
analysis and an independent count of the HBM traffic of one loop iteration
(`cure_jax.costs.hlo_traffic`), weights apart.

  python -m experiments.aot --config=configs/qwen3_8b.py --topology=v5e:2x2 --config.mesh.model=4
  python -m experiments.aot --config=configs/qwen3_8b.py --topology=cpu --config.dtype=float32 \
    --methods=ar,chain,cure --v_max=64 --batch=1

With a drafter training config, --programs=train compiles its online training step instead
(cure_jax/training/program.py), e.g. `--config=configs/train/qwen3_8b.py --programs=train
--topology=v5e:4x4 --config.mesh.model=4 --config.train.seqs_per_step=16`.

A config may carry an `aot` field (configs/qwen3_coder_30b_a3b.py): its target, drafter,
topology, methods, v_max, batch and output replace these flags' defaults; flags given on the
command line still win. Writes <output>.json and <output>.md (atomically). libtpu takes a lock
file: run one TPU compile process per machine at a time.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

# The CUDA plugin (jax[cuda12], for compile-only GPU topologies) refuses to load without a driver
# unless told not to check; it must be told before jax starts.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cure_jax.checkpoints import dflash as convert_dflash, qwen3 as convert_qwen3
from cure_jax.checkpoints.store import read_hf_config
from cure_jax import methods
from cure_jax.runtime import decoding, draft_vocab as draft_vocab_lib, errors, pipeline, sharding
from cure_jax.models.cache import KVCache
from cure_jax.runtime.generation import decoding_spec, platform_prefill_chunk
from cure_jax.costs import gpu_targets, hlo_traffic, launches, refusals
from cure_jax.analysis import compiled_report, report

_CONFIG = errors.config_flag("configs/qwen3_8b.py", "decoding config (dtype, mesh, cure settings)")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU topology (v5e:2x2, v6e:2x2, "
                                "v5p:2x2x1, ...) or 'cpu' for the host's CPU backend")
_TARGET = flags.DEFINE_string("target", "configs/hf/qwen3_8b", "HF directory of the target "
                              "(only config.json is read)")
_DRAFTER = flags.DEFINE_string("drafter", "configs/hf/qwen3_8b_dflash_b16", "DFlash directory "
                               "(only config.json is read)")
_METHODS = flags.DEFINE_list("methods", ["ar", "chain", "cure"], "methods to compile")
_V_MAX = flags.DEFINE_list("v_max", ["16", "32", "64"], "cure tree sizes")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "batch sizes")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "static cache length")
_PROMPT = flags.DEFINE_integer("prompt_len", 256, "prompt bucket (prefill length)")
_PROGRAMS = flags.DEFINE_list("programs", ["prefill", "decode", "forward"],
                              "what to compile: prefill, decode (the loop), forward (one "
                              "1-token target forward), or train (alone, with a drafter "
                              "training config)")
_TRAIN_LEN = flags.DEFINE_integer("train_len", 3072, "train: tokens per sequence (the padded "
                                  "context of one training row)")
_OUTPUT = flags.DEFINE_string("output", "results/aot/qwen3_8b", "output path without extension")
_DUMP_HLO = flags.DEFINE_string("dump_hlo", "", "folder: also write each optimized HLO module")
_OPTIONS = flags.DEFINE_list("compiler_options", [], "XLA options for every compile, name=value "
                             "(e.g. xla_gpu_experimental_force_split_k=1), kept in the report")
_SYNTHETIC_VOCAB = flags.DEFINE_bool("synthetic_vocab", False, "with --config.drafter.vocab=N "
                                      "and no token counts for this target: N seeded-random "
                                      "token ids stand in for the N most frequent, for the "
                                      "compile-only count (the bytes read depend on N, not on "
                                      "which ids); the report says so")
_RECOUNT = flags.DEFINE_bool("recount", False, "compile nothing: recount the HLO modules a run "
                             "dumped into --dump_hlo and rewrite its --output report")

METHODS = ("ar", "chain", "cure", "ddtree", "hybrid")
PROGRAMS = ("prefill", "decode", "forward", "train")


def setting(holder, config):
  """A flag's value: the command line's, else the config's `aot.<flag name>`, else the default."""
  aot = config.get("aot") or {}
  if holder.present or holder.name not in aot:
    return holder.value
  value = aot[holder.name]
  return value.split(",") if isinstance(holder.value, list) else value


# --- devices and models ------------------------------------------------------------------------

def abstract_pair(target_dir: str, drafter_dir: str | None, dtype):
  """(target, drafter) with ShapeDtypeStruct parameters, from the directories' config.json."""
  tcfg = read_hf_config(target_dir)
  target = nnx.eval_shape(lambda: convert_qwen3.FAMILY.build(tcfg, dtype))
  drafter = None
  if drafter_dir:
    dcfg = read_hf_config(drafter_dir)
    drafter = nnx.eval_shape(lambda: convert_dflash.FAMILY.build(dcfg, dtype))
    drafter.cfg.check_against(target.cfg)
  return target, drafter


@dataclasses.dataclass(frozen=True)
class Case:
  program: str
  method: str
  batch: int
  v_max: int = 0

  @property
  def name(self) -> str:
    v = f"/v{self.v_max}" if methods.get(self.method).tree_config else ""
    return f"{self.program}/{self.method}{v}/b{self.batch}"


def cases(programs, method_names, v_maxes, batches) -> list[Case]:
  out = []
  for b in batches:
    if "forward" in programs:
      out.append(Case("forward", "ar", b))
    for m in method_names:
      for v in (v_maxes if methods.get(m).tree_config else [0]):
        out += [Case(p, m, b, v) for p in ("prefill", "decode") if p in programs]
  return out


# --- programs ----------------------------------------------------------------------------------

def _label_of(path: str, program: str) -> str:
  """Traffic label of a flattened argument: decode / prefill take (params, state, ...), forward
  takes (params, tokens, k, v, lengths); params are the (target, drafter) state."""
  if path.startswith("[0][1]"):
    return "drafter_weights"
  if path.startswith("[0]"):
    return "target_head" if ("lm_head" in path or "embed_tokens" in path) else "target_weights"
  if program == "forward":
    return "target_kv" if path.startswith(("[2]", "[3]")) else "state"
  if ".dcache." in path:
    return "drafter_kv"
  if ".cache." in path:
    return "target_kv"
  return "state"


def entry_labels(lowered, program: str) -> dict[int, str]:
  """HLO entry parameter number -> label, for the arguments jit kept."""
  leaves = jax.tree_util.tree_flatten_with_path(lowered.args_info[0])[0]
  kept = sorted(lowered._lowering.compile_args["kept_var_idx"])
  return {k: _label_of(jax.tree_util.keystr(leaves[i][0]), program) for k, i in enumerate(kept)}


def per_chip_bytes(tree) -> float:
  """Bytes one device holds of an abstract tree whose leaves carry shardings."""
  total = 0.0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if isinstance(x.sharding, NamedSharding) else x.shape
    total += float(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
  return total


def abstract_cache(model, batch: int, max_len: int, mesh):
  """The model's KV cache as ShapeDtypeStructs with the decode loop's shardings."""
  cache = jax.eval_shape(lambda: model.init_cache(batch, max_len))
  kv = NamedSharding(mesh, sharding.CACHE_SPEC)
  put = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=kv)  # noqa: E731
  return cache.replace(
      k=tuple(map(put, cache.k)), v=tuple(map(put, cache.v)),
      lengths=jax.ShapeDtypeStruct((batch,), jnp.int32,
                                   sharding=NamedSharding(mesh, P(sharding.DATA))))


def forward_program(graphdef, params, batch: int, max_len: int, mesh):
  """Lowered 1-token target forward over a full cache: tokens [B, 1] -> argmax ids [B, 1]."""
  target = nnx.merge(graphdef, params)[0]
  cache = abstract_cache(target, batch, max_len, mesh)
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                                sharding=NamedSharding(mesh, P(sharding.DATA, None)))

  def forward(p, tokens, k, v, lengths):
    model = nnx.merge(graphdef, p)[0]
    cache = KVCache(k, v, lengths)
    mask = jnp.concatenate([cache.visible()[:, None], jnp.ones((tokens.shape[0], 1, 1), bool)],
                           axis=-1)                                            # [B, 1, S + 1]
    out = model(tokens, lengths[:, None], cache, mask)
    return jnp.argmax(model.logits(out.hidden), axis=-1)

  with jax.set_mesh(mesh):   # as decoding.lower_sharded: the attention kernel runs per shard
    return jax.jit(forward).lower(params, tokens, cache.k, cache.v, cache.lengths)


def verify_tokens(case: Case, drafter) -> int:
  """Tokens a row verifies per iteration: 1 (forward, ar), the block (chain), v_max (trees)."""
  impl = methods.get(case.method)
  if case.program == "forward" or impl.drafter_kind != "block":
    return 1
  return case.v_max or drafter.cfg.block_size


def draft_vocab_ids(config, drafter_dir: str, vocab_size: int) -> tuple[tuple[int, ...], str]:
  """The draft vocabulary of config.drafter.vocab (() for 0) and where its ids came from: the
  counts file (drafter.vocab_counts, else token_counts.npz in the drafter directory), or with
  --synthetic_vocab N seeded-random ids, which stand in for a compile-only count only."""
  n = int(config.drafter.vocab)
  if n and _SYNTHETIC_VOCAB.value:
    return draft_vocab_lib.synthetic(n, vocab_size), draft_vocab_lib.SYNTHETIC
  counts = config.drafter.vocab_counts or str(Path(drafter_dir) / draft_vocab_lib.COUNTS_FILE)
  if n and not Path(counts).is_file():
    raise app.UsageError(f"drafter.vocab={n}: no token counts at {counts}; set "
                         "--config.drafter.vocab_counts, or --synthetic_vocab for a compile-only "
                         "count")
  return draft_vocab_lib.load(counts, n, vocab_size), counts if n else "all"


def lower_case(case: Case, graphdef, params, config, mesh, drafter, draft_vocab=()):
  """The lowered program of one case; draft_vocab: the ids a block drafter may propose."""
  if case.program == "forward":
    return forward_program(graphdef, params, case.batch, _MAX_LEN.value, mesh)
  impl = methods.get(case.method)
  k = drafter.cfg.block_size if impl.drafter_kind == "block" else 1
  cure = None
  if impl.tree_config:
    cure = dataclasses.replace(pipeline.repair_config(config, k), v_max=case.v_max)
    cure.validate(k)
  new_tokens = _MAX_LEN.value - _PROMPT.value
  spec = decoding_spec(case.method, drafter, new_tokens, _MAX_LEN.value, (), k, cure,
                       prefill_chunk=int(config.prefill_chunk),
                       drafter_window=int(config.drafter.window), draft_vocab=draft_vocab)
  pre, dec = decoding.lower_sharded(graphdef, params, spec, case.batch, _PROMPT.value, mesh)
  return pre if case.program == "prefill" else dec


def gpu_setup(topology: str) -> str | None:
  """For a GPU topology: a folder XLA dumps the decode / prefill modules into (their thunk
  sequences say what the GPU runtime launches; gpu_launches), and the host backend kept to the
  CPU (a libtpu beside jax[cuda12] would otherwise be started, and locked). Must run before
  jax starts."""
  if not gpu_targets.parse(topology):
    return None
  if not jax.config.jax_platforms:  # jax read JAX_PLATFORMS when it was imported, above
    jax.config.update("jax_platforms", "cpu")
  where = tempfile.mkdtemp(prefix="cure_jax_gpu_dump_")
  atexit.register(shutil.rmtree, where, True)   # hundreds of MB a run; --dump_hlo keeps HLO
  flags = f"--xla_dump_to={where} --xla_dump_hlo_module_re=jit_(run|start)"
  os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f)
  return where


def launch_counts(dump: str, program: str) -> dict | None:
  """Kernels and launches of the module just compiled for `program` (its newest thunk dump)."""
  module = "jit_start" if program == "prefill" else "jit_run"
  found = sorted(Path(dump).glob(f"*.{module}.thunk_sequence_after_thunk_passes.txt"),
                 key=lambda p: p.stat().st_mtime)
  return launches.count(found[-1].read_text()) if found else None


def analyse(case: Case, lowered, weights: dict[str, float], dump: str | None = None,
            options: dict[str, str] | None = None, verify_tokens: int = 1) -> dict:
  """Compile one lowered program and read its costs; verify_tokens: tokens a row verifies per
  iteration (1 for ar and forward, the block for chain, the node budget for trees)."""
  t0 = time.perf_counter()
  compiled = decoding.compile_with(lowered, options)
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  text = compiled.as_text()
  labels = entry_labels(lowered, case.program)
  if _DUMP_HLO.value:  # the module and its parameter labels: hlo_traffic.count(text, labels)
    stem = Path(_DUMP_HLO.value) / case.name.replace("/", "_")
    report.write_text(stem.with_suffix(".hlo"), text)
    pipeline.write_json(str(stem.with_suffix(".labels.json")), labels)
  rec = dict(case=case.name, program=case.program, method=case.method, batch=case.batch,
             v_max=case.v_max, compile_s=round(compile_s, 2),
             argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
             output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
             xla_flops=float(cost.get("flops", 0.0)),
             xla_bytes_accessed=float(cost.get("bytes accessed", 0.0)), weights=weights,
             verify_tokens=verify_tokens)
  if case.program == "prefill":  # its loop is one chunk; traffic_record scales it to them all
    rec["prefill_chunks"] = prefill_chunks()
  if case.program == "decode":  # its output is the state: donation works when it aliases
    rec["donated_state_aliased"] = bool(mem.alias_size_in_bytes >= 0.9 * mem.output_size_in_bytes)
  if dump and case.program != "forward":
    rec["gpu_launches"] = launch_counts(dump, case.program)
  return traffic_record(rec, text, labels)


def prefill_chunks() -> int:
  """Chunks of a --prompt_len prefill (the chunk is config.prefill_chunk, at most the prompt)."""
  return -(-_PROMPT.value // min(int(_CONFIG.value.prefill_chunk), _PROMPT.value))


def failure(case: Case, error: Exception) -> dict:
  """The record of a program the compiler refused: its message and, when the message says,
  the bytes the program asked for and the bytes the device has."""
  return dict(case=case.name, program=case.program, method=case.method, batch=case.batch,
              v_max=case.v_max, **refusals.read(error))


def traffic_bounds(case: Case, loop: dict, w: dict[str, float], verify_tokens: int = 1) -> dict:
  """The yardsticks for one iteration: ar / forward against weights + target KV; chain
  against its minimum (target, drafter layers, one more lm_head read, both caches). For an MoE
  target also the MoE minimum: the same with only the experts the iteration's batch x
  verify_tokens tokens route to, under uniform routing (hlo_traffic's rule for the GPU kernel)."""
  hbm = loop["hbm_bytes"]
  target_min = w["target"] + w["target_kv"]
  out = dict(per_chip_weights=w["target"], target_kv=w["target_kv"],
             hbm_over_weights=hbm / w["target"], hbm_over_weights_and_kv=hbm / target_min)
  block = methods.get(case.method).drafter_kind == "block"
  if block:   # the drafter's head read: its draft vocabulary's rows (draft_head) or all of them
    chain_min = target_min + w["drafter"] + w.get("draft_head", w["lm_head"]) + w["drafter_kv"]
    out.update(chain_minimum=chain_min, hbm_over_chain_minimum=hbm / chain_min)
  if w.get("experts"):
    tokens = case.batch * verify_tokens
    unread = w["experts"] * (1.0 - w["experts_per_token"]) ** tokens
    moe_min = (chain_min if block else target_min) - unread
    out.update(moe_minimum=moe_min, moe_tokens=tokens, hbm_over_moe_minimum=hbm / moe_min)
  return out


def weight_bytes(target, drafter, mesh, batch: int, max_len: int,
                 draft_vocab: int = 0) -> dict[str, float]:
  """Per-chip bytes of the target / drafter weights, lm_head and the KV caches; with a draft
  vocabulary of N tokens also draft_head, the N of lm_head's rows the drafter reads."""
  place = sharding.Placement(mesh)

  def chip(module, only=None):
    state = place.annotate(nnx.state(module))
    flat = [(p, v.get_value()) for p, v in nnx.to_flat_state(state)]
    return per_chip_bytes([x for p, x in flat if only is None or only in "/".join(map(str, p))])

  def kv(model):
    cache = abstract_cache(model, batch, max_len, mesh)
    return per_chip_bytes([cache.k, cache.v])

  head = "embed_tokens" if target.cfg.tie_embeddings else "lm_head"
  out = dict(target=chip(target), lm_head=chip(target, head), target_kv=kv(target))
  if target.cfg.moe:   # the experts, and the share of them one token routes to (top_k / E)
    out.update(experts=chip(target, "experts"),
               experts_per_token=target.cfg.moe.top_k / target.cfg.moe.num_experts)
  if drafter is not None:
    out.update(drafter=chip(drafter), drafter_kv=kv(drafter))
    if draft_vocab:
      out.update(draft_head=out["lm_head"] * draft_vocab / target.cfg.vocab_size)
  return out


def traffic_record(rec: dict, text: str, labels: dict[int, str]) -> dict:
  """rec with the HBM count of `text` (one iteration of its loop, else the whole program)."""
  traffic = hlo_traffic.count(text, labels)
  loop = traffic["loops"][0] if traffic["loops"] else traffic["program"]
  chunks = rec.get("prefill_chunks")
  if chunks and traffic["loops"]:   # the whole prefill (compiled_report.PREFILL_RULE)
    block = loop["nested_loop_iteration_bytes"]           # one cache block, every layer
    by_label = {k: v * chunks for k, v in loop["by_label"].items()}
    by_label["cache_blocks_beyond_one"] = (chunks * (chunks - 1) / 2 - chunks) * block
    loop = dict(loop, hbm_bytes=sum(by_label.values()), by_label=by_label,
                chunk_hbm_bytes=loop["hbm_bytes"], chunks=chunks,
                rule=compiled_report.PREFILL_RULE)
  case = Case(rec["program"], rec["method"], rec["batch"], rec["v_max"])
  return dict(rec, iteration=loop,
              outside_loops=traffic["outside_loops"] if traffic["loops"] else None,
              bounds=traffic_bounds(case, loop, rec["weights"], rec.get("verify_tokens", 1)))


def recount(output: str, dump: str) -> None:
  """Rewrites a report from its dumped modules (after a change of experiments/hlo_traffic)."""
  if not dump:
    raise app.UsageError("--recount reads the modules of --dump_hlo=DIR")
  data = json.loads(Path(output + ".json").read_text())
  for i, rec in enumerate(data["records"]):
    stem = Path(dump) / rec["case"].replace("/", "_")
    if not stem.with_suffix(".hlo").is_file():
      raise app.UsageError(f"{stem}.hlo is missing: run with --dump_hlo={dump} first")
    labels = {int(k): v for k, v in json.loads(stem.with_suffix(".labels.json").read_text()).items()}
    data["records"][i] = traffic_record(rec, stem.with_suffix(".hlo").read_text(), labels)
  pipeline.write_json(output + ".json", data)
  report.write_text(output + ".md", compiled_report.markdown(data["meta"], data["records"]))
  print(f"recounted {len(data['records'])} programs into {output}.json and .md")


def train_main(config, target_dir: str, topology: str, output: str) -> None:
  """Compiles the online training step of a drafter training config (--programs=train)."""
  from cure_jax.training import program
  gpu_setup(topology)
  devices = gpu_targets.topology_devices(topology)
  target, _ = abstract_pair(target_dir, None, pipeline.DTYPES[config.target.dtype])
  try:
    meta, rec = program.compile_train(config, target, devices, topology, _TRAIN_LEN.value,
                                      _DUMP_HLO.value or None)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  meta["target"] = target_dir
  print(program.summary(rec), flush=True)
  pipeline.write_json(output + ".json", json.loads(json.dumps(dict(meta=meta, records=[rec]),
                                                              default=str)))
  report.write_text(output + ".md", program.markdown(meta, rec))
  print(f"wrote {output}.json and .md")


def main(argv):
  del argv
  if _RECOUNT.value:
    return recount(_OUTPUT.value, _DUMP_HLO.value)
  config = _CONFIG.value
  programs = [p.strip() for p in _PROGRAMS.value]
  if "train" in programs or "train" in config:
    if programs != ["train"] or "train" not in config:
      raise app.UsageError("--programs=train goes alone, with a drafter training config "
                           "(configs/train/...); other programs take a decoding config")
    return train_main(config, *(setting(f, config) for f in (_TARGET, _TOPOLOGY, _OUTPUT)))
  target_dir, drafter_dir, topology, output = (setting(f, config) for f in (
      _TARGET, _DRAFTER, _TOPOLOGY, _OUTPUT))
  names = [m.strip() for m in setting(_METHODS, config)]
  bad = [m for m in names if m not in METHODS]
  if bad:
    raise app.UsageError(f"--methods: unknown {bad}; choose from {METHODS}")
  if [p for p in programs if p not in PROGRAMS]:
    raise app.UsageError(f"--programs={_PROGRAMS.value}; choose from {PROGRAMS}")
  try:
    v_maxes = [int(v) for v in setting(_V_MAX, config)]
    batches = [int(b) for b in setting(_BATCH, config)]
  except ValueError as e:
    raise app.UsageError(f"--v_max and --batch take integers: {e}") from e
  if _PROMPT.value >= _MAX_LEN.value:
    raise app.UsageError(f"--prompt_len={_PROMPT.value} must be below --max_len={_MAX_LEN.value}")
  dtype = pipeline.dtype_of(config)
  if topology == "cpu" and config.dtype == "bfloat16":
    print("note: the CPU backend upcasts bf16 weights (temporaries of the model's size); CPU "
          "figures are meaningful in float32 (--config.dtype=float32)")
  dump = gpu_setup(topology)
  devices = gpu_targets.topology_devices(topology)
  options = decoding.platform_options(devices[0].platform,
                                      pipeline.compiler_options(_OPTIONS.value))
  with config.unlocked():   # 0: the compiled-for platform's default, not this host's
    config.prefill_chunk = platform_prefill_chunk(int(config.prefill_chunk), devices[0].platform)
  mesh = sharding.make_mesh(int(config.mesh.data), int(config.mesh.model), devices=devices)
  needs_drafter = any(m != "ar" for m in names)
  target, drafter = abstract_pair(target_dir, drafter_dir if needs_drafter else None, dtype)
  target.numerics = config.get("numerics", "default")       # models/numerics.py
  target.layer_kernels = bool(config.get("layer_kernels", True))  # models/kernels/gpu_layer.py
  sharding.check_models(mesh, target, drafter)
  for b in batches:
    if b % mesh.shape[sharding.DATA]:
      raise app.UsageError(f"--batch={b} does not divide by mesh.data={mesh.shape['data']}")
  graphdef, params = nnx.split((target, drafter))
  params = sharding.Placement(mesh).annotate(params)
  vocab, vocab_from = (draft_vocab_ids(config, drafter_dir, target.cfg.vocab_size)
                       if needs_drafter else ((), "all"))
  meta = dict(target=target_dir, drafter=drafter_dir if needs_drafter else None,
              topology=topology, device_kind=devices[0].device_kind,
              mesh=[int(mesh.shape["data"]), int(mesh.shape["model"])], dtype=config.dtype,
              max_len=_MAX_LEN.value, prompt_len=_PROMPT.value, jax=jax.__version__,
              prefill_chunk=int(config.prefill_chunk), numerics=target.numerics,
              layer_kernels=target.layer_kernels,
              compiler_options=options, draft_vocab=len(vocab), draft_vocab_ids=vocab_from)
  records = []
  for case in cases(programs, names, v_maxes, batches):
    meta["weights"] = weight_bytes(target, drafter, mesh, case.batch, _MAX_LEN.value, len(vocab))
    lowered = lower_case(case, graphdef, params, config, mesh, drafter, vocab)
    try:
      rec = analyse(case, lowered, meta["weights"], dump, options, verify_tokens(case, drafter))
    except jax.errors.JaxRuntimeError as e:   # does not fit, or the compiler failed: on we go
      rec = failure(case, e)
      print(f"{case.name}: did not compile ({compiled_report.mb(rec['bytes_asked'])} MB of "
            f"{rec['memory']} asked): {rec['error'].splitlines()[0][:300]}", flush=True)
    records.append(rec)
    it = rec.get("iteration")
    if it:
      print(f"{case.name}: compile {rec['compile_s']:.1f} s, HBM {it['hbm_bytes'] / 1e9:.2f} GB "
            f"per iteration ({rec['bounds']['hbm_over_weights_and_kv']:.3f}x weights + KV), XLA "
            f"{rec['xla_bytes_accessed'] / 1e9:.2f} GB, {it['collectives']}", flush=True)
    out = dict(meta=meta, records=records)
    pipeline.write_json(output + ".json", json.loads(json.dumps(out, default=str)))
    report.write_text(output + ".md", compiled_report.markdown(meta, records))
  print(f"wrote {output}.json and .md")


if __name__ == "__main__":
  errors.run(main)
