"""A compact row encoding for a top-k cache (issue 36, item 6): per row, the ``k`` ids as an
Elias-Fano code and the ``k`` log-probabilities as their float16 values without the sign bit.

A row's ids, sorted ascending, are split at ``l = ⌊log2(V / k)⌋`` bits: the low ``l`` bits of each
are stored as they are, and the high parts ``h_0 ≤ … ≤ h_{k−1}`` (at most ``(V − 1) >> l``) in
unary, one set bit at position ``h_i + i`` of a ``k + ((V − 1) >> l)``-bit vector (2k to 3k
bits). That is less than one bit an id above the information ``log2 C(V, k)`` of a set of ``k``
ids (0.6 bit at k = 64), for every id set alike: every row of a ``(k, V)`` has the same size, so
a shard stays a ``(rows, bytes)`` table, sliced and gathered like today's. Each log-probability
is the value today's float16 cache stores (:func:`~orda_tp.topk_cache.writer.stored_logprobs`:
to nearest, toward −inf in a row whose mass would round above 1), kept as its 15 low bits: a
value ≤ 0 has its sign bit set (``+0`` aside), so nothing is lost. A row decodes to the float16
cache's (id, value) pairs bit for bit, in id order: a loss read through the codec has the float16
cache's error (the order moves only its sums' rounding).

At ``k = 64``: 208 B/row at V = 32000, 224 at 128256, 226 at 151936, 232 at 262144, 336 at
V = 2³¹ (the largest vocabulary accepted); float16 with int32 ids stores 384
(``benchmarks/topk_compact.py`` measures the alternatives and the errors).

:func:`encode` turns ``(rows, k)`` ids and log-probabilities into two ``(rows, bytes)`` uint8
tensors (:data:`TENSORS`; safetensors stores them), :func:`decode` turns them back. The bit
streams are little-endian (bit ``b`` of a stream is bit ``b % 8`` of byte ``b // 8``) on every
host and device; both functions are vectorized torch (over blocks of rows), run on the tensors'
device and are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..arguments.validation import check_count
from .rounding import stored_logprobs

__all__ = ["LOGPROB_BITS", "MAX_VOCAB_SIZE", "TENSORS", "CompactLayout", "decode", "encode", "encode_checked", "layout"]

#: The largest vocabulary the codec takes: every id below 2³¹ (a low part of at most 31 bits).
MAX_VOCAB_SIZE = 2**31
#: The bits of a stored log-probability: a float16 without its sign bit.
LOGPROB_BITS = 15
#: The names of the tensors :func:`encode` returns: the ids' stream and the log-probabilities'.
TENSORS = ("packed_ids", "packed_logprobs")
#: Entries (rows × k) a block of :func:`encode` and :func:`decode` spans on the CPU (:func:`_block_rows`).
BLOCK_ENTRIES = 1 << 16
_SIGN = 1 << LOGPROB_BITS  # float16's sign bit
_INF_BITS = 0x7C00  # float16's +inf magnitude; above it, NaN patterns (never stored)


class CompactLayout(NamedTuple):
    """The fixed layout of a row of ``k`` ids below ``vocab_size`` (:func:`layout`)."""

    k: int
    vocab_size: int
    low_bits: int  # l: the ids' low bits stored as they are
    upper_bits: int  # the unary vector of the high parts: k + ((V − 1) >> l) bits
    upper_bytes: int  # packed_ids' first bytes: the unary vector
    low_bytes: int  # packed_ids' other bytes: k fields of l bits
    logprob_bytes: int  # packed_logprobs' bytes: k fields of 15 bits

    @property
    def id_bytes(self) -> int:
        """The bytes of a row of ``packed_ids``."""
        return self.upper_bytes + self.low_bytes

    @property
    def row_bytes(self) -> int:
        """The bytes a row takes in both tensors."""
        return self.upper_bytes + self.low_bytes + self.logprob_bytes


def layout(k: int, vocab_size: int) -> CompactLayout:
    """The layout of a row of ``k`` ids in ``[0, vocab_size)``, ``1 ≤ k ≤ vocab_size ≤ 2³¹``:
    ``l = ⌊log2(vocab_size / k)⌋`` (Elias-Fano's choice: ``V / 2^l`` lies in ``[k, 2k)``, so the
    unary vector is ``2k`` to ``3k`` bits long); the same for every row."""
    vocab_size = check_count("vocab_size", vocab_size, 1)
    k = check_count("k", k, 1)
    if vocab_size > MAX_VOCAB_SIZE or k > vocab_size:
        raise ValueError(f"the compact codec needs 1 <= k <= vocab_size <= 2**31, got k={k}, vocab_size={vocab_size}")
    low_bits = max(0, (vocab_size // k).bit_length() - 1)  # ⌊log2⌊V/k⌋⌋ = ⌊log2(V/k)⌋
    upper_bits = k + ((vocab_size - 1) >> low_bits)
    # Whole bytes for each part: -(-a // b) is the ceiling of a / b.
    sizes = (-(-upper_bits // 8), -(-(k * low_bits) // 8), -(-(k * LOGPROB_BITS) // 8))
    return CompactLayout(k, vocab_size, low_bits, upper_bits, *sizes)


def encode(ids: Tensor, logprobs: Tensor, vocab_size: int) -> dict[str, Tensor]:
    """The stored form of a block of rows: ``ids`` (rows, k), integers in ``[0, vocab_size)``
    (a row's ids distinct, as the cache's writer checks; repeats are not checked and round trip
    too), ``logprobs`` (rows, k), floating, each ≤ 0 or −inf. Returns :data:`TENSORS` →
    ``(rows, bytes)`` uint8 tensors, contiguous, on the inputs' device (:func:`layout` gives the
    bytes). The log-probabilities are rounded as the float16 cache rounds them
    (:func:`~orda_tp.topk_cache.writer.stored_logprobs`). Raises ValueError / TypeError for inputs
    out of that contract (reads the values: synchronizes with the device)."""
    _check_inputs(ids, logprobs, vocab_size)
    return encode_checked(ids, logprobs, vocab_size)


def encode_checked(ids: Tensor, logprobs: Tensor, vocab_size: int) -> dict[str, Tensor]:
    """:func:`encode` of rows already checked against its contract (the cache's writer checks them
    once, with distinct ids too): no check, no synchronization."""
    rows, k = ids.shape
    plan = layout(k, vocab_size)
    widths = (plan.id_bytes, plan.logprob_bytes)
    packed = [torch.empty(rows, width, dtype=torch.uint8, device=ids.device) for width in widths]
    step = _block_rows(k, ids.device)
    # Blocks of rows, each encoded vectorized: the temporaries stay small (fresh pages cost more than the work).
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        packed[0][begin:end], packed[1][begin:end] = _encode_block(ids[begin:end], logprobs[begin:end], plan)
    return dict(zip(TENSORS, packed))


def decode(stored: dict[str, Tensor], k: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """The rows :func:`encode` stored: ids (rows, k) int64, ascending in each row, and their
    log-probabilities (rows, k) float32, the float16 cache's values exactly (−inf kept, −0 read as
    0), on ``stored``'s device. ``k`` and ``vocab_size`` must be the encoding's. Raises
    ValueError for tensors of another shape or dtype, and for bits no encoding writes (a row
    without exactly ``k`` set bits in its unary vector, an id past ``vocab_size``, a NaN pattern):
    a corrupt shard (reads the values: synchronizes with the device)."""
    plan = layout(k, vocab_size)
    packed_ids, packed_logprobs = _check_stored(stored, plan)
    rows, device = packed_ids.shape[0], packed_ids.device
    ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, k, dtype=torch.float32, device=device)
    step = _block_rows(k, device)
    for begin in range(0, rows, step):  # blocks of rows, as in encode
        end = min(rows, begin + step)
        ids[begin:end], logprobs[begin:end] = _decode_block(packed_ids[begin:end], packed_logprobs[begin:end], plan)
    return ids, logprobs


def _block_rows(k: int, device: torch.device) -> int:
    """Rows per block: about 2¹⁶ entries on the CPU (int64 temporaries of 512 KiB, reused by the
    allocator; larger ones are fresh pages whose faults cost more than the arithmetic), 2²² on a GPU."""
    return max(1, (BLOCK_ENTRIES if device.type == "cpu" else 1 << 22) // k)


def _encode_block(ids: Tensor, logprobs: Tensor, plan: CompactLayout) -> tuple[Tensor, Tensor]:
    """:func:`encode` of checked rows: their two packed streams."""
    rows, k = ids.shape
    # Each row sorted by id, its log-probabilities moved along: (id, log-probability) pairs stay together.
    ids, order = ids.to(torch.int64).sort(dim=1, stable=True)
    stored = stored_logprobs(logprobs.detach(), torch.float16).gather(1, order)
    rank = torch.arange(k, dtype=torch.int64, device=ids.device)
    # Elias-Fano: the i-th sorted id's high part h_i = id >> l as a set bit at h_i + i (strictly increasing).
    upper = torch.zeros(rows, plan.upper_bytes * 8, dtype=torch.uint8, device=ids.device)
    upper.scatter_(1, (ids >> plan.low_bits) + rank, 1)  # distinct places in a row: no race
    low = ids & ((1 << plan.low_bits) - 1)  # the low l bits, kept as they are
    packed_ids = torch.cat([_pack(upper, 1, plan.upper_bytes), _pack(low, plan.low_bits, plan.low_bytes)], dim=1)
    # float16 bits as int16, widened: the mask keeps the 15 magnitude bits (the sign is set for every value ≤ 0 but +0).
    magnitudes = stored.view(torch.int16).to(torch.int32) & (_SIGN - 1)
    return packed_ids, _pack(magnitudes, LOGPROB_BITS, plan.logprob_bytes)


def _decode_block(packed_ids: Tensor, packed_logprobs: Tensor, plan: CompactLayout) -> tuple[Tensor, Tensor]:
    """:func:`decode` of checked blocks of the two streams: ids and log-probabilities, checked."""
    rows, k = packed_ids.shape[0], plan.k
    # The unary vector's bits (and the zeros that pad it to whole bytes, which change no count below).
    bits = _bits(packed_ids[:, : plan.upper_bytes])
    ones = bits.cumsum(dim=1, dtype=torch.int64)  # set bits up to each place, inclusive
    if rows and bool((ones[:, -1] != k).any()):
        raise ValueError(f"packed_ids is corrupt: a row's unary vector does not hold exactly k={k} set bits")
    # h_i counts the zeros before the i-th set bit: a histogram of the zeros by the set bits before them, summed up.
    zeros = torch.zeros(rows, k + 1, dtype=torch.int32, device=bits.device)
    zeros.scatter_add_(1, ones, (1 - bits).to(torch.int32))  # integer sums: the same in any order
    high = zeros.cumsum(dim=1, dtype=torch.int64)[:, :k]
    low = _unpack(packed_ids[:, plan.upper_bytes :], k, plan.low_bits)
    ids = (high << plan.low_bits) | low  # the high part above the low bits
    # An id past vocab_size, or a NaN pattern (magnitude bits above +inf's): bits no encoding writes.
    if rows and int(ids.max()) >= plan.vocab_size:
        raise ValueError(f"packed_ids is corrupt: it decodes to an id at or past vocab_size={plan.vocab_size}")
    magnitudes = _unpack(packed_logprobs, k, LOGPROB_BITS)
    if rows and int(magnitudes.max()) > _INF_BITS:
        raise ValueError("packed_logprobs is corrupt: it holds a float16 NaN pattern")
    # Sign bit set: magnitude − 2¹⁵ is the int16 whose bits are 1‖magnitude (in int16's range: no wrap).
    logprobs = (magnitudes - _SIGN).to(torch.int16).view(torch.float16).to(torch.float32)
    return ids, logprobs + 0.0  # −0 + 0 = +0: a stored 0 reads back as 0


def _check_inputs(ids: object, logprobs: object, vocab_size: int) -> None:
    """Return for valid :func:`encode` inputs, else raise ValueError / TypeError naming the argument."""
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor (rows, k), got {getattr(ids, 'dtype', type(ids).__name__)}")
    if not isinstance(logprobs, Tensor) or not logprobs.is_floating_point():
        got = getattr(logprobs, "dtype", type(logprobs).__name__)
        raise TypeError(f"logprobs must be a floating-point tensor (rows, k), got {got}")
    if ids.dim() != 2 or logprobs.shape != ids.shape or ids.shape[1] < 1 or ids.device != logprobs.device:
        raise ValueError(
            f"ids and logprobs must both be (rows, k >= 1) on one device, got {tuple(ids.shape)} on {ids.device} "
            f"and {tuple(logprobs.shape)} on {logprobs.device}"
        )
    layout(ids.shape[1], vocab_size)  # checks k and vocab_size
    if ids.numel() == 0:
        return
    # Reductions first (no full-size temporaries); the place of a bad value only when there is one.
    low, high = ids.aminmax()
    if int(low) < 0 or int(high) >= vocab_size:
        row, column = (int(i) for i in ((ids < 0) | (ids >= vocab_size)).nonzero()[0])
        raise ValueError(f"ids must lie in [0, {vocab_size}); ids[{row}, {column}] = {int(ids[row, column])}")
    # The sign is not stored: a positive value (or a NaN, which max returns) would come back as another number.
    if not float(logprobs.max()) <= 0:
        row, column = (int(i) for i in (torch.isnan(logprobs) | (logprobs > 0)).nonzero()[0])
        raise ValueError(f"logprobs must be <= 0 (or -inf); logprobs[{row}, {column}] = {logprobs[row, column]}")


def _check_stored(stored: object, plan: CompactLayout) -> tuple[Tensor, Tensor]:
    """The two tensors of ``stored``, checked against ``plan``: uint8, (rows, bytes), on one device."""
    if not isinstance(stored, dict) or set(stored) != set(TENSORS):
        keys = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
        raise ValueError(f"stored must be a dict of {list(TENSORS)}, got {keys}")
    packed = [stored[name] for name in TENSORS]
    for name, tensor, width in zip(TENSORS, packed, (plan.id_bytes, plan.logprob_bytes)):
        table = isinstance(tensor, Tensor) and tensor.dtype == torch.uint8 and tensor.dim() == 2
        if not table or tensor.shape[1] != width:
            got = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"stored[{name!r}] must be uint8 (rows, {width}) for this k and vocab_size, got {got}")
    if packed[0].shape[0] != packed[1].shape[0] or packed[0].device != packed[1].device:
        raise ValueError(f"stored's tensors must have the same rows and device, got {[t.shape for t in packed]}")
    return packed[0], packed[1]


def _pack(fields: Tensor, width: int, nbytes: int) -> Tensor:
    """``fields`` (rows, n), each below ``2^width`` (``width ≤ 31``), at bits ``i·width`` of a
    little-endian stream of ``nbytes`` bytes a row: (rows, nbytes) uint8."""
    out = torch.zeros(fields.shape[0], nbytes + 8, dtype=torch.uint8, device=fields.device)  # spare: spans run over
    # Fields j, j + 8, j + 16, … (a phase) sit `width` bytes apart at one bit offset: one strided view each.
    for phase in range(8 if width else 0):
        first, shift = (phase * width) >> 3, (phase * width) & 7  # the phase's first byte and bit in it
        wide = torch.int32 if shift + width <= 32 else torch.int64  # room for the shifted field (may set int32's sign)
        shifted = fields[:, phase::8].to(wide) << shift
        for m in range((shift + width + 7) >> 3):  # the bytes the shifted field spans
            target = out[:, first + m :: width][:, : shifted.shape[1]]  # a view: the or lands in out
            target |= ((shifted >> (8 * m)) & 0xFF).to(torch.uint8)  # byte m of each field; fields share no bit
    return out[:, :nbytes]


def _unpack(data: Tensor, n: int, width: int) -> Tensor:
    """The ``n`` fields of ``width`` bits (``≤ 31``) at bits ``i·width`` of each row of ``data``
    (rows, bytes) uint8: (rows, n) int32."""
    rows = data.shape[0]
    if width == 0:
        return torch.zeros(rows, n, dtype=torch.int32, device=data.device)
    wide = torch.int32 if width <= 25 else torch.int64  # a field shifted by ≤ 7 bits fits 4 bytes, else 5
    stream = torch.zeros(rows, data.shape[1] + 8, dtype=wide, device=data.device)  # a last window may run past
    stream[:, : data.shape[1]] = data
    # The little-endian word of 4 bytes from every byte on (2, then 4): disjoint bits, so | assembles them.
    window = stream[:, :-1] | (stream[:, 1:] << 8)
    window = window[:, :-2] | (window[:, 2:] << 16)  # int32: byte 3 may set the sign bit; it stays above the field
    if wide == torch.int64:
        window = window[:, :-1] | (stream[:, 4:] << 32)  # a fifth byte for fields of 26 to 31 bits
    bit = torch.arange(n, dtype=torch.int64, device=data.device) * width
    # Each field's window from the byte holding its first bit, shifted by its place in that byte (≤ 7): an
    # arithmetic shift copies the sign into bits ≥ 25 of int32, above every field read this way; the mask drops them.
    fields = (window.index_select(1, bit >> 3) >> (bit & 7).to(wide)) & ((1 << width) - 1)
    return fields.to(torch.int32)  # no copy when already int32


def _bits(data: Tensor) -> Tensor:
    """The bits of each row of ``data`` (rows, bytes) uint8: (rows, 8·bytes) uint8 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    # Bit b of a row is bit b % 8 of byte b // 8: each byte's bits, least significant first.
    return ((data.unsqueeze(2) >> shifts) & 1).reshape(data.shape[0], -1)
