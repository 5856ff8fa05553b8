"""How much memory a call's chunks may hold by default: :func:`default_workspace_mib`.

The workspace of a chunked call is the memory its chunks' logits and staged logit gradients take
(``engine.row_layout``). By default it grows with the device: on CUDA the largest of
:data:`WORKSPACE_STEPS_MIB` that is at most 1/:data:`FREE_MEMORY_SHARE` of the memory free there
(so 2 GiB on an 80–141 GB card with a few tens of GB free), taken in steps so that the layout
stays the same from call to call while free memory moves a little (a new layout changes the
rounding of the head's gradient; results are bitwise reproducible for a given layout).
``KernelConfig(workspace_mib=...)`` replaces it. Under a tensor-parallel group every rank walks
the smallest rank's workspace (agreed in the handshake, ``parallel.layout``).
"""

from __future__ import annotations

import torch

__all__ = [
    "FREE_MEMORY_SHARE",
    "HOST_WORKSPACE_MIB",
    "WORKSPACE_STEPS_MIB",
    "default_workspace_mib",
]

#: The default workspaces on a CUDA device, largest first; the last one also where less is free.
WORKSPACE_STEPS_MIB = (2048, 1024, 512)
#: The default workspace is at most this fraction's inverse of the free device memory.
FREE_MEMORY_SHARE = 16
#: The default workspace of a call whose tensors are not on a CUDA device.
HOST_WORKSPACE_MIB = 448


def default_workspace_mib(device: torch.device) -> int:
    """The default workspace of a call on ``device``, in MiB: on CUDA the largest step of
    :data:`WORKSPACE_STEPS_MIB` at most 1/:data:`FREE_MEMORY_SHARE` of the free memory (free to
    the driver, plus what PyTorch's allocator holds unused), else the smallest; elsewhere
    :data:`HOST_WORKSPACE_MIB`. Reads the allocator's and the driver's counters, never a tensor:
    no synchronization with the device."""
    if device.type != "cuda":
        return HOST_WORKSPACE_MIB
    free_bytes, _ = torch.cuda.mem_get_info(device)
    free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    share_mib = free_bytes // FREE_MEMORY_SHARE >> 20
    return next((step for step in WORKSPACE_STEPS_MIB if step <= share_mib), WORKSPACE_STEPS_MIB[-1])
