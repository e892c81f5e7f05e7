"""graphtrain::linear_cross_entropy: the output head and the cross-entropy loss as one op.

What
    linear_cross_entropy(hidden [N, H], weight [V, H], target [N] int64, *, ignore_index=-100,
    label_smoothing=0.0, z_loss=0.0, reduction="mean", mode="low_memory",
    fp32_accumulator=True, token_chunk=0) -> loss, the value of
    F.cross_entropy(F.linear(hidden, weight).float(), target, ...) plus z_loss * lse**2 per
    token, reduced like the loss, without ever holding the [N, V] logits; both gradients are
    computed in the forward. _vocab_parallel: weight is the local vocab shard of a tp group.
    _with_stats: also [top-1 hits, invalid targets] (int64 [2], on the device).
    The pass that inserts it: graphtrain/passes/linear_cross_entropy.py. Why, the two CUDA
    algorithms, their costs and the package's files: docs/design/linear_cross_entropy.md.

Contract
    "mean" divides by the non-ignored tokens (clamped to >= 1: all ignored gives 0, not NaN);
    "none" gives 0 where ignored. A target outside [0, V) that is not ignore_index makes the
    loss NaN (gradients stay finite). fp32 weight with 16-bit hidden (master weights) computes
    the logits in hidden's dtype and returns an fp32 grad_weight. No host synchronisation.

Numerics
    Logits rounded to the input dtype as F.linear(...).float() does; everything after in fp32
    (fp64 for fp64 inputs). Fast mode with a 16-bit weight and fp32_accumulator=False rounds
    grad_weight once per token chunk (at most four).
"""

# What other modules and the tests import from here: the public ops and options, the
# references, the mode policy's byte count, and the kernel entry points the tests drive.
from graphtrain.custom_ops.linear_cross_entropy.cuda import _launch_dh, _lce_triton
from graphtrain.custom_ops.linear_cross_entropy.kernels import _lce_scale_kernel
from graphtrain.custom_ops.linear_cross_entropy.maths import _reduce, _row_scale
from graphtrain.custom_ops.linear_cross_entropy.options import (
    FAST_BUFFER_BYTES,
    MODES,
    REDUCTIONS,
    SWEEP_A_BUFFER_BYTES,
    LCEOptions,
    fast_mode_extra_bytes,
    unfused_extra_bytes,
)
from graphtrain.custom_ops.linear_cross_entropy.reference import (
    linear_cross_entropy_backward_ref,
    linear_cross_entropy_ref,
)
from graphtrain.custom_ops.linear_cross_entropy.registration import (
    linear_cross_entropy,
    linear_cross_entropy_backward,
    linear_cross_entropy_forward,
)
from graphtrain.custom_ops.utils import interpreting as _interpreting

__all__ = [
    "FAST_BUFFER_BYTES",
    "MODES",
    "REDUCTIONS",
    "SWEEP_A_BUFFER_BYTES",
    "LCEOptions",
    "_interpreting",
    "_launch_dh",
    "_lce_scale_kernel",
    "_lce_triton",
    "_reduce",
    "_row_scale",
    "fast_mode_extra_bytes",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    "linear_cross_entropy_backward_ref",
    "linear_cross_entropy_forward",
    "linear_cross_entropy_ref",
    "unfused_extra_bytes",
]
