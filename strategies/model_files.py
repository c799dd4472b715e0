"""A wrapped model as one file or stream: AiDotNet's Serialize/Deserialize, SaveModel/LoadModel
and SaveState/LoadState, over the full state dict as safetensors bytes (with the strategy's
metadata). ``ShardedModelBase`` supplies ``state_dict``, ``load_state_dict`` and
``get_model_metadata``.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from paramshard.protos.atomic import read_bytes, write_bytes

__all__ = ["ModelFiles"]

_FORMAT = "paramshard-model/1"


class ModelFiles:
    """Serialisation of a wrapped model; its state comes from ``state_dict``."""

    state_dict: Any
    load_state_dict: Any
    get_model_metadata: Any

    def serialize(self) -> bytes:
        """The full model (safetensors bytes with the strategy's metadata)."""
        meta = {"format": _FORMAT, "metadata": json.dumps(self.get_model_metadata())}
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        shared: dict[int, str] = {}
        for k, v in list(state.items()):  # safetensors refuses shared storage
            if v.data_ptr() in shared:
                state[k] = v.clone()
            shared[state[k].data_ptr()] = k
        return st_save(state, metadata=meta)

    def deserialize(self, data: bytes) -> None:
        try:
            state = st_load(bytes(data))
        except Exception as exc:
            raise ValueError(f"deserialize: not a paramshard model ({exc})") from None
        self.load_state_dict(state)

    def save_model(self, path: str | os.PathLike) -> None:
        """Writes ``serialize()`` to ``path`` atomically (temporary file, fsync, rename)."""
        write_bytes(path, self.serialize())

    def load_model(self, path: str | os.PathLike) -> None:
        data = read_bytes(path, "load_model", "model")
        try:
            self.deserialize(data)
        except ValueError as exc:
            raise ValueError(
                f"load_model: {os.fspath(path)!r} is corrupt or not a model: {exc}"
            ) from None

    def save_state(self, stream: io.RawIOBase | Any) -> None:
        stream.write(self.serialize())

    def load_state(self, stream: io.RawIOBase | Any) -> None:
        self.deserialize(stream.read())
