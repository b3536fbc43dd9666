# cpu/hugepages.py: the packed weights moved into one mapping asked for huge pages, values and sharing unchanged.
from pathlib import Path

import torch
import torch.nn as nn

from cpu import hugepages


class Packed(nn.Module):
    def __init__(self, packed, scales=None):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)


def thp_eligible(ptr: int) -> str:
    """The THPeligible line of the mapping of /proc/self/smaps that holds address ptr."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "THPeligible:":
            return line.split()[1]
    return ""


def test_gather_moves_large_buffers_into_one_huge_page_mapping_and_keeps_their_values():
    big = torch.randint(-2**31, 2**31 - 1, (256, 288, 16), dtype=torch.int32)  # 4.7 MB: holds a whole aligned 2 MB page
    shared = torch.randn(1 << 15, dtype=torch.bfloat16)
    small = torch.rand(16)
    a, b, c = Packed(big.clone(), small), Packed(shared), Packed(shared)
    moved = hugepages.gather([a, b, c])
    assert moved == big.numel() * 4 + shared.numel() * 2
    assert torch.equal(a.packed, big) and torch.equal(b.packed, shared) and a.packed.dtype == torch.int32
    assert a.scales is small  # below MIN_BYTES: left where it was
    assert b.packed is c.packed  # one buffer of two modules stays one
    assert b.packed.data_ptr() == a.packed.data_ptr() + big.numel() * 4  # one mapping, one after the other
    assert a.packed.untyped_storage().data_ptr() != b.packed.untyped_storage().data_ptr()  # not aliased inputs
    assert a.packed.data_ptr() % hugepages.ALIGN == 0 and b.packed.data_ptr() % hugepages.ALIGN == 0
    assert not a.packed.is_inference() and a.packed.is_contiguous()
    assert hugepages.gather([a, b, c]) == 0  # already there: nothing moves twice
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert thp_eligible(a.packed.data_ptr()) == "1"  # the mapping was asked for huge pages


def test_gather_inside_inference_mode_gives_ordinary_tensors():
    m = Packed(torch.randn(1 << 16))
    with torch.inference_mode():
        hugepages.gather([m])
    assert not m.packed.is_inference()
