"""One process of a 2-process job that loses a peer, for tests/test_multiprocess.py:

  python -m experiments.launch --processes=2 --devices_per_process=2 -- \\
    tests.multiprocess_fault kill|raise

Both processes run a sharded computation in a loop; after three rounds process 1 kills itself
(SIGKILL: no goodbye) or raises. Process 0 must then exit on its own, naming process 1.
"""

import os
import signal
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from cure_jax.runtime import distributed


def main(mode: str) -> None:
  config = {"mesh": {"distributed": True, "timeout_s": 60, "heartbeat_s": 5}}
  with distributed.job(config):
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.make_array_from_callback((8, 8), NamedSharding(mesh, P("data", "model")),
                                     lambda i: np.arange(64.0).reshape(8, 8)[i])
    total = jax.jit(lambda a: (a @ a.T).sum())
    for round_ in range(1000):
      assert float(total(x)) == 510720.0
      if round_ == 3 and jax.process_index() == 1:
        if mode == "kill":
          os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("process 1 gives up")


if __name__ == "__main__":
  main(sys.argv[1])
