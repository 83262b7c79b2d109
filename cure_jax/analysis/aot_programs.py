"""What `experiments.aot` compiles: the target and drafter built abstractly from their
config.json (nothing allocated, no checkpoint read), the cases (program x method x tree size x
batch), and each case's lowered program, exactly as `experiments.decode` would lower it."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cure_jax import methods
from cure_jax.checkpoints import dflash as convert_dflash, qwen3 as convert_qwen3
from cure_jax.checkpoints.store import read_hf_config
from cure_jax.costs import gpu_targets
from cure_jax.models.cache import KVCache
from cure_jax.runtime import decoding, draft_vocab as draft_vocab_lib, pipeline, sharding
from cure_jax.runtime.generation import decoding_spec

METHODS = ("ar", "chain", "cure", "ddtree", "hybrid")
PROGRAMS = ("prefill", "decode", "forward", "train")


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


def draft_vocab_ids(config, drafter_dir: str, vocab_size: int,
                    synthetic: bool = False) -> tuple[tuple[int, ...], str]:
  """The draft vocabulary of config.drafter.vocab (() for 0) and where its ids came from: the
  counts file (drafter.vocab_counts, else token_counts.npz in the drafter directory), or with
  `synthetic` (--synthetic_vocab) N seeded-random ids, which stand in for a compile-only count
  only."""
  n = int(config.drafter.vocab)
  if n and synthetic:
    return draft_vocab_lib.synthetic(n, vocab_size), draft_vocab_lib.SYNTHETIC
  counts = config.drafter.vocab_counts or str(Path(drafter_dir) / draft_vocab_lib.COUNTS_FILE)
  if n and not Path(counts).is_file():
    raise ValueError(f"drafter.vocab={n}: no token counts at {counts}; set "
                     "--config.drafter.vocab_counts, or --synthetic_vocab for a compile-only "
                     "count")
  return draft_vocab_lib.load(counts, n, vocab_size), counts if n else "all"


def lower_case(case: Case, graphdef, params, config, mesh, drafter, max_len: int,
               prompt_len: int, draft_vocab=()):
  """The lowered program of one case; draft_vocab: the ids a block drafter may propose."""
  if case.program == "forward":
    return forward_program(graphdef, params, case.batch, max_len, mesh)
  impl = methods.get(case.method)
  k = drafter.cfg.block_size if impl.drafter_kind == "block" else 1
  cure = None
  if impl.tree_config:
    cure = dataclasses.replace(pipeline.repair_config(config, k), v_max=case.v_max)
    cure.validate(k)
  new_tokens = max_len - prompt_len
  spec = decoding_spec(case.method, drafter, new_tokens, max_len, (), k, cure,
                       prefill_chunk=int(config.prefill_chunk),
                       drafter_window=int(config.drafter.window), draft_vocab=draft_vocab)
  pre, dec = decoding.lower_sharded(graphdef, params, spec, case.batch, prompt_len, mesh)
  return pre if case.program == "prefill" else dec


def gpu_setup(topology: str) -> str | None:
  """For a GPU topology: a folder XLA dumps the decode / prefill modules into (their thunk
  sequences say what the GPU runtime launches; aot_costs.launch_counts), and the host backend
  kept to the CPU (a libtpu beside jax[cuda12] would otherwise be started, and locked). Must
  run before jax starts a backend."""
  if not gpu_targets.parse(topology):
    return None
  if not jax.config.jax_platforms:  # jax read JAX_PLATFORMS when it was imported
    jax.config.update("jax_platforms", "cpu")
  where = tempfile.mkdtemp(prefix="cure_jax_gpu_dump_")
  atexit.register(shutil.rmtree, where, True)   # hundreds of MB a run; --dump_hlo keeps HLO
  flags = f"--xla_dump_to={where} --xla_dump_hlo_module_re=jit_(run|start)"
  os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f)
  return where
