"""PageTable: the host-side allocator of the paged KV pool (`jaxlearn.layers.paged`).

A request holds a slot (a row of the table) and ceil(tokens / page_size) pages, taken
from one free list shared by every slot as it grows and returned when it finishes or is
preempted. So KV memory follows the live tokens: the pool may be far smaller than
slots x max length, and a short request holds a few pages, not a max-length row.

Page 0 is never handed out (table entries of unused pages read 0; the layers treat it
as scratch). Lower page numbers are handed out first, so a lightly used pool stays
compact.
"""

from __future__ import annotations

import heapq

import numpy as np


class PageTable:
    """num_pages pages (page 0 reserved) of page_size tokens; num_slots rows of at most
    max_pages pages each."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages: int):
        if num_pages < 2:
            raise ValueError(
                f"PageTable: need at least 2 pages (page 0 is reserved), got {num_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages = max_pages
        self.table = np.zeros((num_slots, max_pages), np.int32)
        self._owned = [0] * num_slots
        self._free = list(range(1, num_pages))  # A heap: lowest page first.

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size)

    def owned(self, slot: int) -> int:
        """Pages slot holds."""
        return self._owned[slot]

    def ensure(self, slot: int, tokens: int) -> bool:
        """Gives `slot` pages for positions [0, tokens); all or nothing. False when the
        free list is short (nothing changes then)."""
        need = self.pages_for(tokens)
        if need > self.max_pages:
            raise ValueError(f"slot {slot}: {tokens} tokens need {need} pages > {self.max_pages}")
        extra = need - self._owned[slot]
        if extra <= 0:
            return True
        if extra > len(self._free):
            return False
        have = self._owned[slot]
        for i in range(extra):
            self.table[slot, have + i] = heapq.heappop(self._free)
        self._owned[slot] = need
        return True

    def release(self, slot: int) -> None:
        """Returns every page of `slot` to the free list."""
        for p in self.table[slot, : self._owned[slot]]:
            heapq.heappush(self._free, int(p))
        self.table[slot] = 0
        self._owned[slot] = 0

    def rows(self, slots: list[int]) -> np.ndarray:
        """The table rows [len(slots), max_pages] of `slots`."""
        return self.table[np.asarray(slots, np.int64)]
