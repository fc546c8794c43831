"""On CPU, let glibc keep one step's transient tensors on its heap (issue 24).

[Note: glibc's thresholds on CPU]
glibc serves an allocation above its *mmap threshold* with a fresh ``mmap`` and gives the free top
of its heap back to the OS once that top is larger than its *trim threshold*. Both start at
128 KiB. Each time a mmapped block larger than the mmap threshold (and at most 32 MiB) is freed,
the mmap threshold becomes that block's size and the trim threshold twice that: the thresholds
follow the largest block the process has freed. A training step allocates and frees the same
activations every step (the logits, their log-softmax and its gradient are batch x seq x vocab
floats each). When the trim threshold sits below what one step's transients add to the top of the
heap, every step grows the heap and trims it back, and the kernel zeroes and faults in every page
of it again in the next step.

Which blocks a process happened to free decides where its thresholds sit. Lightning's ``ddp``
frees its first gradient buckets when it rebuilds them after the first step (one 20 MiB bucket on
issue 24's 5.3M model: trim threshold 40 MiB). The engine's large buffers live as long as it
does, so under ZeRO only the first step's transients raised them (8 MiB logits there: trim
threshold 16 MiB). ``strace`` then shows every zero1 step growing the heap by 24 MiB (three 8 MiB
``brk`` calls) and trimming it back: about 3,600 minor faults per step and rank that ddp did not
take (docs/benchmarks.md, session 15).

So an engine built on CPU frees one block of just under 32 MiB that it never writes:
:func:`raise_glibc_thresholds`. glibc's thresholds go to the largest values that freeing a block
can give them (mmap 32 MiB, trim 64 MiB), as they would after any model with a 32 MiB tensor had
freed one. The block costs no page (it is never touched); up to 64 MiB of free heap top may stay
with the process between steps. A user's ``GLIBC_TUNABLES`` (docs/performance.md, "Training on
CPU") switches the dynamic thresholds off, and another allocator (jemalloc, tcmalloc) ignores
them: the freed block then changes nothing. On CUDA the activations live in torch's caching
allocator and the engine does nothing here.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from typing import Optional

import torch

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest freed block that still moves the
# dynamic thresholds. The block asked for stays two pages under it, so that its mmapped chunk
# (the request, glibc's header and the alignment padding, rounded up to pages) is not larger.
GLIBC_MAX_DYNAMIC_MMAP_THRESHOLD = 32 * 1024 * 1024
_PAGE = 4096


def uses_glibc() -> bool:
    """Whether this process runs on Linux with glibc (the allocator :func:`raise_glibc_thresholds` is for)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def raise_glibc_thresholds() -> None:
    """Free one untouched block of just under 32 MiB ([Note: glibc's thresholds on CPU]).

    ``torch.empty`` on CPU asks the C allocator for the block and never writes it; while the
    process's mmap threshold is below it glibc maps it, and freeing it raises both thresholds.
    Harmless where they are raised already or fixed by ``GLIBC_TUNABLES``.
    """
    if not uses_glibc():
        return
    block = torch.empty(GLIBC_MAX_DYNAMIC_MMAP_THRESHOLD - 2 * _PAGE, dtype=torch.uint8)
    del block


MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


def mallinfo2() -> Optional[dict[str, int]]:
    """glibc's ``mallinfo2()`` as a dict (``hblkhd``: bytes mmapped, ``fordblks``: bytes held free);
    None without glibc >= 2.33. For benchmarks and tests that ask where the allocator put memory."""
    if not uses_glibc():
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name in MALLINFO2_FIELDS}
