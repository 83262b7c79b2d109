"""What the compile tests (test_aot_tpu, test_aot_gpu) share: a small random pair written as
config.json files, and `experiments.aot` run on it in a child process."""

import json
import os
import subprocess
from pathlib import Path

from cure_jax.analysis import random_models

REPO = Path(__file__).resolve().parents[1]


def child_env(**overrides) -> dict:
  """This environment for the child, without JAX_PLATFORMS (the child picks its backend) and
  without conftest's `--xla_backend_optimization_level=0` (it would change the program under
  test), with the repository importable; then `overrides`."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "optimization_level" not in f)
  env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
  return {**env, **overrides}


def compile_pair(python: str, root: Path, arch: random_models.Arch, flags: list[str],
                 env: dict) -> list[dict]:
  """`python -m experiments.aot` on `arch`'s pair (written under root) with `flags`; its records."""
  for name, cfg in zip(("target", "drafter"),
                       random_models.hf_configs(arch.target_cfg(), arch.drafter_cfg())):
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(cfg))
  cmd = [python, "-m", "experiments.aot", "--config=configs/qwen3_8b.py",
         f"--target={root / 'target'}", f"--drafter={root / 'drafter'}",
         f"--output={root / 'out'}", *flags]
  child = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
  return json.loads((root / "out.json").read_text())["records"]
