"""What a rank holds of a ZeRO-3 parameter, read locally (no collective).

ZeRO-3 flattens each parameter, pads it to a multiple of the partition count and gives rank r the slice
[r·size, (r+1)·size) as ``param.ds_tensor``; ``param.data`` is empty except while gathered, or always for a
parameter below the persistence threshold (``ds_persist``), which every rank keeps whole as well."""

from __future__ import annotations

import torch


def materialized(p: torch.Tensor) -> bool:
    """The parameter's whole value is in ``p.data``: always below ZeRO-3; under it while gathered, or for a
    persistent parameter once a forward fetched it (until then its ``data`` is empty as well)."""
    return not hasattr(p, "ds_id") or p.data.numel() == p.ds_numel


def local_partition(whole: torch.Tensor, zero3_param: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``whole`` as ZeRO-3 lays ``zero3_param`` out (same shape as its ``ds_tensor``)."""
    import deepspeed.comm as ds_comm

    size = zero3_param.ds_tensor.numel()
    start = size * ds_comm.get_rank(group=zero3_param.ds_process_group)
    flat = whole.reshape(-1)[start:start + size]
    return torch.nn.functional.pad(flat, (0, size - flat.numel()))
