"""Tensors as fabric moves and reduces them: their bytes without a copy,
reduction operators, and cutting a tensor into pieces."""
from __future__ import annotations

import ctypes

import torch
from torch.distributed import ReduceOp


def _byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a writable buffer, without a
    copy and without numpy (torch does not require it); the buffer keeps the
    tensor alive."""
    if not t.is_contiguous():
        raise ValueError("fabric process group: internal error: a non-contiguous tensor to move")
    n = t.numel() * t.element_size()
    if n == 0:
        return bytearray()
    view = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    view._tensor = t
    return view


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _op_of(opts):
    """The reduce op of c10d options, as ReduceOp.RedOpType (ReduceOp.SUM ...):
    a ReduceOp object compares equal to them only from its own side."""
    op = opts.reduceOp if opts is not None else ReduceOp.SUM
    return getattr(op, "op", op)


def _reduce_into(dst: torch.Tensor, src: torch.Tensor, op) -> None:
    """dst = dst (op) src, in place, with torch's kernels."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if dst.dtype == torch.bool:
            dst.logical_or_(src)
        else:
            dst.add_(src)
    elif op == ReduceOp.PRODUCT:
        if dst.dtype == torch.bool:
            dst.logical_and_(src)
        else:
            dst.mul_(src)
    elif op == ReduceOp.MIN:
        torch.minimum(dst, src, out=dst)
    elif op == ReduceOp.MAX:
        torch.maximum(dst, src, out=dst)
    elif op == ReduceOp.BAND:
        dst.bitwise_and_(src)
    elif op == ReduceOp.BOR:
        dst.bitwise_or_(src)
    elif op == ReduceOp.BXOR:
        dst.bitwise_xor_(src)
    else:
        raise ValueError(f"fabric process group: reduce op {op} is not supported")


def _check_op(op, dtype) -> None:
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"fabric process group: {op} needs an integer or bool tensor, not {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise ValueError(f"fabric process group: {op} is undefined for complex tensors ({dtype})")
    if op == ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"fabric process group: AVG needs a floating point tensor, not {dtype}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                  ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raise ValueError(f"fabric process group: reduce op {op} is not supported")


def _finish_avg(t: torch.Tensor, op, n: int) -> None:
    if op == ReduceOp.AVG:
        t.div_(n)


def _split_points(numel: int, parts: int) -> list[int]:
    """Element offsets cutting numel into `parts` near-equal pieces."""
    base, extra = divmod(numel, parts)
    points = [0]
    for i in range(parts):
        points.append(points[-1] + base + (1 if i < extra else 0))
    return points

