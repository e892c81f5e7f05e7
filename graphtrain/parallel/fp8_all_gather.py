"""FSDP2 all-gather of linear weights in FP8 (fp8.fsdp_all_gather_fp8): half the bytes of bf16.

What
    apply_fp8_all_gather(model, fp8, dp) makes the weight of every nn.Linear that the [fp8]
    filters would run in FP8 an `Fp8ShardWeight`: a tensor subclass around the weight (the
    optimizer, the state dict and init see and change the wrapped tensor) whose FSDP2
    all-gather hooks (fsdp_pre_all_gather / fsdp_post_all_gather) gather E4M3 bytes, cast with
    the amax of the whole weight (max-reduced over the dp shard group), and hand the compiled
    block an `Fp8Weight` (the bytes and the scale). graphtrain::fp8_linear given an Fp8Weight
    takes its bytes and scale instead of casting the weight; any other use of it (a linear the
    pass refused) gets the dequantized weight.

Numerics
    The max of the shards' amaxes is the weight's amax exactly and the cast is elementwise:
    loss and gradients are bitwise those of the option off (tests/parallel/test_overlap_tp_comm.py,
    dp_shard=2). Checkpoints hold the plain high-precision tensors (Fp8ShardWeight pickles as
    the tensor it wraps), so they load with the option on or off.

Limits (a clear error, before any large allocation)
    without tensor parallelism and only with FSDP (dp_shard > 1); weights not evenly divisible
    by the dp size are left in high precision (FSDP2 pads those shards).
The hooks in full, why and the predicted saving: docs/design/fp8.md.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from graphtrain.config import Fp8Config
from graphtrain.custom_ops import fp8_linear  # noqa: F401  (registers the ops)

E4M3 = torch.float8_e4m3fn
aten = torch.ops.aten
# FSDP2 shards, pads and moves the wrapped weight with these: the result stays wrapped.
_KEEP_WRAPPED = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten.split.Tensor,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}
# Views of the gathered FP8 weight (FSDP2 makes the parameter with as_strided).
_FP8_VIEWS = {aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default}


def _wrapper(cls: type, like: torch.Tensor, dtype: torch.dtype) -> Any:
    return torch.Tensor._make_wrapper_subclass(
        cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(),
        dtype=dtype, device=like.device, requires_grad=like.requires_grad,
    )  # fmt: skip


class Fp8ShardWeight(torch.Tensor):
    """A weight FSDP2 gathers in FP8; everything else sees the wrapped tensor."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, pow2_scale: bool) -> Fp8ShardWeight:
        return _wrapper(cls, tensor, tensor.dtype)

    def __init__(self, tensor: torch.Tensor, pow2_scale: bool) -> None:
        self._tensor, self._pow2_scale = tensor, pow2_scale

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._tensor!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved (DCP, torch.save) as the plain tensor: checkpoints do not depend on the option.
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self._pow2_scale

    @staticmethod
    def __tensor_unflatten__(inner: dict, pow2_scale: bool, size: Any, stride: Any) -> Any:
        return Fp8ShardWeight(inner["_tensor"], pow2_scale)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        pow2 = next(a._pow2_scale for a in args if isinstance(a, Fp8ShardWeight))
        args, kwargs = tree_map_only(Fp8ShardWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return tree_map_only(torch.Tensor, lambda t: Fp8ShardWeight(t, pow2), out)

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
        shard = self._tensor.reshape(-1, self._tensor.shape[-1])
        amax = torch.ops.graphtrain.fp8_amax(shard)
        dist.all_reduce(amax, dist.ReduceOp.MAX, group=mesh.get_group())
        w8, _, scale_inv, _ = torch.ops.graphtrain.fp8_cast(
            shard, amax, E4M3, self._pow2_scale, False, record="weight"
        )
        return (w8.view(torch.uint8),), (scale_inv,)

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: tuple[torch.Tensor],
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> Any:
        (data,), (scale_inv,) = outputs, metadata
        if out is not None:  # later gathers write into the same storage: only the scale is new
            out._scale_inv.copy_(scale_inv)
            return None
        return Fp8Weight(data.view(E4M3), scale_inv, param_dtype), (data,)


class Fp8Weight(torch.Tensor):
    """A gathered weight in FP8 (data, 1 / scale) with the outer dtype of the compute."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> Fp8Weight:
        return _wrapper(cls, data, dtype)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale_inv = data, scale_inv

    def __repr__(self) -> str:
        return f"Fp8Weight({tuple(self.shape)}, {self.dtype}, scale_inv={self._scale_inv!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype: torch.dtype, size: Any, stride: Any) -> Any:
        return Fp8Weight(inner["_data"], inner["_scale_inv"], dtype)

    def dequantize(self) -> torch.Tensor:
        return (self._data.float() * self._scale_inv).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.graphtrain.fp8_linear.default and not isinstance(args[0], Fp8Weight):
            x, w, bias = args
            return torch.ops.graphtrain.fp8_linear_precast(
                x, None, None, w._data, w._scale_inv, bias,
                pow2_scale=bool(kwargs.get("pow2_scale")), tp_group=kwargs.get("tp_group"),
                out_dtype=kwargs.get("out_dtype") or x.dtype,
            )  # fmt: skip
        if func in _FP8_VIEWS and isinstance(args[0], Fp8Weight):
            w = args[0]
            return Fp8Weight(func(w._data, *args[1:], **kwargs), w._scale_inv, w.dtype)
        args, kwargs = tree_map_only(Fp8Weight, Fp8Weight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def fp8_gathered_linears(model: nn.Module, fp8: Fp8Config, dp: int) -> list[str]:
    """The module paths of the nn.Linears whose weights the FP8 gather applies to: those the
    [fp8] globs include and do not exclude, with in/out features multiples of fp8.multiple_of,
    at least fp8.min_dim, and out features divisible by the dp size."""
    out = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        dims = (module.in_features, module.out_features)
        if (
            any(fnmatch.fnmatchcase(path, g) for g in fp8.include)
            and not any(fnmatch.fnmatchcase(path, g) for g in fp8.exclude)
            and all(d % fp8.multiple_of == 0 and d >= fp8.min_dim for d in dims)
            and module.out_features % dp == 0
        ):
            out.append(path)
    return out


def apply_fp8_all_gather(model: nn.Module, fp8: Fp8Config, dp: int) -> list[str]:
    """Wrap the weights of fp8_gathered_linears(model, fp8, dp) as Fp8ShardWeight, in place,
    before fully_shard (which shards the wrapped tensor and keeps the wrapper). Returns the
    paths wrapped."""
    paths = fp8_gathered_linears(model, fp8, dp)
    for path in paths:
        linear = model.get_submodule(path)
        if isinstance(linear.weight, Fp8ShardWeight) or type(linear.weight) is not nn.Parameter:
            raise ValueError(
                f"fp8.fsdp_all_gather_fp8 needs plain parameters (no tensor parallelism): "
                f"{path}.weight is {type(linear.weight.data).__name__}"
            )
        weight = Fp8ShardWeight(linear.weight.data, fp8.pow2_scale)
        linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    return paths
