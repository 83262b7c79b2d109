"""Executes the research notebooks with nbclient and fails on any cell error; with --save the
outputs are written back into the notebooks (what is committed, so they render on GitHub).

  python -m experiments.run_notebooks                    # both; the 8B one in small mode
  python -m experiments.run_notebooks --save quickstart  # re-run one and store its outputs

tests/test_notebooks.py runs the same function, so CI executes exactly what is committed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {"quickstart": ROOT / "notebooks" / "quickstart.ipynb",
             "qwen3_8b": ROOT / "notebooks" / "qwen3_8b.ipynb"}
SMALL = {"qwen3_8b"}  # run in small mode (CURE_JAX_NOTEBOOK_SMALL=1): tiny models, 8 fake devices


def kernel_env(name: str) -> dict:
  """The kernel's environment: the caller's (the test suite's JAX_PLATFORMS=cpu keeps a kernel
  off libtpu, which admits one process per machine, and its compile-time XLA_FLAGS apply; small
  mode appends its own), no progress bars or widget warnings in stored outputs, and small mode
  where it applies."""
  env = dict(os.environ)
  env.update(TQDM_DISABLE="1", PYTHONWARNINGS="ignore::DeprecationWarning,ignore:IProgress not found")
  if name in SMALL:
    env["CURE_JAX_NOTEBOOK_SMALL"] = "1"
  else:
    env.pop("CURE_JAX_NOTEBOOK_SMALL", None)
  return env


def execute(name: str, save: bool = False, timeout: int = 900, env: dict | None = None):
  """Runs every cell of notebook `name` from the repository root; raises
  nbclient.exceptions.CellExecutionError on the first failing cell. Returns (notebook, seconds)."""
  path = NOTEBOOKS[name]
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                          resources={"metadata": {"path": str(ROOT)}})
  t0 = time.perf_counter()
  client.execute(env=kernel_env(name) if env is None else env)
  seconds = time.perf_counter() - t0
  if save:
    nbformat.write(nb, path)
  return nb, seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help=f"notebooks to run: {', '.join(NOTEBOOKS)} "
                      "(default: all)")
  parser.add_argument("--save", action="store_true", help="write the outputs into the notebooks")
  args = parser.parse_args()
  unknown = sorted(set(args.names) - set(NOTEBOOKS))
  if unknown:
    parser.error(f"unknown notebooks {unknown}; choose from {', '.join(NOTEBOOKS)}")
  for name in args.names or list(NOTEBOOKS):
    _, seconds = execute(name, save=args.save)
    print(f"{name}: executed in {seconds:.0f} s{' (outputs saved)' if args.save else ''}")


if __name__ == "__main__":
  main()
