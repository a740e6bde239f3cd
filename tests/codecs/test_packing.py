import pytest
import torch

from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64])
def test_pack_round_trip(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 1 << bits, (3, 2, n), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 2, packed_length(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_packing_layout_is_little_endian_bit_stream():
    # codes 1, 2, 3 with 2 bits: bits 01 | 10 | 11 -> byte 0b00111001
    assert pack_bits(torch.tensor([1, 2, 3], dtype=torch.uint8), 2).tolist() == [0b00111001]
    # 3-bit codes straddle bytes: 5 (101), 6 (110), 7 (111) -> stream 101 011 111 -> bytes 0xF5, 0x01
    assert pack_bits(torch.tensor([5, 6, 7], dtype=torch.uint8), 3).tolist() == [0b11110101, 0b1]


def test_packed_size_is_bits_over_eight():
    codes = torch.zeros(64, 128, dtype=torch.uint8)
    for bits in range(1, 9):
        assert pack_bits(codes, bits).numel() == 64 * 128 * bits // 8
