"""Trains, exports or measures a DFlash block drafter (cure_jax/training/trainer.py) from a config.

  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py
  # the latest checkpoint of config.workdir as a DFlash HF directory (config.export.path):
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
      --stage=export
  # chain / cure tau of a drafter on HumanEval 0-19 (float32, greedy, chat template):
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
      --stage=measure --config.measure.drafter=cure_jax/assets/smollm2_dflash

  # the target's responses to config.generate.prompts, with features, into config.generate.out:
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
      --stage=data

Training resumes from the latest checkpoint in config.workdir; --stage=data resumes too (prompts
already in the folder's shards are skipped).
"""

from __future__ import annotations

import os

# XLA's constant folding of zero-cache prefills takes minutes per shape on CPU; skip it.
os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=constant_folding")

from absl import app, flags, logging

from cure_jax.runtime import distributed, errors
from cure_jax.training import generate, measure, trainer as drafter_training

_CONFIG = errors.config_flag("configs/train/smollm2_135m.py",
                             "ml_collections drafter training config file")
_STAGE = flags.DEFINE_enum("stage", "train", ["data", "rebuild", "train", "export", "measure"],
                           "data (the target's responses and features), rebuild (a data folder "
                           "from a responses file), train (then export when train.steps are "
                           "done), export the latest checkpoint, or measure a drafter's tau.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  config = _CONFIG.value
  if _STAGE.value == "measure":
    measure.measure(config)
    return
  if _STAGE.value == "data":
    generate.generate_data(config)
    return
  if _STAGE.value == "rebuild":
    generate.rebuild_data(config)
    return
  if _STAGE.value == "export" and not config.export.path:
    raise app.UsageError("--stage=export needs --config.export.path")
  with distributed.job(config):  # several hosts: config.mesh.distributed (experiments.launch)
    distributed.agree(distributed.config_fields(config), "configs")
    trainer = drafter_training.Trainer(config)
    if _STAGE.value == "train":
      trainer.run()
    else:
      trainer.export()


if __name__ == "__main__":
  errors.run(main)
