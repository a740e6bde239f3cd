"""Bit packing of integer codes into uint8 storage.

Codes of ``bits`` bits (1..8) along the last dimension are written as a little-endian bit stream:
code ``i`` occupies bits ``[i*bits, (i+1)*bits)`` of the stream, byte ``j`` holds stream bits
``[8j, 8j+8)``. For 1, 2, 4 and 8 bits this is the usual "8/bits codes per byte" layout; for 3, 5, 6
and 7 bits codes straddle byte boundaries. Packed size is ``ceil(n * bits / 8)`` bytes per row.
"""

import torch


def packed_length(num_codes: int, bits: int) -> int:
    """Bytes needed to store ``num_codes`` codes of ``bits`` bits."""
    return (num_codes * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bit packing supports 1..8 bits per code, got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last dim into uint8 ``[..., packed_length(n, bits)]``."""
    _check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8)
    *lead, n = codes.shape
    if 8 % bits == 0:
        per_byte = 8 // bits
        pad = (-n) % per_byte
        c = torch.nn.functional.pad(codes.to(torch.uint8), (0, pad)).view(*lead, -1, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (c << shifts).sum(-1, dtype=torch.uint8)
    # general case: expand to a bit stream, then regroup by 8
    weights = 1 << torch.arange(bits, device=codes.device)
    stream = ((codes.to(torch.int32).unsqueeze(-1) & weights) != 0).reshape(*lead, n * bits)
    pad = (-(n * bits)) % 8
    stream = torch.nn.functional.pad(stream, (0, pad)).view(*lead, -1, 8).to(torch.uint8)
    byte_weights = (1 << torch.arange(8, device=codes.device)).to(torch.uint8)
    return (stream * byte_weights).sum(-1, dtype=torch.uint8)


def _byte_codes(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``8 / bits`` codes of every byte value, ``[256, 8 / bits]`` in ``dtype`` (made once per device)."""
    key = (bits, dtype, device)
    if key not in _BYTE_CODES:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        _BYTE_CODES[key] = ((torch.arange(256, dtype=torch.uint8, device=device)[:, None] >> shifts)
                            & ((1 << bits) - 1)).to(dtype)
    return _BYTE_CODES[key]


_BYTE_CODES: dict[tuple, torch.Tensor] = {}


def unpack_bits(packed: torch.Tensor, bits: int, num_codes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., bytes]`` -> codes ``[..., num_codes]`` in ``dtype`` (uint8, or
    e.g. float32 for a decoder: no second pass to convert). Codes within bytes are looked up per byte."""
    _check_bits(bits)
    if bits == 8:
        return packed[..., :num_codes].to(dtype)
    *lead, _ = packed.shape
    if 8 % bits == 0:
        table = _byte_codes(bits, dtype, packed.device)
        codes = table.index_select(0, packed.reshape(-1).to(torch.int32))
        return codes.view(*lead, -1)[..., :num_codes]
    byte_bits = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(-1) >> byte_bits) & 1).reshape(*lead, -1)[..., : num_codes * bits]
    weights = (1 << torch.arange(bits, device=packed.device)).to(torch.int32)
    codes = (stream.view(*lead, num_codes, bits).to(torch.int32) * weights).sum(-1)
    return codes.to(dtype)
