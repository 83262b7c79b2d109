"""Moving NNX parameter states between Hugging Face safetensors directories and orbax folders.

Model-agnostic: a converter supplies the abstract state of its module (from `nnx.eval_shape`) and
`name_of(path) -> str`, the HF tensor name of each flat state path. `nnx.Linear` kernels (leaf
`kernel`) are stored [in, out] here and [out, in] in HF files; every other leaf is as-is. A name
holding `{e}` names a stack along the leaf's axis 0 (an MoE's experts, [E, in, out] here): HF
files hold one tensor per index, the name with `{e}` replaced by it.

Loading streams one tensor at a time so a large checkpoint is held in host memory only once;
every folder this module writes appears complete at its destination or not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return it)
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

StatePath = tuple  # a flat NNX state path, e.g. ('layers', 0, 'self_attn', 'q_proj', 'kernel')
NameOf = Callable[[StatePath], str]
Placement = Callable[[StatePath, np.ndarray], jax.Array]

CONFIG = "config.json"
METADATA = "cure_jax.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files next to the weights that a converted checkpoint carries along, so exporting it back
# yields a directory transformers and tokenizers can use directly.
AUX_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
             "tokenizer.model", "chat_template.jinja")
# Buffers older transformers versions saved with the weights; recomputed from config.json.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_HF_DIR_HINT = ("pass a Hugging Face model directory holding config.json and model.safetensors "
                "(or sharded model-*.safetensors with model.safetensors.index.json)")


def hf_name(path: StatePath, prefix: str = "") -> str:
  """The HF name of a module's parameter: ('layers', 0, 'mlp', 'up_proj', 'kernel') ->
  prefix + 'layers.0.mlp.up_proj.weight'."""
  return prefix + ".".join(map(str, path[:-1])) + ".weight"


def _is_kernel(path: StatePath) -> bool:
  return path[-1] == "kernel"


def _hf_shape(path: StatePath, shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(reversed(shape)) if _is_kernel(path) else tuple(shape)


def _hf_tensors(path: StatePath, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
  """HF name -> HF shape of each stored tensor a leaf is made of (several for a `{e}` stack)."""
  if "{e}" not in name:
    return {name: _hf_shape(path, shape)}
  return {name.format(e=i): _hf_shape(path, shape[1:]) for i in range(shape[0])}


def _to_hf(path: StatePath, array: np.ndarray) -> np.ndarray:
  """A leaf (or one slice of a stack) in HF layout; its own inverse."""
  return array.T if _is_kernel(path) else array


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
  """config.json of an HF model directory as a dict."""
  hf_dir = Path(hf_dir)
  if not hf_dir.is_dir():
    raise FileNotFoundError(f"{hf_dir} is not a directory; {_HF_DIR_HINT}.")
  path = hf_dir / CONFIG
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found; {_HF_DIR_HINT}.")
  return json.loads(path.read_text())


def safetensors_files(hf_dir: str | os.PathLike) -> list[Path]:
  """The weight files of an HF directory: model.safetensors, or the shards its index names."""
  hf_dir = Path(hf_dir)
  index = hf_dir / INDEX_FILE
  if index.is_file():
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = [hf_dir / n for n in names]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
      raise FileNotFoundError(f"{index} names shards that do not exist: {absent}; copy the "
                              "complete checkpoint.")
    return files
  if (hf_dir / SINGLE_FILE).is_file():
    return [hf_dir / SINGLE_FILE]
  raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}; {_HF_DIR_HINT} (re-save "
                          ".bin checkpoints with save_pretrained(safe_serialization=True)).")


def _list_names(names: Iterable[str], limit: int = 20) -> str:
  names = sorted(names)
  more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def tensor_index(hf_dir: str | os.PathLike) -> dict[str, tuple[Path, tuple[int, ...]]]:
  """HF name -> (file, shape) of every stored tensor but IGNORED_SUFFIXES buffers; reads only
  the safetensors headers."""
  index = {}
  for file in safetensors_files(hf_dir):
    with safe_open(str(file), framework="numpy") as f:
      for name in f.keys():
        if not name.endswith(IGNORED_SUFFIXES):
          index[name] = (file, tuple(f.get_slice(name).get_shape()))
  return index


def tensor_names(hf_dir: str | os.PathLike) -> list[str]:
  """Sorted names of the tensors an HF directory stores (see tensor_index)."""
  return sorted(tensor_index(hf_dir))


def _validate(expected: dict[str, tuple[int, ...]], found: dict, hf_dir: Path) -> None:
  """Raises before any data is read if the checkpoint's tensors do not match the module."""
  missing = expected.keys() - found.keys()
  if missing:
    raise ValueError(f"{hf_dir} lacks {len(missing)} tensor(s) the model needs: "
                     f"{_list_names(missing)}. Is this the checkpoint config.json describes?")
  unexpected = found.keys() - expected.keys()
  if unexpected:
    raise ValueError(f"{hf_dir} has {len(unexpected)} tensor(s) the model does not use: "
                     f"{_list_names(unexpected)}. The architecture in config.json may not match "
                     "the weights, or this converter does not support the variant.")
  wrong = [f"{n}: expected {expected[n]}, found {found[n][1]}" for n in sorted(expected)
           if found[n][1] != expected[n]]
  if wrong:
    raise ValueError(f"{len(wrong)} tensor shape(s) in {hf_dir} differ from what config.json "
                     f"implies (config.json probably does not match the weights): "
                     + "; ".join(wrong[:20]))


def stream_params(abstract_state: nnx.State, hf_dir: str | os.PathLike, name_of: NameOf,
                  dtype=None, progress: bool = True, placement: Placement | None = None,
                  ignore: Iterable[str] = ()) -> nnx.State:
  """Fills `abstract_state` from an HF directory, one tensor at a time.

  Each tensor is read, transposed if it is a kernel, cast to `dtype` (default: the abstract
  leaf's dtype) and handed to `placement(path, array)` (default: the default device), so the
  host holds the finished state plus one tensor in flight. Each read opens its file afresh:
  safetensors maps files into memory, and pages touched through a long-lived mapping would stay
  resident and count a second copy of the checkpoint. Names in `ignore` (e.g. a tied lm_head)
  are skipped.
  """
  hf_dir = Path(hf_dir)
  flat = list(nnx.to_flat_state(abstract_state))
  parts = {p: _hf_tensors(p, name_of(p), v.get_value().shape) for p, v in flat}
  expected = {n: shape for tensors in parts.values() for n, shape in tensors.items()}
  ignore = set(ignore)
  found = {n: entry for n, entry in tensor_index(hf_dir).items() if n not in ignore}
  _validate(expected, found, hf_dir)
  place = placement or (lambda _, x: jax.device_put(x))
  leaves = []
  for path, var in tqdm(flat, desc=f"loading {hf_dir.name}", unit="tensor", disable=not progress):
    arrays = []
    for name in parts[path]:
      with safe_open(str(found[name][0]), framework="numpy") as f:
        arrays.append(_to_hf(path, f.get_tensor(name)))
    array = np.stack(arrays) if "{e}" in name_of(path) else arrays[0]
    del arrays
    array = array.astype(var.get_value().dtype if dtype is None else dtype, order="C", copy=False)
    leaves.append((path, var.replace(place(path, array))))
  return nnx.from_flat_state(leaves)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
  """Yields a temporary sibling of `dest` to fill; renames it to `dest` only on success.

  `dest` must not exist or be an empty directory, so nothing is ever half overwritten.
  """
  dest = Path(dest).resolve()
  if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
    raise FileExistsError(f"{dest} already exists and is not empty; remove it or choose another "
                          "output directory.")
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()
  try:
    yield tmp
    for path in [tmp, *tmp.rglob("*")]:  # some writers create 0600 files; publish like cp would
      path.chmod(0o755 if path.is_dir() else 0o644)
    os.replace(tmp, dest)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def copy_aux_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Copies the tokenizer / generation files of AUX_FILES that `src` has into `dst`."""
  for name in AUX_FILES:
    if (Path(src) / name).is_file():
      shutil.copy2(Path(src) / name, Path(dst) / name)


def save_checkpoint(state: nnx.State, out_dir: str | os.PathLike, config: dict, kind: str,
                    aux_from: str | os.PathLike | None = None) -> Path:
  """Writes `state` (orbax) with the HF config.json and cure_jax.json {kind, dtype} to out_dir.

  `aux_from` names a directory whose tokenizer / generation files are copied along.
  """
  dtypes = sorted({v.get_value().dtype.name for _, v in nnx.to_flat_state(state)})
  meta = {"kind": kind, "dtype": dtypes[0] if len(dtypes) == 1 else dtypes}
  with atomic_dir(out_dir) as tmp:
    # Synchronous and uncompressed: orbax's default compression buffers ~half the model again
    # while saving, and buys little on trained weights.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckptr:
      ckptr.save(tmp / "state", args=ocp.args.PyTreeSave(state))
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    (tmp / METADATA).write_text(json.dumps(meta))
    if aux_from is not None:
      copy_aux_files(aux_from, tmp)
  return Path(out_dir)


def read_metadata(ckpt_dir: str | os.PathLike) -> dict | None:
  """cure_jax.json of a converted checkpoint, or None if `ckpt_dir` is not one."""
  path = Path(ckpt_dir) / METADATA
  return json.loads(path.read_text()) if path.is_file() else None


def load_checkpoint(abstract_state: nnx.State, ckpt_dir: str | os.PathLike) -> nnx.State:
  """Restores a save_checkpoint state, cast to the abstract state's dtypes.

  Leaves whose ShapeDtypeStruct carries a sharding are restored straight into it; the others go
  to the default device.
  """
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                            sharding=device),
      abstract_state)
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(Path(ckpt_dir).resolve() / "state", target)


def _split_evenly(sizes: list[int], parts: int) -> list[int]:
  """Shard number of each tensor, cutting the byte total into `parts` contiguous runs."""
  total, cum, out = sum(sizes), 0, []
  for size in sizes:
    out.append(min(parts - 1, cum * parts // max(total, 1)))
    cum += size
  return out


def export_hf(state: nnx.State, out_dir: str | os.PathLike, name_of: NameOf, config: dict,
              aux_from: str | os.PathLike | None = None, num_shards: int = 1,
              dtype=None) -> Path:
  """Writes `state` as an HF directory: safetensors under HF names, config.json, aux files.

  With num_shards > 1 the tensors go to model-0000i-of-0000n.safetensors plus an index json, as
  save_pretrained writes them. Host memory beyond the state: one shard's worth of tensors.
  """
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}")
  flat = list(nnx.to_flat_state(state))
  shard_of = _split_evenly([v.get_value().nbytes for _, v in flat], num_shards)
  weight_map, total_size = {}, 0
  with atomic_dir(out_dir) as tmp:
    for shard in range(num_shards):
      file = SINGLE_FILE if num_shards == 1 else (
          f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors")
      tensors = {}
      for (path, var), s in zip(flat, shard_of):
        if s == shard:
          array = np.asarray(var.get_value())
          out_dtype = array.dtype if dtype is None else dtype
          name = name_of(path)
          slices = ({name: array} if "{e}" not in name else
                    {name.format(e=i): a for i, a in enumerate(array)})
          for n, a in slices.items():
            tensors[n] = np.ascontiguousarray(_to_hf(path, a), out_dtype)
      save_file(tensors, str(tmp / file), metadata={"format": "pt"})
      weight_map.update(dict.fromkeys(tensors, file))
      total_size += sum(t.nbytes for t in tensors.values())
      del tensors
    if num_shards > 1:
      index = {"metadata": {"total_size": total_size},
               "weight_map": dict(sorted(weight_map.items()))}
      (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    if aux_from is not None:
      copy_aux_files(aux_from, tmp)
  return Path(out_dir)


@dataclasses.dataclass(frozen=True)
class Family:
  """What differs between kinds of checkpoint (target model, drafter); the rest is shared.

  build(config dict, dtype) makes the module; read_names(hf_dir, config dict) gives the HF name
  of each state path in that directory and the stored tensors to ignore; write_names names them
  on export.
  """

  kind: str                                          # stored in cure_jax.json
  module: str                                        # `python -m <module>` writes checkpoints
  source: str                                        # what to pass instead, for error messages
  build: Callable[[dict, Any], nnx.Module]
  read_names: Callable[[Path, dict], tuple[NameOf, tuple[str, ...]]]
  write_names: NameOf


def read_state(family: Family, path: str | os.PathLike, dtype, progress: bool, placement=None,
               check: Callable[[dict], None] | None = None):
  """(config dict, graphdef, state) of an HF directory or a converted checkpoint at `path`.

  `check(config)` runs before any weight is read; `placement`
  (cure_jax.runtime.sharding.placement(mesh)) puts each tensor straight onto its devices.
  """
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; pass {family.source} or a checkpoint written "
                            f"by `python -m {family.module}`.")
  meta = read_metadata(path)
  if meta is not None and meta.get("kind") != family.kind:
    raise ValueError(f"{path} holds a converted {meta.get('kind')!r} checkpoint, not a "
                     f"{family.kind!r}; pass {family.source}.")
  config = read_hf_config(path)
  if check is not None:
    check(config)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: family.build(config, jnp.dtype(dtype))))
  if meta is not None:
    if placement is not None:  # restore each leaf straight into its sharding
      abstract = placement.annotate(abstract)
    return config, graphdef, load_checkpoint(abstract, path)
  name_of, ignore = family.read_names(path, config)
  state = stream_params(abstract, path, name_of, jnp.dtype(dtype), progress, ignore=ignore,
                        placement=placement)
  return config, graphdef, state


def load(family: Family, path, dtype, progress: bool = True, placement=None, check=None):
  """The module from an HF directory (converted while loading) or a converted checkpoint."""
  _, graphdef, state = read_state(family, path, dtype, progress, placement, check)
  return nnx.merge(graphdef, state)


def convert(family: Family, hf_dir, out_dir, dtype, progress: bool = True) -> Path:
  """An HF directory -> an orbax checkpoint folder at out_dir (written atomically)."""
  config, _, state = read_state(family, hf_dir, dtype, progress)
  return save_checkpoint(state, out_dir, config, family.kind, aux_from=hf_dir)


def export(family: Family, ckpt_dir, out_dir, dtype=None, num_shards: int = 1) -> Path:
  """A converted checkpoint -> an HF directory (in its stored dtype by default)."""
  meta = read_metadata(ckpt_dir)
  if meta is None:
    raise ValueError(f"{ckpt_dir} has no {METADATA}, so it is not a checkpoint written by "
                     f"`python -m {family.module}`; an HF directory needs no export.")
  config, _, state = read_state(family, ckpt_dir, meta["dtype"] if dtype is None else dtype, False)
  return export_hf(state, out_dir, family.write_names, config, aux_from=ckpt_dir,
                   num_shards=num_shards)
