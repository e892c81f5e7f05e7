"""Custom ops: one module or package per op (options, <op>_ref, Triton kernels, launchers,
torch.library registration).

Importing this package registers the ops under torch.ops.graphtrain.
"""

import graphtrain.custom_ops.linear_cross_entropy  # noqa: F401  (graphtrain::linear_cross_entropy)
from graphtrain.custom_ops import (
    adamw_step,  # noqa: F401  (graphtrain::adamw_step)
    fp8_amax,  # noqa: F401  (graphtrain::fp8_amax)
    fp8_cast,  # noqa: F401  (graphtrain::fp8_cast)
    fp8_grouped_mm,  # noqa: F401  (graphtrain::fp8_grouped_mm, fp8_grouped_mm_backward)
    fp8_linear,  # noqa: F401  (graphtrain::fp8_linear, fp8_linear_backward)
    gated_delta_rule,  # noqa: F401  (graphtrain::chunk_gated_delta_rule, its backward)
    moe_permute,  # noqa: F401  (graphtrain::moe_permute, moe_unpermute)
    moe_route,  # noqa: F401  (graphtrain::moe_route)
    moe_swiglu,  # noqa: F401  (graphtrain::moe_weighted_swiglu, its backward)
    unit_lower_inverse,  # noqa: F401  (graphtrain::unit_lower_inverse)
)
