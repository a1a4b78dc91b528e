"""Checkpoints packed by torch 2.3-2.5's CPU ``_convert_weight_to_int4pack`` (int32 4-D) and
old call sites of the int4 ops keep working on a torch that only has the _for_cpu ops."""
import warnings

import pytest
import torch

import qbackend
import qbackend.ops as qops
from qbackend.weight_only.legacy_int4 import current_isa, unpack_old_cpu_int4

from tests.tolerances import assert_weight_only_close


def old_cpu_pack(unsigned: torch.Tensor, inner_k_tiles: int, isa: str) -> torch.Tensor:
    """Reference model of the old CPU packing, written block by block as the old kernel
    stored it: per block of BLOCK_N output channels, for every k, BLOCK_N / 2 bytes whose
    low / high nibbles hold two channels chosen by the ISA."""
    n_out, k_in = unsigned.shape
    block_n = 64 if isa == "avx512" else 32
    out = []
    for start in range(0, n_out, block_n):
        block = unsigned[start:start + block_n].to(torch.uint8)
        size = block.shape[0]
        if isa == "avx512" and size == 64:
            low, high = torch.cat([block[0:16], block[16:32]]), torch.cat([block[32:48], block[48:64]])
        elif isa == "avx2" and size == 32:
            low, high = block[0:16], block[16:32]
        else:  # neighbouring channels share a byte
            low, high = block[0::2], block[1::2]
        out.append((low | (high << 4)).t().reshape(-1))  # k-major inside the block
    raw = torch.cat(out)
    return raw.view(torch.int32).reshape(n_out // 8, k_in // (16 * inner_k_tiles), 32, inner_k_tiles // 2)


def old_checkpoint(n_out=176, k_in=256, group_size=64, isa="avx512", seed=0):
    """(old packed weight, qScaleAndZeros [K/g, N, 2], the float weight they encode)."""
    g = torch.Generator().manual_seed(seed)
    unsigned = torch.randint(0, 16, (n_out, k_in), dtype=torch.int32, generator=g)
    scales_zeros = torch.stack([torch.rand(k_in // group_size, n_out, generator=g) * 0.02 + 0.005,
                                torch.randn(k_in // group_size, n_out, generator=g) * 0.02], dim=-1)
    scale = scales_zeros[..., 0].t().repeat_interleave(group_size, 1)
    zero = scales_zeros[..., 1].t().repeat_interleave(group_size, 1)
    return old_cpu_pack(unsigned, 8, isa), scales_zeros, (unsigned - 8) * scale + zero


@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
@pytest.mark.parametrize("n_out", [16, 48, 64, 176])  # short last blocks included
def test_unpack_inverts_the_old_packing(isa, n_out):
    unsigned = torch.randint(0, 16, (n_out, 128), dtype=torch.int32)
    assert torch.equal(unpack_old_cpu_int4(old_cpu_pack(unsigned, 4, isa), 128, isa).int() + 8, unsigned)


def test_the_reference_packing_is_the_bytes_torch_writes_on_this_machine():
    unsigned = torch.randint(0, 16, (176, 256), dtype=torch.int32)
    new = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 8)
    assert torch.equal(old_cpu_pack(unsigned, 8, current_isa()).reshape(-1).view(torch.uint8), new.reshape(-1))


def test_old_checkpoint_becomes_a_neutral_weight_with_the_same_values():
    packed, scales_zeros, dense = old_checkpoint(isa="avx2")  # packed on another kind of machine
    weight = qbackend.from_old_cpu_int4(packed, scales_zeros, group_size=64, isa="avx2")
    assert torch.allclose(weight.dequantize(), dense, atol=1e-6)
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert_weight_only_close(torch.nn.functional.linear(x, weight), x @ dense.t(), "converted checkpoint")


def test_old_call_sites_run_through_the_shim_with_a_deprecation_warning():
    packed, scales_zeros, dense = old_checkpoint(isa=current_isa())  # old code packed on this machine
    x = torch.randn(3, 256)
    with pytest.raises(NotImplementedError):  # what old code hits on this torch
        torch.ops.aten._weight_int4pack_mm(x, packed, 64, scales_zeros)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_old_packing = qops._weight_int4pack_mm(x, packed, 64, scales_zeros)
        unsigned = ((dense - scales_zeros[..., 1].t().repeat_interleave(64, 1))
                    / scales_zeros[..., 0].t().repeat_interleave(64, 1)).round().int() + 8
        repacked = qops._weight_int4pack_mm(x, qops._convert_weight_to_int4pack(unsigned, 8), 64, scales_zeros)
        torch25_input = ((unsigned[:, 0::2] << 4) | unsigned[:, 1::2]).to(torch.uint8)  # 2.5: even k high
        assert torch.equal(qops._convert_weight_to_int4pack(torch25_input, 8), qops._convert_weight_to_int4pack(unsigned, 8))
    assert all(issubclass(w.category, DeprecationWarning) for w in caught) and len(caught) == 5
    assert "_weight_int4pack_mm_for_cpu" in str(caught[0].message)
    for got in (from_old_packing, repacked):
        assert torch.allclose(got, x @ dense.t(), rtol=1e-4, atol=1e-4)
