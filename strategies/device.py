"""Where the strategies' tensors cross to and from the servers: the one place that converts.

The client speaks NumPy (it must not depend on torch), and NumPy lives in host memory. On the
CPU a tensor's NumPy view costs nothing. A CUDA tensor is cast on its device, copied into
pinned host memory with ``non_blocking=True`` and synchronised once per transfer (a bucket, a
buffer), the way torch's own gloo path stages device tensors. Values pulled from the servers
land in pinned host memory (``Landing``) and go to the parameter's device with one
non-blocking copy; torch's caching host allocator keeps that memory until the copy is done.

Collectives on torch tensors (DDP buckets, tensor-parallel all-reduces, pipeline messages)
go through the client's own tensor adapter (client/tensors.py), which copies to the host and
returns results on the tensor's device.

Not done: with an in-process CuPy server on the trainer's own device, the local slice could
skip the host entirely through DLPack; today it is staged through pinned memory like the rest
(no GPU here to test a device-to-device path on).
"""

from __future__ import annotations

import numpy as np
import torch

from protos import codec
from strategies.layout import torch_dtype

__all__ = ["to_host", "Landing", "device_of"]


def device_of(tensors: list[torch.Tensor]) -> torch.device:
    """The device of ``tensors`` (the CPU for none); they must agree."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"the parameters of one buffer are on several devices {sorted(map(str, devices))};"
            " move the model to one device (model.to(device)) before wrapping it"
        )
    return devices.pop() if devices else torch.device("cpu")


def to_host(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """``t`` flattened and cast to ``dtype`` (float32 or float64) as a host NumPy array.

    A view of ``t`` when it is already a contiguous CPU tensor of ``dtype``. A CUDA tensor is
    cast on its device and copied into pinned memory: one synchronisation per call.
    """
    flat = t.detach().reshape(-1).to(dtype)
    if flat.device.type == "cpu":
        return flat.numpy()
    staged = torch.empty(flat.numel(), dtype=dtype, pin_memory=True)
    staged.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return staged.numpy()


class Landing:
    """Host memory that ``numel`` pulled elements in ``wire`` dtype land in (pinned when they go
    on to a CUDA device); ``array`` is what the client fills (bfloat16 as uint16 bits)."""

    def __init__(self, numel: int, wire: str, device: torch.device) -> None:
        self.device = torch.device(device)
        self.tensor = torch.empty(
            numel, dtype=torch_dtype(wire), pin_memory=self.device.type == "cuda"
        )
        raw = self.tensor.view(torch.int16) if wire == "bfloat16" else self.tensor
        self.array = raw.numpy().view(codec.numpy_dtype(codec.wire_dtype(wire)))

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The landed values as a ``dtype`` tensor on the device (a view on the CPU when
        nothing needs converting)."""
        return self.tensor.to(device=self.device, dtype=dtype, non_blocking=True)
