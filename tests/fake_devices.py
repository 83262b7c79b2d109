"""Runs part of a test file again in a child pytest whose XLA sees fake CPU devices (the device
count is fixed when jax first starts, so the suite's own process cannot get them)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_in_child(test_file: str, select: str, tmp_path: Path, devices: int = 8) -> str:
  """`pytest test_file -k select` with `devices` fake CPU devices; fails on a failure there.
  Returns the child's stdout."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  child = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-o", "addopts=",
                          "-p", "no:cacheprovider", "-k", select,
                          # its own basetemp: a child pytest would otherwise prune this run's
                          "--basetemp", str(tmp_path / "child"), "-p", "no:xdist"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-4000:]
  return child.stdout
