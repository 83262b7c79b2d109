"""auto: ddtree under the goodput controller, which picks each iteration's node budget for the
whole batch, down to a plain target step, from the device's cost curve and each sequence's
calibrated draft confidence (cure_jax/tree/controller.py). The fastest lossless decoding a
device can do for a pair and batch, without the user choosing a budget."""

from cure_jax.methods.ddtree import DDTree


class Auto(DDTree):
  name = "auto"
  controlled = True
