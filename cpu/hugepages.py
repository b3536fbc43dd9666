# The packed weights on 2 MB pages. A compiled step streams every weight once, a few hundred KB to a few MB a linear in
# separate allocations of 4 KB pages: a new page, and a TLB miss, every 4 KB of every stream. Moved into one anonymous
# mapping the kernel is asked to back with transparent huge pages (Linux's MADV_HUGEPAGE, honoured where
# /sys/kernel/mm/transparent_hugepage/enabled says "madvise" or "always"), the same bytes stream faster (docs/cpu.md).
# Elsewhere the mapping is ordinary memory and nothing changes.
import mmap

import torch

MIN_BYTES = 1 << 16  # smaller buffers (a small layer's scales) stay where they are: a page holds many of them
ALIGN = 64  # each buffer starts on a cache line, as an allocator's would
_arenas = []  # (start, end) of the mappings made here: a buffer already in one is left in place


def gather(modules) -> int:
    """Every buffer of MIN_BYTES or more of these modules (read-only weights: a copy of a buffer that is a view of
    another tensor no longer follows writes to it) moved into one mapping on huge pages, in place of the module's own.
    A buffer that several modules share stays shared. -> bytes moved."""
    slots, seen = [], {}
    for module in modules:
        for name, b in module._buffers.items():
            if b is None or b.device.type != "cpu" or b.layout != torch.strided or not b.is_contiguous() \
                    or b.numel() * b.element_size() < MIN_BYTES or any(lo <= b.data_ptr() < hi for lo, hi in _arenas):
                continue
            key = (b.data_ptr(), b.dtype, b.shape)
            slots.append((module, name, key))
            seen.setdefault(key, b)
    sizes = {key: -(-b.numel() * b.element_size() // ALIGN) * ALIGN for key, b in seen.items()}
    if not sizes:
        return 0
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another switch (shmem_enabled)
    arena = mmap.mmap(-1, sum(sizes.values()), **({"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copies below fault in 2 MB pages
    with torch.inference_mode(False):  # ordinary tensors, as the buffers they replace (compiled steps' guards)
        moved, at = {}, 0
        for key, b in seen.items():
            # A storage of its own over its bytes (each keeps the mapping alive): views of one storage would be
            # aliased inputs to a compiled step, which nested compiled regions refuse.
            moved[key] = torch.frombuffer(arena, dtype=b.dtype, count=b.numel(), offset=at).view(b.shape)
            moved[key].copy_(b)
            at += sizes[key]
    start = moved[next(iter(moved))].data_ptr()
    _arenas.append((start, start + at))
    for module, name, key in slots:
        module._buffers[name] = moved[key]
    return at
