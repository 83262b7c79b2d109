"""Running decoding: the one compiled loop and what drives it.

  decoding       prefill and the `lax.while_loop` of propose -> verify -> commit/resync
  generation     the host-side Generator: batches, compiles once per shape, unpacks results
  sharding       device meshes and partition rules (tensor and data parallel)
  pipeline       from an ml_collections config to loaded models, a Generator and results
  prompts        HumanEval and JSONL prompts, chat template
  default_model  the embedded default (SmolLM2 GGUF and its DFlash drafter)
"""
