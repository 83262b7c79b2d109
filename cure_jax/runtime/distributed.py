"""Several processes as one JAX job: start-up, liveness, agreement, and who writes.

On a pod every host runs the same command. `job(config)` makes the processes one job before
anything touches a device: from explicit settings (config.mesh or the environment variables a
launcher sets), or JAX's own detection on Cloud TPU, SLURM and Open MPI. Then nothing may hang
or go wrong silently:

- start-up is bounded: a process that never starts makes the others fail after
  `mesh.timeout_s`, naming it;
- every process beats in the coordinator's key-value store; a watchdog thread ends a process
  whose peer stopped beating for `mesh.heartbeat_s` or failed, naming the peer (a collective
  waiting on a dead peer would otherwise wait, and XLA's own heartbeat, set longer, would end
  the process with a stack trace that names no one);
- a process that fails says so to the others at once and exits without waiting for them;
- `agree` compares a fingerprint of what each process was given (config, prompts, data)
  before any step and names the field that differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import traceback

import jax
import numpy as np
from jax.experimental import multihost_utils

from cure_jax.runtime import errors

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"   # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
EXIT_PEER_LOST = 3                           # exit status when another process is gone
PER_PROCESS = ("mesh.process_id",)           # config fields that differ between processes


class DistributedError(RuntimeError):
  """The processes could not form one job, or disagree; the message says what to fix."""


def _explicit(mesh, environ) -> tuple[str | None, int | None, int | None]:
  """(coordinator, num_processes, process_id) from config.mesh, else the environment; None
  where neither sets it (then JAX's cluster detection fills it in)."""
  coordinator = str(mesh.get("coordinator", "") or "") or environ.get(ENV_COORDINATOR) or None
  num = int(mesh.get("num_processes", 0) or 0) or int(environ.get(ENV_NUM_PROCESSES, 0) or 0)
  pid = int(mesh.get("process_id", -1))
  if pid < 0 and environ.get(ENV_PROCESS_ID, "") != "":
    pid = int(environ[ENV_PROCESS_ID])
  return coordinator, num or None, pid if pid >= 0 else None


def _initialize(mesh, environ) -> None:
  coordinator, num, pid = _explicit(mesh, environ)
  given = {"coordinator": coordinator, "num_processes": num, "process_id": pid}
  if any(v is not None for v in given.values()) and None in given.values():
    missing = [k for k, v in given.items() if v is None]
    raise DistributedError(
        f"multi-process settings are incomplete: set {', '.join(missing)} too (--config.mesh.X "
        f"or {ENV_COORDINATOR} / {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID}), or none of them to let "
        "JAX detect a Cloud TPU / SLURM / Open MPI cluster")
  if num is not None and not 0 <= pid < num:
    raise DistributedError(f"process_id={pid} must lie in 0..num_processes-1={num - 1}")
  timeout, heartbeat = int(mesh.get("timeout_s", 300)), int(mesh.get("heartbeat_s", 60))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes (tests, rehearsal)
  guard = threading.Timer(timeout, _start_timed_out, (coordinator, num, pid, timeout))
  guard.daemon = True
  guard.start()  # JAX's own start-up timeout (set longer) aborts with a message that names no one
  try:
    jax.distributed.initialize(coordinator, num, pid, initialization_timeout=timeout + 60,
                               heartbeat_timeout_seconds=2 * heartbeat + 10)  # after ours
  except Exception as e:  # noqa: BLE001 - XLA's error types; re-raised as one line below
    raise DistributedError(f"process {pid} could not join the job at {coordinator}: "
                           f"{str(e).strip().splitlines()[0][:200]}") from None
  finally:
    guard.cancel()


def _start_timed_out(coordinator, num, pid, timeout) -> None:
  """Start-up took longer than mesh.timeout_s: say who is missing, exit this process."""
  if pid is None:
    missing = "not every process joined"
  elif pid == 0:
    others = ", ".join(map(str, range(1, num)))
    missing = f"process {others} never joined" if num == 2 else (
        f"at least one of processes {others} never joined")
  else:
    missing = (f"process 0 (the coordinator, {coordinator})"
               + (" never started" if num == 2 else " or another process never started"))
  print(f"[process {pid}] {missing} within mesh.timeout_s={timeout} s; start all "
        f"{num or 'N'} processes with the same coordinator address, or raise mesh.timeout_s",
        file=sys.stderr, flush=True)
  os._exit(EXIT_PEER_LOST)


class _Watchdog(threading.Thread):
  """Beats for this process in the coordinator's key-value store every `interval` s and reads
  the others'. A peer that failed, or whose beat has not moved for `silence` s, ends this
  process with a line naming it; so does losing the coordinator (process 0) for that long."""

  PREFIX = "cure_jax/liveness/"
  ORDER = "cure_jax/failures"  # a counter: failures are numbered in the order they happened

  def __init__(self, client, count: int, me: int, silence: float):
    super().__init__(daemon=True, name="cure_jax-watchdog")
    self.client, self.count, self.me, self.silence = client, count, me, silence
    self.interval = max(0.2, silence / 10)
    self.stopped = threading.Event()
    self.beat, self.last_seen = 0, {}
    self.heard_at = {p: time.monotonic() for p in range(count)}

  def mark(self, state: str) -> None:
    """Tells the others this process is `done` (ignore its silence) or `failed`."""
    try:
      value = str(self.client.key_value_increment(self.ORDER, 1)) if state == "failed" else "0"
      self.client.key_value_set(f"{self.PREFIX}{state}/{self.me}", value, allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the coordinator is gone; the others will notice
      pass

  def problem(self) -> str | None:
    """Beats once and reads the store: a line naming the peer that failed first (unless this
    process failed before it) or has been silent too long; None while all is well."""
    now = time.monotonic()
    try:
      self.beat += 1
      self.client.key_value_set(f"{self.PREFIX}beat/{self.me}", str(self.beat),
                                allow_overwrite=True)
      entries = self.client.key_value_dir_get(self.PREFIX)
    except Exception:  # noqa: BLE001 - the coordinator (process 0) does not answer
      if now - self.heard_at[0] > self.silence:
        return f"process 0 (the coordinator) has not answered for {self.silence:g} s"
      return None
    self.heard_at[0] = now
    state: dict[int, dict[str, str]] = {}
    for key, value in entries:
      kind, _, pid = key.removeprefix(self.PREFIX).partition("/")
      state.setdefault(int(pid), {})[kind] = value
    failed = {p: int(v["failed"]) for p, v in state.items() if "failed" in v}
    if failed and min(failed, key=failed.get) != self.me:
      return f"process {min(failed, key=failed.get)} of {self.count} failed (see its output)"
    for p in range(self.count):
      if p == self.me or "done" in state.get(p, {}) or p in failed:
        continue
      if state.get(p, {}).get("beat") != self.last_seen.get(p):
        self.last_seen[p], self.heard_at[p] = state.get(p, {}).get("beat"), now
      elif now - self.heard_at[p] > self.silence:
        return (f"process {p} of {self.count} stopped answering (no beat for "
                f"mesh.heartbeat_s={self.silence:g} s)")
    return None

  def culprit(self) -> str | None:
    """After this process hit an error: which peer caused it, if one failed first or goes
    silent within `silence` s (a collective with a dead peer fails before its beat stops)."""
    deadline = time.monotonic() + self.silence + 2 * self.interval
    while time.monotonic() < deadline:
      found = self.problem()
      if found:
        return found
      time.sleep(self.interval)
    return None

  def run(self):
    while not self.stopped.wait(self.interval):
      found = self.problem()
      if found and not self.stopped.is_set():
        print(f"[process {self.me}] {found}; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)


@contextlib.contextmanager
def job(config, environ=os.environ):
  """The body runs as one process of a multi-process job when config.mesh.distributed (else as
  it is). On entry: jax.distributed.initialize() and the watchdog. On an exception: the error,
  a `failed` mark the others act on at once, and an immediate exit (waiting for peers that may
  be stuck in a collective with this process would hang). On success: a `done` mark."""
  mesh = config.get("mesh") or {}
  if not mesh.get("distributed", False):
    announce_devices()
    yield
    return
  _initialize(mesh, environ)
  announce_devices()
  from jax._src import distributed as jax_distributed  # the job's coordination client
  watchdog = _Watchdog(jax_distributed.global_state.client, jax.process_count(),
                       jax.process_index(), float(mesh.get("heartbeat_s", 60)))
  watchdog.start()
  try:
    yield
  except BaseException as e:  # noqa: BLE001 - every way out of a failed process
    if isinstance(e, SystemExit) and not e.code:
      watchdog.mark("done")
      watchdog.stopped.set()
      raise
    watchdog.stopped.set()
    if not isinstance(e, (SystemExit, *errors.USER_ERRORS)):  # those say what to fix in a line
      traceback.print_exc()
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    cause = watchdog.culprit() if isinstance(e, jax.errors.JaxRuntimeError) else None
    # The line first: once the coordinator is gone, XLA may abort this process at any moment.
    print(f"[process {jax.process_index()}] failed: "
          f"{why if cause is None else f'{cause} ({why[:160]})'}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    watchdog.mark("failed")
    if jax.process_index() == 0:  # the coordinator stays up until the others have read the mark
      time.sleep(2 * watchdog.interval + 0.5)
    code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    os._exit(EXIT_PEER_LOST if cause else code)
  watchdog.mark("done")
  watchdog.stopped.set()


def fingerprint(fields: dict) -> dict[str, int]:
  """A 31-bit hash per field of what this process was given."""
  return {k: int.from_bytes(hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode())
                            .digest()[:4], "little") >> 1 for k, v in sorted(fields.items())}


def agree(fields: dict, what: str = "inputs") -> None:
  """Fails on every process, naming the fields, unless all processes were given the same
  `fields` (JSON-able values); a no-op in a single-process job. Call it before any step."""
  if jax.process_count() == 1:
    return
  mine = fingerprint(fields)
  names = list(mine)
  table = np.asarray(multihost_utils.process_allgather(
      np.asarray([mine[k] for k in names], np.int32)))                    # [P, F]
  differ = [n for j, n in enumerate(names) if len(set(table[:, j].tolist())) > 1]
  if differ:
    groups = {}
    for p, row in enumerate(table):
      groups.setdefault(tuple(row.tolist()), []).append(p)
    sides = " vs ".join("processes " + ",".join(map(str, g)) for g in groups.values())
    raise DistributedError(f"the processes were started with different {what}: "
                           f"{', '.join(differ)} differ ({sides}); give every process the same "
                           "command, config and prompt file")


def config_fields(config) -> dict:
  """A config's leaves by dotted name, without those that differ per process by design."""
  out = {}

  def walk(prefix, node):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}.", v)
      elif f"{prefix}{k}" not in PER_PROCESS:
        out[f"config.{prefix}{k}"] = v
  walk("", config.to_dict() if hasattr(config, "to_dict") else dict(config))
  return out


_ANNOUNCED = []


def describe_devices(devices=None) -> str:
  """`devices: 8 × TPU v5 lite`, `devices: 1 × NVIDIA H100 80GB HBM3 (gpu)`, `devices: 1 × cpu`:
  the devices JAX uses (all processes'), by kind; with the processes when there are several and
  the JAX_PLATFORMS that chose them when it is set."""
  devices = jax.devices() if devices is None else devices
  kinds: dict[tuple[str, str], int] = {}
  for d in devices:
    kinds[(d.device_kind, d.platform)] = kinds.get((d.device_kind, d.platform), 0) + 1
  parts = [f"{n} × {kind}" + ("" if platform.lower() in kind.lower() else f" ({platform})")
           for (kind, platform), n in kinds.items()]
  notes = []
  if jax.process_count() > 1:
    notes.append(f"{jax.process_count()} processes")
  if os.environ.get("JAX_PLATFORMS"):
    notes.append(f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}")
  return "devices: " + " + ".join(parts) + (f" ({', '.join(notes)})" if notes else "")


def announce_devices() -> None:
  """Prints describe_devices() on stderr, once per run and from the writing process only. Entry
  points call it (through job and pipeline.load_target) once the job is formed: before, asking
  JAX for its devices would start its backends too early for jax.distributed."""
  if _ANNOUNCED:
    return
  try:
    devices = jax.devices()
  except RuntimeError as e:  # JAX fails loudly only for the platforms JAX_PLATFORMS names
    if not os.environ.get("JAX_PLATFORMS"):
      raise
    raise ValueError(f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}: "
                     f"{str(e).splitlines()[0].split(' (set JAX_PLATFORMS')[0]}; unset it to "
                     "let JAX pick the devices it finds, or name one of them") from None
  _ANNOUNCED.append(True)
  if is_writer():
    print(describe_devices(devices), file=sys.stderr, flush=True)


def is_writer() -> bool:
  """Whether this process writes the job's output files (process 0 only)."""
  return jax.process_index() == 0
