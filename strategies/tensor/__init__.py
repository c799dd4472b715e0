"""Tensor parallelism by a plan, for any model (Megatron-LM, arXiv 1909.08053).

- ``communications``: Megatron's ``f`` and ``g``, and the gather/scatter pair;
- ``layers``: ``ColumnParallelLinear`` / ``RowParallelLinear`` (``nn.Linear`` and GPT-2's
  ``Conv1D`` layouts), and the rule for which part a rank holds;
- ``styles``: ``ColwiseParallel`` / ``RowwiseParallel``, torch's instances and Hugging Face's
  strings;
- ``plans``: plan matching (``*`` wildcards), default plans, ``parallelize_module``;
- ``heads``: splitting attention by whole heads, and the head counts modules keep;
- ``gather``: the whole tensors from the parts, and a part from a whole tensor;
- ``model``: ``TensorParallelModel``.
"""

from strategies.tensor.communications import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from strategies.tensor.gather import (
    gather_tensor_parallel_grads,
    gather_tensor_parallel_state,
    tensor_parallel_part,
    tensor_parallel_splits,
    tensor_splits,
)
from strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorSplit
from strategies.tensor.model import TensorParallelModel
from strategies.tensor.plans import SHIPPED_PLANS, default_plan, parallelize_module
from strategies.tensor.styles import HF_STYLES, ColwiseParallel, RowwiseParallel

__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "parallelize_module",
    "default_plan",
    "tensor_parallel_splits",
    "gather_tensor_parallel_state",
    "gather_tensor_parallel_grads",
    "tensor_parallel_part",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelModel",
    "TensorSplit",
    "tensor_splits",
    "SHIPPED_PLANS",
    "HF_STYLES",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel",
]
