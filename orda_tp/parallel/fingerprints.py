"""What the handshake's second gather compares, computed and compared on the device: checksums of
the tensors every rank must hold alike and a fingerprint of each rank's head shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FINGERPRINT_SLICES", "inconsistencies", "replicated_checksum", "shard_fingerprint", "value_checks"]

FINGERPRINT_SLICES = 64


def shard_fingerprint(shard: torch.Tensor, vocab_dim: int) -> torch.Tensor:
    """Three int64 describing up to 64 vocabulary slices spread evenly over ``shard`` (rows of a
    head, columns of logits): the bit patterns of two fp64 sums over them (plain and weighted by
    position), and 1 if the slices differ from each other; no host read."""
    sample = shard.detach()
    columns = sample.shape[vocab_dim]
    if columns == 0:
        return torch.zeros(3, dtype=torch.int64, device=shard.device)
    count = min(columns, FINGERPRINT_SLICES)
    # Spread evenly, the first and the last slice included.
    index = torch.arange(count, device=shard.device) * (columns - 1) // max(count - 1, 1)
    sample = sample.index_select(vocab_dim, index).to(torch.float64)
    positions = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=shard.device).view_as(sample)
    # Compared as bit patterns: copies of one tensor give the same sums, by the same ops, on every rank.
    sums = torch.stack([sample.sum(), (sample * positions).sum()]).view(torch.int64)
    first = sample.narrow(vocab_dim, 0, 1)
    # A constant head (zeros, one repeated row) cannot be told from its copies: this flag exempts it.
    differ = (sample != first).any().to(torch.int64).reshape(1)
    return torch.cat([sums, differ])


def replicated_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 that differ when two ranks' copies of a tensor that must be the same on every
    rank (labels, token weights, a top-k cache) differ: its plain and position-weighted sums,
    exact for integers and as fp64 bit patterns for floats (computed on the tensor's device)."""
    values = tensor.detach().reshape(-1)
    dtype = torch.float64 if values.is_floating_point() else torch.int64
    values = values.to(dtype)
    # Weighted by position, from 1: a change that keeps the plain sum (a swap) changes the second.
    positions = torch.arange(1, values.numel() + 1, device=values.device, dtype=dtype)
    sums = torch.stack([values.sum(), (values * positions).sum()])
    return sums.view(torch.int64) if dtype == torch.float64 else sums  # exact in int64; floats by their bits


def value_checks(
    replicated: Sequence[torch.Tensor], head: torch.Tensor | None, vocab_dim: int, device: torch.device
) -> torch.Tensor:
    """This rank's checksums of its ``replicated`` tensors (2 values each) and the fingerprint (3)
    of its ``head`` shard (vocabulary along ``vocab_dim``; zeros for None), int64 on ``device``."""
    checksums = [replicated_checksum(tensor).to(device) for tensor in replicated]
    # Zeros without a head: the same width on every rank.
    fingerprint = shard_fingerprint(head, vocab_dim) if head is not None else torch.zeros(3, dtype=torch.int64)
    return torch.cat([*checksums, fingerprint.to(device)])


def inconsistencies(checks: torch.Tensor, same_size: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(which replicated tensors differ, copies of one head)``: a bool per replicated tensor and
    a 0-d bool, on ``checks``' device, from every rank's checksums and head fingerprint ``checks``
    (world, 2·R + 3; the head's fingerprint zeros where no head is fingerprinted). Shards of equal
    size (``same_size``, of more than one rank) whose slices differ within each shard but match
    bitwise across every rank are one tensor passed whole on every rank, not its shards."""
    checksums = checks[:, :-3].view(checks.shape[0], -1, 2)
    differ = (checksums != checksums[:1]).any(dim=2).any(dim=0)
    fingerprints = checks[:, -3:]
    # Every rank's slices differ within its shard, yet every fingerprint matches bitwise: copies, not shards.
    copies = (fingerprints[:, 2] != 0).all() & (fingerprints == fingerprints[:1]).all()
    return differ, copies & same_size
