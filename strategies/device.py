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

A shard server in the trainer's own process whose arrays live on the trainer's device (a CuPy
server on the same GPU; on a CPU host, a NumPy server) takes its slice of a gradient push, and
gives its slice of a pull, device to device through DLPack (``Outgoing``, ``Landing.put``):
no pinned staging, no bytes. The pieces for other servers cross the host as above. The client
decides per server (``RpcCore.local_device``); ``set_params`` (loading, not per step) and the
collectives on torch tensors always cross the host.

Ranks that are threads of one process (``LocalCluster``) cannot share a CUDA device when a rank
waits for the others inside backward: torch's autograd engine runs the backward of CUDA tensors
on one worker thread per device, shared by every thread of the process, so a rank waiting there
for another rank's contribution holds the thread the other rank's backward needs, and both wait
until their deadline. ``claim_backward_device`` refuses that at once, with what to do instead.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from paramshard.protos import codec
from paramshard.strategies.layout import torch_dtype

__all__ = [
    "to_host",
    "Outgoing",
    "Landing",
    "device_of",
    "device_name",
    "claim_backward_device",
    "backward_claims",
]

# (the group's run id, "cuda:N") -> rank -> the thread that claimed it (claim_backward_device)
_BACKWARD_CLAIMS: dict[tuple[str, str], dict[int, threading.Thread]] = {}
_CLAIMS_LOCK = threading.Lock()


def device_name(device: torch.device) -> str:
    """How the servers name ``device``: "cpu" or "cuda:N" (protos/local_servers.py)."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def claim_backward_device(device: torch.device, client: Any, what: str) -> None:
    """Called from a rank's own thread before a backward in which it will wait for the other
    ranks of ``client``'s group (``what``: DDP's end-of-backward all-reduce, tensor
    parallelism's all-reduce); raises ``ValueError`` when another rank of that group trains
    on the same CUDA device from another live thread of this process (see the module's
    docstring). Nothing to check on the CPU, where each thread runs its own backward."""
    if device.type != "cuda" or client.world_size <= 1:
        return
    key = (str(client.run_id), device_name(device))
    me = threading.current_thread()
    with _CLAIMS_LOCK:
        _drop_ended()
        claims = _BACKWARD_CLAIMS.setdefault(key, {})
        others = sorted(r for r, t in claims.items() if r != client.rank and t is not me)
        if not others:
            claims[client.rank] = me
            return
    raise ValueError(
        f"rank {client.rank} and rank {others[0]} of group {client.run_id!r} both train on"
        f" {key[1]} from threads of one process, and {what} waits inside backward: torch runs"
        " the backward of CUDA tensors on one autograd thread per device, shared by the"
        " process's threads, so one rank's wait would hold the thread the other rank's"
        " backward needs. Run the ranks as processes (LocalCluster(processes=True) or"
        " `paramshard launch`) or give each rank a GPU of its own (cuda:<rank>)"
    )


def _drop_ended() -> None:
    """Forgets the claims of threads that have ended, and the groups left with none (a
    process that trains group after group keeps only its live ones). Under _CLAIMS_LOCK."""
    for key, claims in list(_BACKWARD_CLAIMS.items()):
        for rank, thread in list(claims.items()):
            if not thread.is_alive():
                del claims[rank]
        if not claims:
            del _BACKWARD_CLAIMS[key]


def backward_claims() -> dict[tuple[str, str], list[int]]:
    """The live claims of this process: (group's run id, "cuda:N") -> the ranks whose threads
    train there (``claim_backward_device``), for diagnostics."""
    with _CLAIMS_LOCK:
        _drop_ended()
        return {key: sorted(claims) for key, claims in _BACKWARD_CLAIMS.items()}


def _wire_tensor(t: torch.Tensor, wire: str) -> torch.Tensor:
    """``t`` in wire dtype ``wire`` on its device, bfloat16 as its bits (int16), contiguous."""
    out = t.to(torch_dtype(wire))
    return (out.view(torch.int16) if wire == "bfloat16" else out).contiguous()


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


class Outgoing:
    """A flat tensor on its device on the way to the servers (a gradient push): each server's
    piece leaves in its wire dtype, through DLPack to a server of this process on the same
    device (``dlpack``), else from host memory (``host``, staged once as ``to_host`` does)."""

    def __init__(self, t: torch.Tensor, dtype: torch.dtype) -> None:
        self.flat = t.detach().reshape(-1).to(dtype)
        self.size = self.flat.numel()
        self.dlpack_device = device_name(self.flat.device)
        self._host: np.ndarray | None = None

    def host(self) -> np.ndarray:
        """The values as a host array (staged on the first call)."""
        if self._host is None:
            self._host = to_host(self.flat, self.flat.dtype)
        return self._host

    def dlpack(self, start: int, n: int, wire: str) -> torch.Tensor:
        """Elements [start, start + n) in wire dtype ``wire`` on the device, for DLPack."""
        return _wire_tensor(self.flat[start : start + n], wire)


class Landing:
    """Host memory that ``numel`` pulled elements in ``wire`` dtype land in (pinned when they go
    on to a CUDA device); ``array`` is what the client fills (bfloat16 as uint16 bits).
    ``into``: a contiguous CPU tensor of that dtype and size to land in, instead of new memory
    (ZeRO's replica: parameters that are views of one flat tensor are pulled in place)."""

    def __init__(
        self, numel: int, wire: str, device: torch.device, into: torch.Tensor | None = None
    ) -> None:
        self.device = torch.device(device)
        self.dlpack_device = device_name(self.device)
        self._direct: list[tuple[int, torch.Tensor]] = []
        if into is not None:
            if into.device.type != "cpu" or self.device.type != "cpu":
                raise ValueError("Landing(into=...) lands on the CPU only")
            if into.dtype != torch_dtype(wire) or into.numel() != numel or not into.is_contiguous():
                raise ValueError(
                    f"Landing(into=...) needs a contiguous {wire} tensor of {numel} elements,"
                    f" got {into.dtype} with {into.numel()}"
                )
            self.tensor = into
        else:
            self.tensor = torch.empty(
                numel, dtype=torch_dtype(wire), pin_memory=self.device.type == "cuda"
            )
        raw = self.tensor.view(torch.int16) if wire == "bfloat16" else self.tensor
        self.array = raw.numpy().view(codec.numpy_dtype(codec.wire_dtype(wire)))

    def put(self, start: int, values: Any) -> None:
        """Elements from ``start`` handed over on the device (DLPack, a server of this
        process): they skip the host; ``result`` puts them in place."""
        piece = torch.from_dlpack(values)
        if self.tensor.dtype == torch.bfloat16:  # its bits, as uint16
            piece = piece.view(torch.bfloat16)
        self._direct.append((start, piece))

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The landed values as a ``dtype`` tensor on the device (a view on the CPU when
        nothing needs converting)."""
        out = self.tensor.to(device=self.device, dtype=dtype, non_blocking=True)
        for start, piece in self._direct:
            out[start : start + piece.numel()] = piece
        return out
