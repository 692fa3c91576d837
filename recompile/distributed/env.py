"""Process-group setup: the collective backend follows the device type, never a hard-coded name."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# torch.distributed backend for each device type: gloo on CPU, nccl on CUDA, hccl on Ascend (torch_npu).
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEFAULT_TIMEOUT_S = 60.0


def backend_for(device: torch.device | str) -> str:
    # "npu" is a device type only once torch_npu is imported: take the string's type as is.
    device_type = device.split(":")[0] if isinstance(device, str) else device.type
    if device_type not in BACKEND_FOR_DEVICE:
        raise ValueError(f"recompile.distributed: no collective backend for device type {device_type!r}; "
                         f"known: {sorted(BACKEND_FOR_DEVICE)}")
    return BACKEND_FOR_DEVICE[device_type]


def default_device() -> torch.device:
    """This rank's device: its accelerator (LOCAL_RANK-th) when present, else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    for device_type in ("npu", "cuda"):
        module = getattr(torch, device_type, None)
        if module is not None and module.is_available():
            return torch.device(device_type, local_rank % module.device_count())
    return torch.device("cpu")


def init_distributed(device: torch.device | str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     **init_kwargs) -> torch.device:
    """Initialise the default process group from the launcher's environment (torchrun sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); returns this rank's device. A collective waiting longer than ``timeout_s`` on
    a peer fails instead of hanging."""
    device = torch.device(device) if device is not None else default_device()
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs)
    return device


def world() -> tuple[int, int]:
    """(rank, world_size); (0, 1) without a process group, so the same code runs in one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
