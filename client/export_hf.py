"""A Hugging Face model's job as a folder ``from_pretrained`` loads: ``config.json`` and
``model.safetensors``. ``export_hf`` reads live servers; ``write_hf`` is shared with offline
export of snapshot folders (``paramshard export --snapshot DIR --hf-dir OUT``).

No model code is needed: when a ``PreTrainedModel``'s job registered, the servers recorded its
class and ``config.to_dict()`` (RegisterBufferRequest.model_config), and snapshots keep it.
The folder is what transformers' ``save_pretrained`` writes:

- ``config.json``: the recorded config, with ``architectures`` the model's class and ``dtype``
  the exported parameters' (the training dtype: float64 stays float64), which
  ``from_pretrained`` loads them in;
- ``model.safetensors`` (metadata ``format: pt``, which ``from_pretrained`` requires): every
  parameter once. A tied parameter (config ``tie_word_embeddings``) is written under its first
  name only (``transformer.wte.weight``, not ``lm_head.weight``): safetensors holds no aliases,
  and ``from_pretrained`` ties the other name again. A config that does not tie gets every
  name written. Names are the model's state-dict names: the segments torch's module wrappers
  insert (``_checkpoint_wrapped_module.`` of ``checkpoint_wrapper``, ``_orig_mod.`` of
  ``torch.compile(block)``) are dropped, as those wrappers' state dicts drop them.

Buffers are not on the servers: ``from_pretrained`` initialises a persistent buffer from the
config (GPT-2 and Llama have none; Llama's rotary frequencies are not persistent).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from paramshard.client.export import one_version, whole_items, write_safetensors
from paramshard.client.jobs import LiveParam, live_model_config
from paramshard.client.shard_client import ShardClient
from paramshard.client.tensor_parts import WholeParam
from paramshard.protos.atomic import atomic_write

__all__ = ["export_hf", "write_hf"]

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _state_dict_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``, whole or not at all (temporary file, fsync, rename)."""
    with atomic_write(path, "w") as f:
        f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_hf(
    out_dir: str | os.PathLike,
    model_config: Mapping[str, Any],
    params: Iterable[WholeParam],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Writes ``config.json`` and ``model.safetensors`` of the model ``model_config``
    describes ({"architecture", "config"}, as recorded) holding ``params`` into ``out_dir``
    (created if needed); returns the number of tensors written."""
    config = dict(model_config["config"])
    tied = config.get("tie_word_embeddings", True)  # transformers' default
    items = [
        (_state_dict_name(name), dtype, shape, produce)
        for name, dtype, shape, produce in whole_items(params, aliases=not tied)
    ]
    config["architectures"] = [model_config["architecture"]]
    if items:  # save_pretrained records the dtype of the first parameter
        config["dtype"] = items[0][1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", items, {"format": "pt", **(metadata or {})})
    _write_json(out / "config.json", config)
    return len(items)


def export_hf(client: ShardClient, job: str, out_dir: str | os.PathLike) -> int:
    """The job of a Hugging Face ``PreTrainedModel`` from live servers into ``out_dir`` as
    ``config.json`` + ``model.safetensors``, loadable with ``from_pretrained(out_dir)``;
    returns the number of tensors. A 3D job's base name exports the whole model (its
    tensor-parallel parts joined). Every tensor is of the version the metadata records
    (``client.export.one_version``): while training runs, VersionChangedError unless an
    attempt fits between two steps; snapshot first and export the snapshot instead.
    RuntimeError for a job of another model."""

    def write(params: list[LiveParam], jobs: list[str], meta: dict[str, str]) -> int:
        described = live_model_config(client, jobs)
        if described is None:
            raise RuntimeError(
                f"job '{job}' has no model config on the servers: only a Hugging Face"
                " PreTrainedModel's job records one when it registers; export it with --out"
            )
        return write_hf(out_dir, described, params, meta)

    return one_version(client, job, write)
