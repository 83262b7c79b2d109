"""From a decoding config to results: load models, encode prompts, decode, summarise.

Shared by `experiments.decode` and the benchmarks, so every entry point reads configs the same
way and reports the same JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from cure_jax import methods
from cure_jax.models import numerics
from cure_jax.runtime import distributed, hub
from cure_jax.runtime import draft_vocab as draft_vocab_lib, files
from cure_jax.runtime.generation import Generator, Result
from cure_jax.tree import controller, repair
from cure_jax.tree.sampling import Sampling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(config):
  if config.dtype not in DTYPES:
    raise ValueError(f"dtype={config.dtype!r}; choose one of {sorted(DTYPES)}")
  return DTYPES[config.dtype]


def _embedded() -> dict:
  from cure_jax.runtime import default_model
  return {"embedded:smollm2": default_model.smollm2_dir,
          "embedded:smollm2_dflash": lambda: default_model.SMOLLM2_DFLASH_DIR,
          "embedded:smollm2_ar_drafter": lambda: default_model.SMOLLM2_AR_DRAFTER_DIR}


def resolve_path(path: str) -> str:
  """An `embedded:NAME` path -> the packaged model folder (converting on first use); a Hugging
  Face Hub id (`Qwen/Qwen3-8B`) -> its snapshot in the Hub cache (fetched once); a local path as
  it is."""
  if hub.is_hub_id(path):
    return hub.fetch(path)
  if not path.startswith("embedded:"):
    if path and not Path(path).exists():
      raise FileNotFoundError(f"{path} does not exist: pass a local HF directory or converted "
                              "checkpoint, or a Hugging Face Hub id such as Qwen/Qwen3-8B")
    return path
  embedded = _embedded()
  if path not in embedded:
    raise ValueError(f"unknown embedded model {path!r}; known: {sorted(embedded)}")
  return embedded[path]()


def resolve_paths(config) -> None:
  """Replaces `embedded:NAME` paths and Hub ids by local folders (resolve_path); the drafter's
  only where the method uses one."""
  config.target.path = resolve_path(config.target.path)
  if methods.get(config.method).drafter_kind and config.drafter.path:
    config.drafter.path = resolve_path(config.drafter.path)


def enable_compilation_cache(config) -> str | None:
  """Turns on JAX's persistent compilation cache, so a second run of the same command loads its
  compiled programs instead of compiling again. config.compilation_cache: a folder, "" for
  <cure_jax cache>/xla, "off" for none. Returns the folder (None when off)."""
  import jax
  where = str(config.get("compilation_cache", "") or "")
  if where == "off":
    return None
  if not where:
    from cure_jax.runtime.default_model import cache_root
    where = str(cache_root() / "xla")
  Path(where).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", where)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return where


def check_config(config) -> None:
  """The run-level integer settings, checked before any model is loaded: a batch_size of 0
  would otherwise reach the decoder as an empty batch, a negative num_prompts as an empty
  prompt list."""
  problems = []
  for name, lowest, meaning in (
      ("batch_size", 1, "prompts decoded together"),
      ("max_new_tokens", 1, "tokens to generate per prompt"),
      ("max_len", 0, "the static cache length; 0 = each prompt's length + max_new_tokens"),
      ("num_prompts", 0, "the first N prompts; 0 = all"),
      ("drafter.block_size", 0, "0 = the drafter's own; for ar_draft gamma + 1"),
      ("drafter.gamma", 1, "ar_draft: drafted tokens per iteration")):
    value = config
    for part in name.split("."):
      value = value.get(part) if hasattr(value, "get") else None
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int):
      problems.append(f"{name}={value!r} must be an integer ({meaning})")
    elif value < lowest:
      what = "a positive integer" if lowest == 1 else f">= {lowest}"
      problems.append(f"{name}={value} must be {what} ({meaning})")
  numerics_mode = config.get("numerics", "default")
  if numerics_mode not in numerics.MODES:
    problems.append(f"numerics={numerics_mode!r} must be one of {', '.join(numerics.MODES)}")
  max_len = config.get("max_len", 0)
  if numerics_mode == "invariant" and isinstance(max_len, int) and max_len >= numerics.MAX_TERMS:
    problems.append(f"max_len={max_len}: numerics=invariant sums attention exactly over fewer "
                    f"than {numerics.MAX_TERMS} keys; lower max_len")
  problems += method_independent_problems(config)
  if problems:
    raise ValueError("; ".join(problems))


def method_independent_problems(config) -> list[str]:
  """The tree (cure.*), controller (auto.*) and sampling settings out of range, whichever method
  runs: a method that does not read one, or overrides it (auto sets the tree's v_max from its
  budgets), would otherwise take a wrong value without a word."""
  problems = []
  try:
    problems += [f"cure.{p}" for p in repair.RepairConfig(**dict(config.cure)).range_problems()]
  except TypeError as e:   # a field of the wrong kind
    problems.append(f"cure: {e}")
  for check in (lambda: auto_settings(config), lambda: sampling_of(config).validate()):
    try:
      check()
    except ValueError as e:
      problems.append(str(e))
  return problems


def sampling_of(config) -> Sampling:
  return Sampling(float(config.temperature), int(config.top_k), float(config.top_p))


def mesh_of(config):
  """The device mesh of config.mesh, or None for 1 x 1 (one device, nothing sharded)."""
  from cure_jax.runtime import sharding
  mesh = config.get("mesh") or {}
  data, model = int(mesh.get("data", 1)), int(mesh.get("model", 1))
  return None if data == model == 1 else sharding.make_mesh(data, model)


def _placement(config, path: str, model_config):
  """None without a mesh; else checks that the model at `path` splits over it (before any
  weight is read) and returns the placement that loads each tensor straight onto its shards."""
  mesh = mesh_of(config)
  if mesh is None:
    return None
  from cure_jax.checkpoints.store import read_hf_config
  from cure_jax.runtime import sharding
  sharding.check_config(model_config.from_hf(read_hf_config(path)), mesh, f"model at {path}")
  return sharding.placement(mesh)


def _qwen3(config, path: str):
  """A Qwen3/Llama checkpoint at `path`, in config.dtype, on config.mesh."""
  from cure_jax.checkpoints.qwen3 import load_target
  from cure_jax.models.qwen3 import ModelConfig
  return load_target(path, dtype_of(config), placement=_placement(config, path, ModelConfig))


def load_target(config):
  if not config.target.path:
    raise ValueError("set --config.target.path to a Qwen3/Llama HF directory or converted checkpoint")
  distributed.announce_devices()   # once per run: the devices the model goes to
  target = _qwen3(config, config.target.path)
  target.numerics = config.get("numerics", "default")      # refuses invariant for MoE
  target.layer_kernels = bool(config.get("layer_kernels", True))
  return target


def _autoregressive_drafter(config, target):
  """A small Qwen3/Llama checkpoint, loaded as a target is."""
  del target
  return _qwen3(config, config.drafter.path)


def _block_drafter(config, target):
  """A DFlash drafter, checked against the target it borrows embedding and head from."""
  from cure_jax.checkpoints.dflash import load_drafter
  from cure_jax.models.dflash import DFlashConfig
  return load_drafter(config.drafter.path, dtype_of(config), target_cfg=target.cfg,
                      placement=_placement(config, config.drafter.path, DFlashConfig))


_DRAFTER_LOADERS = {"autoregressive": _autoregressive_drafter, "block": _block_drafter}


def load_drafter(config, target):
  """The drafter the method needs (None when it needs none), checked against the target."""
  kind = methods.get(config.method).drafter_kind
  if kind is None:
    return None
  if not config.drafter.path:
    raise ValueError(f"method={config.method!r} needs --config.drafter.path")
  return _DRAFTER_LOADERS[kind](config, target)


def load_tokenizer(path: str):
  """The checkpoint's tokenizer, or None when it ships without one (ids-only prompts).

  The class named in tokenizer_config.json, as AutoTokenizer picks it, but loaded directly:
  AutoTokenizer also reads the model config, which in transformers 5 imports torch (+320 MB of
  RSS, a fifth of a long prompt's CPU run) for nothing a tokenizer does."""
  import transformers
  try:
    name = json.loads(Path(path, "tokenizer_config.json").read_text()).get("tokenizer_class")
  except (OSError, ValueError):
    name = None
  cls = getattr(transformers, name, None) if isinstance(name, str) else None
  try:
    return (cls or transformers.AutoTokenizer).from_pretrained(path)
  except (OSError, ValueError):
    return None


def stop_ids(path: str, tokenizer) -> tuple[int, ...]:
  """EOS ids from generation_config.json, config.json and the tokenizer."""
  ids = set()
  for name in ("generation_config.json", "config.json"):
    f = Path(path) / name
    if f.is_file():
      eos = json.loads(f.read_text()).get("eos_token_id")
      ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    ids.add(tokenizer.eos_token_id)
  return tuple(sorted(int(i) for i in ids))


def repair_config(config, block_size: int) -> repair.RepairConfig:
  """The cure settings; max_depth is capped at the drafter's block_size - 1."""
  c = dict(config.cure)
  c["max_depth"] = min(int(c["max_depth"]), block_size - 1)
  return repair.RepairConfig(**c)


def _numbers(value, kind):
  """A tuple from a config value: '1,4,8' or a list/tuple of numbers."""
  items = value.split(",") if isinstance(value, str) else list(value)
  return tuple(kind(x) for x in items if str(x).strip())


def auto_settings(config) -> controller.Settings:
  """The goodput controller's settings (auto.*), checked."""
  a = config.auto
  try:
    settings = controller.Settings(budgets=_numbers(a.budgets, int),
                                   costs=_numbers(a.costs, float), decay=float(a.decay),
                                   explore_every=int(a.explore_every),
                                   explore_overhead=float(a.explore_overhead),
                                   fallback=bool(a.fallback))
  except ValueError as e:
    raise ValueError(f"auto.budgets={a.budgets!r} / auto.costs={a.costs!r}: give comma-separated "
                     f"numbers ({e})") from e
  settings.validate()
  return settings


def compiler_options(pairs) -> dict[str, str]:
  """XLA options from 'name=value,name=value' (a config string) or a list of 'name=value'."""
  items = [p.strip() for p in (pairs.split(",") if isinstance(pairs, str) else pairs) if p.strip()]
  bad = [p for p in items if "=" not in p]
  if bad:
    raise ValueError(f"compiler_options takes name=value pairs, not {bad}")
  return dict(p.split("=", 1) for p in items)


def draft_vocab(config, target, method: str) -> tuple[int, ...]:
  """The tokens a block drafter may propose (drafter.vocab of the drafter.vocab_counts file,
  by default token_counts.npz beside the drafter); () = all, and for other methods."""
  if methods.get(method).drafter_kind != "block":
    return ()
  counts = (config.drafter.vocab_counts or
            str(Path(config.drafter.path) / draft_vocab_lib.COUNTS_FILE))
  return draft_vocab_lib.load(counts, int(config.drafter.vocab), target.cfg.vocab_size)


def make_generator(config, target, drafter, stops=(), method: str | None = None) -> Generator:
  method = method or config.method
  impl = methods.get(method)
  block = impl.block_size(drafter, int(config.drafter.block_size) or None,
                          int(config.drafter.gamma))
  return Generator(target, drafter, method=method, max_new_tokens=int(config.max_new_tokens),
                   stop_ids=() if config.ignore_eos else stops, block_size=block,
                   cure=repair_config(config, block) if impl.tree_config else None,
                   max_len=int(config.max_len) or None, mesh=mesh_of(config),
                   sampling=sampling_of(config), seed=int(config.seed),
                   compiler_options=compiler_options(config.compiler_options),
                   prefill_chunk=int(config.prefill_chunk),
                   drafter_window=int(config.drafter.window),
                   draft_vocab=draft_vocab(config, target, method),
                   auto=auto_settings(config) if impl.controlled else None)


def decode_all(generator: Generator, ids: list[list[int]], batch_size: int,
               progress=None) -> list[Result]:
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be a positive integer (prompts decoded "
                     "together)")
  results = []
  for i in range(0, len(ids), batch_size):  # prompt i samples from its own key: any batch size
    results.extend(generator.generate(ids[i:i + batch_size], first_row=i))
    if progress is not None:
      progress(len(results))
  return results


def summary(results: list[Result]) -> dict:
  lens = [a for r in results for a in r.accept_lengths]
  tokens = sum(len(r.output_ids) for r in results)
  decode_s = sum(r.decode_s / r.batch_size for r in results)   # each batch's time once
  out = dict(prompts=len(results), generated_tokens=tokens, iterations=len(lens),
             tau=float(np.mean(lens)) if lens else 0.0,
             tpot_ms=float(np.mean([r.tpot_ms for r in results])),
             # the whole batch's output tokens per second (after each prompt's first)
             tokens_per_s=float(sum(len(r.output_ids) - 1 for r in results) / max(decode_s, 1e-9)))
  taken = collections.Counter(s["budget"] for r in results for s in r.stats if s.get("budget"))
  if taken:  # a controlled method: iterations per node budget it chose
    out["budgets"] = " ".join(f"{n}:{c}" for n, c in sorted(taken.items()))
  return out


def result_rows(results: list[Result], tokenizer) -> list[dict]:
  rows = []
  for r in results:
    row = dataclasses.asdict(r)
    row["text"] = tokenizer.decode(r.output_ids, skip_special_tokens=True) if tokenizer else ""
    rows.append(row)
  return rows


# Callers write results through the pipeline they already import.
write_atomic = files.write_atomic
write_json = files.write_json
