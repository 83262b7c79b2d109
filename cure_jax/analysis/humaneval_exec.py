"""Running HumanEval programs: a completion turned into a runnable program with its tests, and
untrusted code executed in a resource-limited subprocess (Table 3's pass@1)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence


def extract_program(row: dict, text: str) -> str:
  """A runnable HumanEval program from a completion: the prompt's preamble plus the function the
  model wrote (chat style, fenced or not), else the prompt continued by the completion; then the
  tests and the check call."""
  entry = row["entry_point"]
  blocks = re.findall(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", text, re.S)
  code = next((b for b in blocks if re.search(rf"def\s+{re.escape(entry)}\s*\(", b)),
              blocks[0] if blocks else text)
  prompt = row["prompt"]
  m = re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, re.M)
  if m:
    head = re.search(rf"^def\s+{re.escape(entry)}\s*\(", prompt, re.M)
    # the prompt's preamble (imports, helper functions) + everything the model wrote
    program = (prompt[:head.start()] if head else "") + code
  else:
    program = prompt + code
  return f"{program}\n\n{row['test']}\n\ncheck({entry})\n"


_BOOT = """import resource, runpy, sys
for limit, value in ((resource.RLIMIT_AS, {mem}), (resource.RLIMIT_CPU, {cpu}),
                     (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NPROC, 64)):
  resource.setrlimit(limit, (value, value))
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_program(program: str, timeout: float = 10.0, memory_gib: int = 4) -> dict:
  """Runs untrusted test code in a separate Python process: isolated mode, empty temporary
  working directory, memory / CPU / file-size / process limits set by a bootstrap before the
  program runs, wall-clock timeout (the whole session is killed). Passed = exit status 0.

  No preexec_fn: forking a multithreaded JAX process to run Python in the child can deadlock.
  """
  with tempfile.TemporaryDirectory() as d:
    path = Path(d) / "program.py"
    path.write_text(program)
    boot = _BOOT.format(mem=memory_gib << 30, cpu=int(timeout) + 1)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": d, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", boot, str(path)], cwd=d, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
      _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      proc.communicate()
      return dict(passed=False, status="timed out")
    if proc.returncode == 0:
      return dict(passed=True, status="passed")
    tail = err.decode(errors="replace").strip().splitlines()
    return dict(passed=False, status=f"failed: {tail[-1][:200] if tail else proc.returncode}")


def check_programs(programs: Sequence[str], timeout: float = 10.0, workers: int = 2) -> list[dict]:
  """run_program over many programs (identical programs run once)."""
  unique = {hashlib.sha256(p.encode()).hexdigest(): p for p in programs}
  with ThreadPoolExecutor(max_workers=workers) as pool:
    done = dict(zip(unique, pool.map(lambda p: run_program(p, timeout), unique.values())))
  return [done[hashlib.sha256(p.encode()).hexdigest()] for p in programs]
