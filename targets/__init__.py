"""Targets: descriptors of GPUs and the CPU, and the backends that emit and build code for them."""
from flashgen.targets.descriptor import Target, get_target, load_targets, target_for_device
from flashgen.targets.device import device_target

__all__ = ["Target", "device_target", "get_target", "load_targets", "target_for_device"]
