"""Attention kernels per platform, chosen by `layers.attend` (TPU: Pallas/Mosaic; NVIDIA GPUs:
Pallas/Triton), each keeping the scores on chip. Each is tested against the plain XLA attention."""
