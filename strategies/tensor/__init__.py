"""Tensor parallelism by a plan, for any model (Megatron-LM, arXiv 1909.08053).

- ``communications``: Megatron's ``f`` and ``g``, and the gather/scatter pair;
- ``layers``: ``ColumnParallelLinear`` / ``RowParallelLinear`` (``nn.Linear`` and GPT-2's
  ``Conv1D`` layouts), and the rule for which part a rank holds;
- ``styles``: ``ColwiseParallel`` / ``RowwiseParallel``, torch's instances and Hugging Face's
  strings;
- ``plans``: plan matching (``*`` wildcards), default plans, ``parallelize_module``;
- ``heads``: splitting attention by whole heads, and the head counts modules keep;
- ``gather``: the whole tensors from the parts, and a part from a whole tensor;
- ``model``: ``TensorParallelModel``;
- ``random_state``: that a group's ranks draw the same random numbers (dropout).
"""

from paramshard.strategies.tensor.communications import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from paramshard.strategies.tensor.gather import (
    gather_tensor_parallel_grads,
    gather_tensor_parallel_state,
    tensor_parallel_part,
    tensor_parallel_splits,
    tensor_splits,
)
from paramshard.strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorSplit
from paramshard.strategies.tensor.model import TensorParallelModel
from paramshard.strategies.tensor.plans import SHIPPED_PLANS, default_plan, parallelize_module
from paramshard.strategies.tensor.styles import HF_STYLES, ColwiseParallel, RowwiseParallel

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
