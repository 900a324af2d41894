"""The running device's target: its architecture read off the GPU, and the descriptor that fits it."""
from __future__ import annotations

from flashgen.lazy import lazy
from flashgen.targets.descriptor import Target, get_target, target_for_device

torch = lazy("torch")


def device_arch(device: "torch.device") -> str:
    """The running GPU's architecture in target spelling ("sm_90", "gfx942")."""
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "")
    if getattr(torch.version, "hip", None) and arch:
        return arch.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def device_target(device: "torch.device | str | None" = None) -> Target:
    """The target of `device`: a GPU's descriptor (by its name, else its architecture), the cpu target
    for a CPU device. None: the current GPU where one is available, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return target_for_device(torch.cuda.get_device_name(device), device_arch(device))
    return get_target("cpu")
