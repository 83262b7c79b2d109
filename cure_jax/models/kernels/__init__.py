"""Attention kernels per platform, chosen by `layers.attend` (TPU: a Pallas kernel that keeps
scores on chip). Each is tested against the plain XLA attention."""
