"""Custom ops: one module per op (Triton kernels, launchers, torch.library registration, <op>_ref).

Importing this package registers the ops under torch.ops.graphtrain.
"""

import graphtrain.custom_ops.linear_cross_entropy  # noqa: F401  (graphtrain::linear_cross_entropy)
from graphtrain.custom_ops import (
    moe_permute,  # noqa: F401  (graphtrain::moe_permute, moe_unpermute)
    moe_route,  # noqa: F401  (graphtrain::moe_route)
)
