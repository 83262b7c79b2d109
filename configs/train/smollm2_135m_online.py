"""The embedded SmolLM2-135M-Instruct drafter's recipe with online features: no feature store.

Trains from the committed responses file alone (5,363 of the target's greedy answers, 4 bytes a
token): each step runs the frozen target over its 4 sequences, through hidden_states[28], in
128-token chunks, and the drafter on the features it returns. The held-out split is 10
sequences by prompt uid, never trained on (workdir/eval_uids.json lists them).

  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m_online.py
"""

from configs.train import smollm2_135m


def get_config():
  config = smollm2_135m.get_config()
  config.data.features = "online"
  config.data.folders = ()
  config.data.responses = ("data/drafter_responses/smollm2_v2.npz",)
  config.train.target_chunk = 128
  config.train.steps = 300
  config.train.warmup = 20
  config.eval.every = 100
  config.checkpoint.every = 50
  config.workdir = "runs/drafter_train_online"
  config.export.path = "runs/smollm2_dflash_online"
  return config
