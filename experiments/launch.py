"""Rehearse a multi-host job on one machine: N processes, each told what a pod host is told.

  python -m experiments.launch --processes=2 --devices_per_process=4 -- experiments.decode \\
    --config.mesh.data=2 --config.mesh.model=4 --config.mesh.distributed=true

Each process gets the coordinator address, the process count and its id
(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, which
cure_jax.runtime.distributed reads), `devices_per_process` fake CPU devices and CPU collectives
(gloo). Their output is streamed line by line behind `[pN]`. If a process fails, the others are
stopped after `--grace` seconds (their own watchdogs usually end them first), and the launcher
exits with the first failure's status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from cure_jax.runtime import errors

_PROCESSES = flags.DEFINE_integer("processes", 2, "number of processes (hosts) to start")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "fake CPU devices per process; 0: "
                                "leave the platform alone (real accelerators)")
_PORT = flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1; 0: a free one")
_GRACE = flags.DEFINE_float("grace", 30.0, "seconds the others get to stop after one fails")
_TIMEOUT = flags.DEFINE_float("timeout", 0.0, "stop everything after this many seconds; 0: none")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(base: dict, coordinator: str, count: int, index: int, devices: int) -> dict:
  """What a pod host is told, for process `index` of `count`."""
  env = dict(base, JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(count),
             JAX_PROCESS_ID=str(index), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
             PYTHONUNBUFFERED="1")
  if devices:
    env["JAX_PLATFORMS"] = "cpu"
    flag = f"--xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = " ".join(f for f in (base.get("XLA_FLAGS", ""), flag) if f)
  return env


def _stream(proc: subprocess.Popen, prefix: str, out) -> None:
  for line in proc.stdout:
    out.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
    out.flush()


def launch(argv: list[str], processes: int, devices: int, port: int = 0, grace: float = 30.0,
           timeout: float = 0.0, env: dict | None = None, out=None) -> int:
  """Runs `python -m argv[0] argv[1:]` as `processes` processes of one job, streaming their
  output to `out` (stdout); returns the exit status: 0 if all succeeded, else the first
  failure's (124 on --timeout)."""
  out = sys.stdout if out is None else out

  def say(message: str) -> None:
    out.write(f"[launch] {message}\n")
    out.flush()

  if processes < 1:
    raise ValueError(f"--processes={processes} must be >= 1")
  if not argv:
    raise ValueError("name the module to run after --, e.g. -- experiments.decode --config=...")
  coordinator = f"127.0.0.1:{port or free_port()}"
  base = dict(os.environ if env is None else env)
  procs, streams = [], []
  for i in range(processes):
    p = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=process_env(base, coordinator, processes, i, devices))
    procs.append(p)
    streams.append(threading.Thread(target=_stream, args=(p, f"[p{i}]", out), daemon=True))
    streams[-1].start()
  status, start, failed_at = 0, time.monotonic(), None
  while [p.poll() for p in procs].count(None):
    now = time.monotonic()
    for i, p in enumerate(procs):
      if p.returncode and not status:
        status, failed_at = p.returncode, now
        say(f"process {i} exited with status {_shell_status(p.returncode)}; the others get "
            f"{grace:g} s to stop")
    late = failed_at is not None and now - failed_at > grace
    if late or (timeout and now - start > timeout):
      if not status:
        status = 124
        say(f"--timeout={timeout:g} s passed; stopping every process")
      for i, p in enumerate(procs):
        if p.poll() is None:
          say(f"stopping process {i}")
          os.killpg(p.pid, signal.SIGKILL)
    time.sleep(0.2)
  for t in streams:
    t.join(timeout=5)
  if not status:
    status = next((p.returncode for p in procs if p.returncode), 0)
  codes = ", ".join(f"p{i}={_shell_status(p.returncode)}" for i, p in enumerate(procs))
  say(f"{processes} process(es) done ({codes}), status {_shell_status(status)}")
  return _shell_status(status)


def _shell_status(code: int) -> int:
  """A child's exit status as a shell reports it (128 + N when killed by signal N)."""
  return 128 - code if code < 0 else code


def main(argv):
  sys.exit(launch(list(argv[1:]), _PROCESSES.value, _DEVICES.value, _PORT.value, _GRACE.value,
                  _TIMEOUT.value))


if __name__ == "__main__":
  errors.run(main)
