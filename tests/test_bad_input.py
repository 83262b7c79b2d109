"""Every input a user can get wrong fails early with a message that says what to fix."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cure_jax.runtime import generation, pipeline, prompts, xla_options
from cure_jax.tree import repair
from cure_jax.runtime.generation import Generator
from cure_jax.analysis import random_models

ARCH = random_models.Arch()


@pytest.fixture(scope="module")
def pair():
  return random_models.pair(ARCH, 0)


def test_prompt_longer_than_the_cache(pair):
  target, _ = pair
  gen = Generator(target, method="ar", max_new_tokens=4, max_len=16)
  with pytest.raises(ValueError, match="longer than the cache"):
    gen.generate([list(range(1, 8)) * 3])


def test_max_new_tokens_past_the_cache(pair):
  target, _ = pair
  gen = Generator(target, method="ar", max_new_tokens=20, max_len=16)
  with pytest.raises(ValueError, match="runs past the cache.*max_len >= 24"):
    gen.generate([[1, 2, 3, 4, 5]])


def test_empty_prompt_and_zero_tokens(pair):
  target, _ = pair
  with pytest.raises(ValueError, match="at least one token"):
    Generator(target, method="ar", max_new_tokens=4).generate([[]])
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    Generator(target, method="ar", max_new_tokens=0)


def test_long_prompt_settings(pair):
  """prefill_chunk, drafter.window and a rope scaling the cache cannot follow."""
  from cure_jax.models.layers import rope_from_hf
  target, drafter = pair
  with pytest.raises(ValueError, match="prefill_chunk=-1 must be >= 1 .* or 0 for the platform"):
    Generator(target, method="ar", max_new_tokens=4, prefill_chunk=-1)
  with pytest.raises(ValueError, match="drafter.window=-1 must be >= 0"):
    Generator(target, drafter, method="chain", max_new_tokens=4, drafter_window=-1)
  with pytest.raises(ValueError, match="rope type 'dynamic' is not supported .*yarn"):
    rope_from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 8)


def test_draft_vocab_settings(pair, tmp_path):
  """drafter.vocab below 0, and a drafter.vocab_counts file that is not there."""
  from configs.common import base_config
  target, drafter = pair
  config = base_config()
  config.drafter.vocab = -1
  with pytest.raises(ValueError, match="drafter.vocab=-1 must lie in 0..8 "):
    pipeline.make_generator(config, target, drafter, method="chain")
  config.drafter.vocab, config.drafter.vocab_counts = 4, str(tmp_path / "missing.npz")
  with pytest.raises(FileNotFoundError, match="no token counts at .*missing.npz; write them"):
    pipeline.make_generator(config, target, drafter, method="chain")


def test_prefill_chunk_zero_takes_the_platform_default(pair):
  """0 resolves per platform (GPU 2048, TPU and CPU 512; jax names GPUs 'cuda' or 'rocm'); a
  chunk given is kept."""
  from cure_jax.runtime.generation import platform_prefill_chunk
  assert [platform_prefill_chunk(0, p) for p in ("cuda", "rocm", "gpu", "tpu", "cpu")] == [
      2048, 2048, 2048, 512, 512]
  assert platform_prefill_chunk(300, "cuda") == 300
  assert Generator(pair[0], method="ar", max_new_tokens=4).prefill_chunk == 512   # this CPU


def test_unknown_compiler_options(pair):
  target, _ = pair
  gen = Generator(target, method="ar", max_new_tokens=4, compiler_options={"xla_no_such": "1"})
  with pytest.raises(ValueError, match="No such compile option: 'xla_no_such'"):
    gen.generate([[1, 2, 3]])
  with pytest.raises(ValueError, match="name=value pairs, not \\['split_k'\\]"):
    pipeline.compiler_options("xla_a=1,split_k")


def test_a_platform_default_this_xla_lacks_is_left_out(pair, monkeypatch):
  """A platform default option (xla_options.PLATFORM_OPTIONS) that the installed XLA does not know
  is dropped, not reported as the user's error; the user's own unknown option still is."""
  target, _ = pair
  want = Generator(target, method="ar", max_new_tokens=4).generate([[1, 2, 3]])
  monkeypatch.setitem(xla_options.PLATFORM_OPTIONS, "cpu", {
      **xla_options.PLATFORM_OPTIONS["cpu"], "xla_not_in_this_version": "1"})
  monkeypatch.setattr(generation, "_EXECUTABLES", {})         # compiled again, with the default
  got = Generator(target, method="ar", max_new_tokens=4).generate([[1, 2, 3]])
  assert got[0].output_ids == want[0].output_ids
  gen = Generator(target, method="ar", max_new_tokens=4, compiler_options={"xla_no_such": "1"})
  with pytest.raises(ValueError, match="No such compile option: 'xla_no_such'"):
    gen.generate([[1, 2, 3]])


def test_compiler_options_reach_the_compiler_and_keep_the_tokens(pair, tmp_path):
  """An XLA option (here: dump the optimized HLO) is passed to every compile of the Generator,
  which keeps its own executables and emits the same tokens."""
  target, _ = pair
  want = Generator(target, method="ar", max_new_tokens=6).generate([[1, 2, 3]])
  dumped = Generator(target, method="ar", max_new_tokens=6,
                     compiler_options={"xla_dump_to": str(tmp_path)}).generate([[1, 2, 3]])
  assert dumped[0].output_ids == want[0].output_ids
  assert list(tmp_path.glob("*prefill*.txt")) and list(tmp_path.glob("*decode*.txt"))
  assert pipeline.compiler_options(" a=1, b=x=y ,") == {"a": "1", "b": "x=y"}


def test_methods_need_the_right_drafter(pair):
  target, drafter = pair
  with pytest.raises(ValueError, match="needs a drafter"):
    Generator(target, method="cure", max_new_tokens=4)
  with pytest.raises(ValueError, match="DFlash block drafter"):
    Generator(target, random_models.ar_drafter(ARCH, 0), method="chain", max_new_tokens=4)
  with pytest.raises(ValueError, match="method='beam'"):
    Generator(target, drafter, method="beam", max_new_tokens=4)


def test_invalid_cure_settings(pair):
  target, drafter = pair
  with pytest.raises(ValueError, match="b_max=9 alternatives"):
    Generator(target, drafter, method="cure", max_new_tokens=4,
              cure=repair.RepairConfig(b_max=9, max_depth=5))
  with pytest.raises(ValueError, match="v_max=3 is too small for branch 0"):
    Generator(target, drafter, method="cure", max_new_tokens=4,
              cure=repair.RepairConfig(v_max=3, max_depth=5))


def test_prompt_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    prompts.read_jsonl(str(tmp_path / "missing.jsonl"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "ok"}\n{not json}\n')
  with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
    prompts.read_jsonl(str(bad))
  bad.write_text(json.dumps({"text": "x"}) + "\n")
  with pytest.raises(ValueError, match='needs a "prompt"'):
    prompts.read_jsonl(str(bad))
  bad.write_text(json.dumps({"prompt_ids": [1, "a"]}) + "\n")
  with pytest.raises(ValueError, match="non-empty list of ints"):
    prompts.read_jsonl(str(bad))
  with pytest.raises(ValueError, match="outside the target vocabulary"):
    prompts.encode([{"prompt_ids": [1, 99]}], None, True, vocab_size=8)
  with pytest.raises(ValueError, match="need a tokenizer"):
    prompts.encode([{"prompt": "hi"}], None, True, vocab_size=8)


# --- the command line: one `error:` line, exit 2, no traceback ---------------------------------

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, jax_platforms: str | None = "cpu"):
  """`python -m experiments.decode ARGS` in a child process, as a user runs it (with
  JAX_PLATFORMS set to `jax_platforms`, or unset for None)."""
  env = {**os.environ, "JAX_PLATFORMS": jax_platforms,
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  env = {k: v for k, v in env.items() if v is not None and k != "CURE_JAX_TRACEBACK"}
  return subprocess.run([sys.executable, "-m", "experiments.decode", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def _one_error_line(child) -> str:
  assert child.returncode == 2, child.stderr[-3000:]
  assert "Traceback" not in child.stderr, child.stderr[-3000:]
  lines = [line for line in child.stderr.splitlines() if line.startswith("error: ")]
  assert len(lines) == 1, child.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize("args, line", [
    (("--config.cure.vmax=3",),   # the default config: ml_collections applies it at import
     "error: unknown config field 'cure.vmax'; did you mean 'cure.v_max'?"),
    (("--config=configs/smollm2_135m.py", "--config.batch_size=abc"),   # applied by absl
     "error: --config.batch_size=abc: config.batch_size takes an int (the config has 1)"),
    (("--config.batch_size=0",),
     "error: batch_size=0 must be a positive integer (prompts decoded together)"),
    (("--config.cure.v_max=-3",),   # the default method, auto, sets the tree's v_max itself
     "error: cure.v_max=-3 must be >= 2 (the root and a drafted node)"),
], ids=["unknown_field", "wrong_type", "batch_size_0", "v_max_under_auto"])
def test_config_mistakes_are_one_line(args, line):
  child = _cli(*args)
  assert _one_error_line(child) == line
  assert child.stderr.strip().splitlines()[-1] == line


def test_unknown_config_fields_name_the_nearest():
  from configs.common import base_config
  from cure_jax.runtime import errors
  config = base_config()
  assert errors.unknown_field(config, "cure.v_max") is None
  assert errors.unknown_field(config, "vmax") == ("unknown config field 'vmax'; did you mean "
                                                  "'cure.v_max'?")
  assert errors.unknown_field(config, "mesh.dta") == ("unknown config field 'mesh.dta'; did you "
                                                      "mean 'mesh.data'?")
  assert errors.unknown_field(config, "xyz").startswith(
      "unknown config field 'xyz'; the fields are: auto, batch_size, ")
  assert errors.unknown_field(config, "cure.v_max.x") == (
      "unknown config field 'cure.v_max.x': 'cure.v_max' is a setting (64 in the config), not a "
      "group of fields")


@pytest.mark.parametrize("method", ["ar", "chain", "ddtree", "auto", "ar_draft"])
def test_tree_controller_and_sampling_ranges_whichever_method(method):
  """A setting out of its range is refused before loading, also by a method that does not read
  it or overrides it; every problem in one message."""
  from configs.common import base_config
  for group, field, value, says in [
      ("cure", "v_max", -3, "cure.v_max=-3 must be >= 2"),
      ("cure", "topk", 0, "cure.topk=0 must be >= 1"),
      ("cure", "b_min", 0, "cure.b_min=0, b_max=5: need 1 <= b_min <= b_max"),
      ("cure", "cost_draft", -1.0, "cure.cost_draft, cost_redraft, cost_verify_base, "),
      ("auto", "decay", 1.5, "auto.decay=1.5 must be in [0, 1)"),
      ("auto", "budgets", "4,1", "auto.budgets=(4, 1): give increasing node counts"),
      (None, "top_p", 0.0, "top_p=0.0 must lie in (0, 1]")]:
    config = base_config()
    config.method = method
    (config[group] if group else config)[field] = value
    with pytest.raises(ValueError) as e:
      pipeline.check_config(config)
    assert str(e.value).startswith(says), str(e.value)
  config = base_config()
  config.method = method
  config.cure.v_max, config.auto.decay = 0, -0.5
  with pytest.raises(ValueError, match=r"^cure.v_max=0 must be >= 2 .*; auto.decay=-0.5 must"):
    pipeline.check_config(config)


def test_run_settings_are_checked_before_loading(pair):
  from configs.common import base_config
  for settings, says in [
      ({"batch_size": -2}, "batch_size=-2 must be a positive integer (prompts decoded together)"),
      ({"max_len": -5}, "max_len=-5 must be >= 0 (the static cache length; 0 = each prompt's "),
      ({"num_prompts": -1}, "num_prompts=-1 must be >= 0 (the first N prompts; 0 = all)"),
      ({"drafter.gamma": 0}, "drafter.gamma=0 must be a positive integer (ar_draft: drafted "),
      ({"numerics": "exact"}, "numerics='exact' must be one of default, invariant"),
      ({"numerics": "invariant", "max_len": 2 ** 19},   # int64 sums hold 2^19 terms of 2^44
       "max_len=524288: numerics=invariant sums attention exactly over fewer than 524288 keys")]:
    config = base_config()
    for field, value in settings.items():
      node = config.drafter if field.startswith("drafter.") else config
      node[field.split(".")[-1]] = value
    with pytest.raises(ValueError) as e:
      pipeline.check_config(config)
    assert str(e.value).startswith(says)
  pipeline.check_config(base_config())
  gen = Generator(pair[0], method="ar", max_new_tokens=4)
  with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
    pipeline.decode_all(gen, [[1, 2]], 0)
  with pytest.raises(ValueError, match="no prompts to decode"):
    gen.generate([])


# --- device memory: refused before compiling, with the largest setting that fits ---------------

def test_memory_estimate_bounds_the_compiled_program():
  """On a tree-dominated case (ddtree, 768 nodes over a 256-slot cache) the estimate is a lower
  bound of what XLA allocates for the decode loop (temporaries + its state), and within 2x of it;
  the caches it counts are exactly those of the loop's state."""
  import jax
  from cure_jax.runtime import memory
  arch = random_models.Arch(vocab=64)
  target, drafter = random_models.pair(arch, 0)
  gen = Generator(target, drafter, method="ddtree", max_new_tokens=8, max_len=256,
                  cure=repair.RepairConfig(v_max=768, max_depth=arch.block_size - 1))
  _, decode = gen._executables(1, 256, 256)
  analysis = decode.memory_analysis()
  if analysis is None:
    pytest.skip("this backend reports no memory analysis")
  params = sum(x.nbytes for x in jax.tree.leaves(gen.params))
  allocated = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes - params
  run = memory.run_of(target, drafter, batch=1, max_len=256, nodes=768,
                      platform=jax.devices()[0].platform)
  assert run.total() <= allocated <= 2 * run.total(), (run.terms(), allocated)
  caches = jax.eval_shape(lambda: (target.init_cache(3, 256), drafter.init_cache(3, 256)))
  kv = [x for c in caches for x in c.k + c.v]
  assert memory.run_of(target, drafter, batch=3, max_len=256, nodes=768,
                       platform="cpu").caches() == sum(x.size * x.dtype.itemsize for x in kv)


def test_largest_fitting_setting(pair):
  """The setting named is the one that can be lowered to fit: the batch where the caches
  dominate; where none can, the line says what else to do."""
  import jax
  from cure_jax.runtime import memory
  assert memory.largest_fitting(lambda n: n * n <= 1000, 1, 100) == 31
  assert memory.largest_fitting(lambda n: n <= 0, 1, 100) is None
  assert [memory.fmt(n) for n in (12.3e6, 747e9, 5.03e12, 5.72e16)] == [
      "12.3 MB", "747 GB", "5.03 TB", "57,200 TB"]
  target, drafter = pair
  kw = dict(method="chain", max_len=64, nodes=6, devices=jax.devices(), tree=None,
            cache=("max_new_tokens", 1, 8, lambda n: 64))
  with pytest.raises(ValueError, match=r"^chain at batch 1000000000 and max_len 64 needs "
                     r"~[\d.]+ TB .* the largest batch_size that could fit is \d+ "):
    memory.check(target, drafter, batch=10**9, **kw)
  memory.check(target, drafter, batch=1, **kw)
  with pytest.raises(ValueError, match="no smaller tree, batch or cache fits: use a device with "
                     "more memory, dtype=bfloat16, or split the model"):
    memory.check(target, drafter, batch=1, **dict(kw, max_len=10**15,
                                                  cache=("max_len", 10**15, 10**15, int)))


def test_a_tree_too_big_for_the_machine_is_one_line_before_compiling(tmp_path):
  """ddtree at a million nodes (32 TB of attention scores alone): refused with the bytes, the
  machine's memory and the largest v_max that could fit. Run as a user would, without
  JAX_PLATFORMS: the devices are named once and JAX's probe for a TPU is not shown."""
  arch = random_models.Arch(vocab=64)
  target_dir, drafter_dir = random_models.write_hf(tmp_path, *random_models.pair(arch, 0))
  (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
  from cure_jax.runtime import errors
  platforms, devices = None, "devices: 1 × cpu"
  if not errors.only_cpu_can_start():   # an accelerator here: the child stays on the CPU
    platforms, devices = "cpu", "devices: 1 × cpu (JAX_PLATFORMS=cpu)"
  child = _cli(f"--config.target.path={target_dir}", f"--config.drafter.path={drafter_dir}",
               f"--config.prompts={tmp_path / 'prompts.jsonl'}", "--config.method=ddtree",
               "--config.cure.v_max=1000000", "--config.max_new_tokens=8",
               "--config.check_ar=false", "--config.compilation_cache=off",
               "--config.drafter.vocab=0", jax_platforms=platforms)
  line = _one_error_line(child)
  assert re.fullmatch(
      r"error: ddtree with cure\.v_max=1000000 at batch 1 and max_len 64 needs ~\d+(\.\d+)? TB "
      r"for its largest buffers \(attention scores 2 x \[1, 4, 1000000, 1000064\] float32: .*\); "
      r"this machine has [\d.]+ [GMT]B available \(MemAvailable\); the largest cure\.v_max that "
      r"could fit is \d+ \(a lower bound from the shapes: cure_jax/runtime/memory\.py\)",
      line), line
  # all it says besides the loading bars: no "Unable to initialize backend 'tpu'", nor what
  # libtpu prints where it is installed (CI) on a machine without a TPU
  said = [s for s in child.stderr.splitlines() if s.strip() and not s.startswith("loading ")]
  assert said == [devices, line], child.stderr[-3000:]


def test_jax_startup_shows_the_devices_not_the_probes():
  """The probe records are dropped (absl shows INFO), JAX's warnings are kept; the devices line
  names the kind and count, and the user's JAX_PLATFORMS."""
  import logging
  from cure_jax.runtime import distributed, errors
  errors.quiet_jax_startup()
  probe = logging.getLogger("jax._src.xla_bridge")
  seen = []

  class Keep(logging.Handler):
    def emit(self, record):
      seen.append(record.getMessage())

  keep, level = Keep(), logging.root.level
  logging.root.addHandler(keep)
  logging.root.setLevel(logging.INFO)
  try:
    probe.info("Unable to initialize backend 'tpu': NOT_FOUND: No jellyfish device found.")
    probe.warning("A Google TPU may be present on this machine, but ...")
  finally:
    logging.root.removeHandler(keep)
    logging.root.setLevel(level)
  assert seen == ["A Google TPU may be present on this machine, but ..."]
  platforms = os.environ.get("JAX_PLATFORMS")   # conftest's cpu
  assert distributed.describe_devices() == "devices: 1 × cpu" + (
      f" (JAX_PLATFORMS={platforms})" if platforms else "")
