"""Compile-only NVIDIA GPUs: XLA's GPU compiler builds for a GPU it is described, no GPU needed.
(`topology_devices` also gives compile-only TPU topologies, through libtpu, and the host CPU.)

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` takes a
GpuTargetConfig text proto. This module writes one from each GPU's published figures (NVIDIA's
datasheets and the CUDA C++ Programming Guide's table of compute capabilities):

- A100 SXM4 80 GB: 108 SMs, 2.039 TB/s HBM2e, 40 MB L2, 1.41 GHz boost, compute 8.0
  (NVIDIA A100 Tensor Core GPU datasheet);
- H100 SXM5 80 GB: 132 SMs, 3.35 TB/s HBM3, 50 MB L2, 1.98 GHz boost, compute 9.0
  (NVIDIA H100 Tensor Core GPU datasheet; Hopper architecture whitepaper);
- H200 SXM 141 GB: the H100's GH100 die (132 SMs, 50 MB L2) with 4.8 TB/s HBM3e
  (NVIDIA H200 Tensor Core GPU datasheet);
- B200 180 GB: 148 SMs, 8 TB/s HBM3e, 126 MB L2, compute 10.0 (NVIDIA Blackwell datasheet and
  architecture brief).

Per-SM limits by compute capability (Programming Guide, "Technical Specifications per Compute
Capability"): 1024 threads per block, warps of 32, 64 K registers per SM and per block, 48 KB
of static shared memory per block; shared memory per SM 164 KB (8.0) / 228 KB (9.0, 10.0), of
which one block may opt in to 163 KB / 227 KB; 2048 threads per SM.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

KB = 1024


@dataclasses.dataclass(frozen=True)
class Gpu:
  name: str                 # device_description_str
  sms: int
  bandwidth: float          # bytes/s
  l2: int                   # bytes
  memory: int               # bytes
  clock_ghz: float
  compute: tuple[int, int]
  bf16_tflops: float        # dense bf16 tensor-core peak (datasheet), for rooflines

  @property
  def shared_per_sm(self) -> int:
    return (164 if self.compute[0] == 8 else 228) * KB

  @property
  def shared_optin(self) -> int:
    return (163 if self.compute[0] == 8 else 227) * KB


GPUS = {
    "a100": Gpu("NVIDIA A100-SXM4-80GB", 108, 2.039e12, 40 * 2**20, 80 * 2**30, 1.41, (8, 0),
                312.0),
    "h100": Gpu("NVIDIA H100 80GB HBM3", 132, 3.35e12, 50 * 2**20, 80 * 2**30, 1.98, (9, 0),
                989.0),
    "h200": Gpu("NVIDIA H200", 132, 4.8e12, 50 * 2**20, 141 * 10**9, 1.98, (9, 0), 989.0),
    "b200": Gpu("NVIDIA B200", 148, 8.0e12, 126 * 2**20, 180 * 10**9, 1.965, (10, 0), 2250.0),
}


def parse(topology: str) -> tuple[Gpu, int] | None:
  """'h100' or 'h100:8' (8 GPUs of one host) -> (Gpu, count); None for a non-GPU name."""
  m = re.fullmatch(r"([a-z]\d+)(?::(\d+))?", topology)
  if not m or m.group(1) not in GPUS:
    return None
  return GPUS[m.group(1)], int(m.group(2) or 1)


def target_config(gpu: Gpu) -> str:
  """The GpuTargetConfig text proto XLA's GPU compiler reads."""
  major, minor = gpu.compute
  info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=48 * KB,
              shared_memory_per_core=gpu.shared_per_sm, threads_per_core_limit=2048,
              core_count=gpu.sms, fpus_per_core=128, block_dim_limit_x=2**31 - 1,
              block_dim_limit_y=65535, block_dim_limit_z=65535,
              memory_bandwidth=int(gpu.bandwidth), l2_cache_size=gpu.l2,
              clock_rate_ghz=gpu.clock_ghz, device_memory_size=gpu.memory,
              shared_memory_per_block_optin=gpu.shared_optin, registers_per_core_limit=65536,
              registers_per_block_limit=65536)
  body = "\n".join(f"  {k}: {v}" for k, v in info.items())
  return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: {major} "
          f"minor: {minor} }}\n}}\nplatform_name: \"CUDA\"\n"
          f"dnn_version_info {{ major: 9 minor: 8 patch: 0 }}\n"
          f"device_description_str: \"{gpu.name}\"\n")


def devices(topology: str) -> list:
  """Compile-only devices of `topology` ('h100', 'h100:8', ...); needs jax[cuda12]."""
  gpu, count = parse(topology)
  try:
    import jax_cuda12_plugin  # noqa: F401  (XLA's GPU compiler comes with this package)
  except ImportError as e:
    import jax
    raise ValueError(
        f"--topology={topology} needs XLA's GPU compiler: python -m venv --system-site-packages "
        f"venv_cuda && venv_cuda/bin/pip install \"jax[cuda12]=={jax.__version__}\", then run with "
        "venv_cuda/bin/python (no GPU needed)") from e
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu),
                                           topology=f"1x1x{count}").devices)


def topology_devices(name: str) -> list:
  """Compile-only devices of a TPU topology (libtpu's compiler) or of NVIDIA GPUs ('h100',
  'h100:8'), or the CPU backend's devices for 'cpu'."""
  import jax
  if name == "cpu":
    return jax.devices("cpu")
  if parse(name):
    return devices(name)
  try:
    import libtpu  # noqa: F401  (jax finds the TPU compiler through this package)
  except ImportError as e:
    raise ValueError(f"--topology={name} needs libtpu: pip install \"jax[tpu]=={jax.__version__}\" "
                     "(no TPU needed; a separate venv keeps it away from other JAX processes)"
                     ) from e
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(name, "tpu").devices)
  except Exception as e:  # libtpu's messages do not name the valid choices
    if LIBTPU_LOCKFILE_ERROR in str(e):
      raise ValueError(libtpu_in_use(str(e))) from e
    raise ValueError(f"unknown TPU topology {name!r} ({type(e).__name__}: {e}); use "
                     "<generation>:<chips>, e.g. v5e:2x2, v5e:2x4, v6e:2x2, v5p:2x2x1, a GPU "
                     f"({', '.join(GPUS)}, e.g. h100 or h100:8), or 'cpu'") from e


# what libtpu says when another process holds its lock file (it admits one process a machine)
LIBTPU_LOCKFILE_ERROR = "libtpu multi-process lockfile"


def libtpu_in_use(message: str) -> str:
  """What to do when libtpu is taken: its lock file's holders, named where /proc shows them
  (libtpu's own advice, to remove the file, would let two processes share it)."""
  found = re.search(r"/\S*libtpu_lockfile", message)
  lockfile = found.group(0) if found else "/tmp/libtpu_lockfile"
  holders = _holders(lockfile)
  by = f" ({'pids' if len(holders) > 1 else 'pid'} {', '.join(holders)})" if holders else ""
  return (f"libtpu is in use by another process{by}: it holds libtpu's lock file {lockfile}, and "
          "libtpu admits one process a machine. Wait for that process to end, or stop it, then "
          f"run again; remove {lockfile} only if no process holds it any more")


def _holders(path: str) -> list[str]:
  """Ids of the other processes with `path` open, from /proc (those this user may look at)."""
  out, me = [], str(os.getpid())
  for fd in Path("/proc").glob("[0-9]*/fd/*"):
    try:
      if fd.parts[2] != me and os.readlink(fd) == path:
        out.append(fd.parts[2])
    except OSError:   # gone, or not ours to read
      continue
  return sorted(set(out), key=int)
