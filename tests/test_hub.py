"""Checkpoint paths may be Hugging Face Hub ids, fetched once into the Hub's cache. Offline
(HF_HUB_OFFLINE=1) against a Hub-layout cache written here: the ids decode like local
directories, and a missing directory or an id the cache lacks is one line that names the fix."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cure_jax.analysis import random_models

REPO = Path(__file__).resolve().parents[1]
ARCH = random_models.Arch()
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _into_cache(cache: Path, repo_id: str, folder: Path) -> None:
  """The layout huggingface_hub keeps: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  shutil.copytree(folder, repo / "snapshots" / COMMIT)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  root = tmp_path_factory.mktemp("hub")
  target_dir, drafter_dir = random_models.write_hf(root / "src", *random_models.pair(ARCH, 5))
  _into_cache(root / "cache", "tiny-org/target", target_dir)
  _into_cache(root / "cache", "tiny-org/dflash", drafter_dir)
  prompts = random_models.prompts(5, ARCH.vocab, 2)
  (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                                              for p in prompts))
  return root


def _decode(hub, *flags):
  env = {**os.environ, "HF_HUB_CACHE": str(hub / "cache"), "HF_HUB_OFFLINE": "1",
         "JAX_PLATFORMS": "cpu"}
  env.pop("CURE_JAX_TRACEBACK", None)
  return subprocess.run([sys.executable, "-m", "experiments.decode", "--config=configs/qwen3_8b.py",
                         "--config.dtype=float32", f"--config.prompts={hub / 'prompts.jsonl'}",
                         "--config.max_new_tokens=8", "--config.compilation_cache=off", *flags],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_hub_ids_decode_like_local_directories(hub):
  out = hub / "out.json"
  child = _decode(hub, "--config.target.path=tiny-org/target", "--config.drafter.path=tiny-org/dflash",
                  "--config.method=chain", "--config.check_ar=true", f"--config.output={out}")
  assert child.returncode == 0, child.stderr[-3000:]
  summary = json.loads(out.read_text())["summary"]
  assert summary["equal_to_ar"] == summary["prompts"] == 2


@pytest.mark.parametrize("flags, says", [
    ((), "'Qwen/Qwen3-8B' is not a local directory, and it is not in the Hugging Face cache"),
    (("--config.target.path=tiny-org/absent",), "huggingface-cli download tiny-org/absent"),
    (("--config.target.path=/ckpt/Qwen3-8B",), "/ckpt/Qwen3-8B does not exist"),
], ids=["default_config_offline", "unknown_id", "missing_directory"])
def test_a_path_that_cannot_be_had_is_one_line(hub, flags, says):
  child = _decode(hub, *flags)
  assert child.returncode == 2, child.stderr[-3000:]
  assert "Traceback" not in child.stderr
  errors = [line for line in child.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and says in errors[0], child.stderr[-3000:]
