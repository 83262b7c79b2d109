"""Names of the device-mesh axes. The models name them (the TPU attention kernel runs per shard);
the runtime builds meshes with them. Nothing else lives here, so both sides can import it."""

DATA, MODEL = "data", "model"   # batch split, tensor parallelism
