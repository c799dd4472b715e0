"""Parallel styles: how a plan says to split one module, in torch's vocabulary.

``ColwiseParallel`` and ``RowwiseParallel`` mean what they mean in
``torch.distributed.tensor.parallel`` (Megatron's column- and row-parallel linear layers,
arXiv 1909.08053, §3). A plan may also name a style as torch's own instance (default layouts,
and Colwise with a replicated output, which is ``gather_output``) or as one of Hugging Face's
strings (``config.base_model_tp_plan``); ``resolve_style`` turns any of them into ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ColwiseParallel", "RowwiseParallel", "Replicated", "resolve_style", "HF_STYLES"]


@dataclass(frozen=True)
class ColwiseParallel:
    """Split the output features (``ColumnParallelLinear``): the input is replicated, the
    output is this rank's part of the features."""

    packed: int = 1
    """Equal blocks side by side in the output features (3 for q|k|v in one weight, as GPT-2's
    ``c_attn``): each rank takes its part of every block."""
    gather_output: bool = False
    """All-gather the output so every rank gets all the features (Hugging Face's
    ``"colwise_gather_output"``, for an ``lm_head``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.packed, int) or self.packed < 1:
            raise ValueError(f"ColwiseParallel.packed must be an int >= 1, got {self.packed!r}")


@dataclass(frozen=True)
class RowwiseParallel:
    """Split the input features (``RowParallelLinear``): partial sums are all-reduced
    (Megatron's ``g``) and the bias is added once."""

    input_is_parallel: bool = True
    """The input is this rank's part of the features (the output of a Colwise layer); False:
    the whole input, which each rank then cuts (Hugging Face's ``"rowwise_split_input"``)."""


@dataclass(frozen=True)
class Replicated:
    """Leave the module whole on every rank (Hugging Face's ``"replicate"``)."""


HF_STYLES: dict[str, Any] = {
    "colwise": ColwiseParallel(),
    "colwise_gather_output": ColwiseParallel(gather_output=True),
    "colwise_rep": ColwiseParallel(gather_output=True),
    "rowwise": RowwiseParallel(),
    "rowwise_split_input": RowwiseParallel(input_is_parallel=False),
    "rowwise_rep": RowwiseParallel(input_is_parallel=False),
    "replicate": Replicated(),
}
"""Hugging Face's style strings this project implements, and what each is here."""

Style = ColwiseParallel | RowwiseParallel | Replicated


def _layouts(style: Any) -> tuple[str, str]:
    """(input, output) layouts of a torch style instance, as 'replicate' / 'shard(-1)'."""

    def one(attr: str) -> str:
        value = getattr(style, attr)
        value = value[0] if isinstance(value, tuple) and len(value) == 1 else value
        text = type(value).__name__.lower()
        if text == "shard":
            return "shard(-1)" if value.dim == -1 else f"shard({value.dim})"
        return text

    return one("input_layouts"), one("output_layouts")


def _from_torch(style: Any, key: str) -> Style:
    """Ours for torch's ``ColwiseParallel()`` / ``RowwiseParallel()`` (default layouts)."""
    kind = type(style).__name__
    layouts = _layouts(style)
    if not getattr(style, "use_local_output", True):
        raise ValueError(
            f"plan entry '{key}': torch's {kind}(use_local_output=False) returns DTensors;"
            " only use_local_output=True is supported here"
        )
    if kind == "ColwiseParallel":
        if layouts == ("replicate", "shard(-1)"):
            return ColwiseParallel()
        if layouts == ("replicate", "replicate"):
            return ColwiseParallel(gather_output=True)
    elif kind == "RowwiseParallel" and layouts == ("shard(-1)", "replicate"):
        return RowwiseParallel()
    elif kind == "RowwiseParallel" and layouts == ("replicate", "replicate"):
        return RowwiseParallel(input_is_parallel=False)
    raise ValueError(
        f"plan entry '{key}': torch's {kind} with input_layouts={layouts[0]},"
        f" output_layouts={layouts[1]} is not supported; supported: ColwiseParallel() (input"
        " replicate, output shard(-1), or replicate = gather_output), RowwiseParallel() (input"
        " shard(-1) or replicate, output replicate)"
    )


def resolve_style(style: Any, key: str = "?") -> Style:
    """Our style for a plan value: ours, torch's instance, or a Hugging Face string. ``key``
    (the plan entry) is named in errors."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel, Replicated)):
        return style
    if isinstance(style, str):
        try:
            return HF_STYLES[style]
        except KeyError:
            raise ValueError(
                f"plan entry '{key}': unknown tensor-parallel style '{style}'; known:"
                f" {', '.join(sorted(HF_STYLES))}, or ColwiseParallel() / RowwiseParallel()"
            ) from None
    if type(style).__module__.startswith("torch.distributed.tensor.parallel") and type(
        style
    ).__name__ in ("ColwiseParallel", "RowwiseParallel"):
        return _from_torch(style, key)
    raise ValueError(
        f"plan entry '{key}': {type(style).__name__} is not a tensor-parallel style; use"
        " ColwiseParallel(), RowwiseParallel(), torch's instances of them, or one of"
        f" {', '.join(sorted(HF_STYLES))}"
    )
