"""One process of a 2-process drafter-training job, for tests/test_multiprocess.py:

  python -m experiments.launch --processes=2 --devices_per_process=4 -- \\
    tests.multiprocess_train ROOT first|resume

`first`: two data-parallel steps at lr 1e-3 (losses and parameters to ROOT/dp_steps.npz), a run
stopped at step 6 (ROOT/interrupted) and a run to the end with its export (ROOT/one_go.npz,
ROOT/export). `resume`: a fresh job resumes ROOT/interrupted to the end (ROOT/resumed.npz).
Each process reads its own data folder, ROOT/data_{process}; process 0 writes the files.
"""

import io
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from configs.train import tiny
from cure_jax.runtime import distributed, pipeline
from cure_jax.training import trainer as drafter_training


def config(root: Path, name: str, **train):
  c = tiny.get_config()
  c.target.path = str(root / "pair" / "target")
  c.data.folders = (str(root / "data_{process}"),)
  c.workdir = str(root / name)
  c.mesh.distributed = True
  c.mesh.heartbeat_s = 20
  c.train.update(train)
  return c


def save(path: Path, trainer, **extra) -> None:
  """Parameters (and extra arrays) of a trainer; every process must hold the same ones."""
  params = {"/".join(map(str, p)): np.asarray(v.get_value().addressable_data(0))
            for p, v in nnx.to_flat_state(trainer.state["params"])}
  distributed.agree({k: v.tobytes().hex() for k, v in params.items()}, "parameters")
  if distributed.is_writer():
    buf = io.BytesIO()
    np.savez(buf, **params, **extra)
    pipeline.write_atomic(path, buf.getvalue())


def main(root: Path, mode: str) -> None:
  with distributed.job(config(root, "job")):
    if mode == "first":
      dp = drafter_training.Trainer(config(root, "dp", lr=1e-3))
      losses = [dp.take_step()["loss"] for _ in range(2)]
      save(root / "dp_steps.npz", dp, __losses=np.asarray(losses))
      drafter_training.Trainer(config(root, "interrupted")).run(until=6)
      with_export = config(root, "one_go")
      with_export.export.path = str(root / "export")
      one_go = drafter_training.Trainer(with_export)
      one_go.run()
      save(root / "one_go.npz", one_go)
    else:
      resumed = drafter_training.Trainer(config(root, "interrupted"))
      assert resumed.step == 6, resumed.step
      resumed.run()
      save(root / "resumed.npz", resumed)
    print(f"process {jax.process_index()} of {jax.process_count()}: {mode} done", flush=True)


if __name__ == "__main__":
  main(Path(sys.argv[1]), sys.argv[2])
