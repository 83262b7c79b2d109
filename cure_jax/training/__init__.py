"""Training a DFlash drafter for a target from the target's own responses and features.

  data       generates the target's responses and stores their features as shards
  batches    the training / held-out split, anchors, labels and batch arrays of those shards
  objective  the training forward pass, the loss and the jitted train and eval steps
  export     the drafter as a DFlash HF directory, written atomically
  trainer    the run: config checks, the drafter's start from the target, the optax loop,
             evaluation and orbax checkpoints
  generate   the data stage of a training config (stored features, or tokens only)
  measure    a trained drafter's τ with our decoder
  drafter_prompts  training prompts from packages, never from an evaluation set
  ar_drafter       a small AR drafter distilled for the ar_draft baseline
"""
