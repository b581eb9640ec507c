"""PageTable: the host-side allocator of the paged KV pool (`jaxlearn.kernels.paged`).

A request holds a slot (a row of the table) and ceil(tokens / page_size) pages, taken
from one free list shared by every slot as it grows and returned when it finishes or is
preempted. So KV memory follows the live tokens: the pool may be far smaller than
slots x max length, and a short request holds a few pages, not a max-length row.

Prefix caching (vLLM's automatic prefix caching): a FULL page whose positions are all
computed is registered under a digest chained over the token ids of every page up to it
(sha256(digest of the page before + this page's ids)), so a digest names the whole
prefix, not one page. A request admitted with a prompt whose first full pages have
registered digests shares those pages (reference counts) and skips their prefill. A page
whose count drops to 0 stays cached in an LRU list; when the free list is empty the
least recently released cached page is evicted (its digest forgotten) and reused. A
slot's pages are released last page first, so a prefix's tail is evicted before its
head. Shared pages are never written: a request reuses at most the full pages before
its last prompt token (that token is always computed, for its logits), and every write
goes to positions past them.

Sliding windows (`window`: the largest window of a model whose every attention layer
has one): a key at distance >= window from every query of a call is masked, so before a
call whose first query is at position `pos` the slot's pages that end before
pos - window + 1 are released (`trim`): its reference is dropped exactly as `release`
drops it (a shared prefix page stays with the other slots; a registered page nobody
holds goes to the LRU list) and its table entry becomes 0. A slot thus holds the pages
intersecting [pos - window + 1, pos + new tokens); the gathers of the released columns
read page 0, never a page another slot may own by now.

Page 0 is never handed out (table entries of unused or released pages read 0; the
layers treat it as scratch). Lower page numbers are handed out first, so a lightly used
pool stays compact.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from typing import Optional, Sequence

import numpy as np


class PageTable:
    """num_pages pages (page 0 reserved) of page_size tokens; num_slots rows of at most
    max_pages pages each; prefix_caching: register and share full pages (above); window:
    release the pages behind every layer's sliding window (`trim`; None: never)."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages: int,
                 prefix_caching: bool = False, window: Optional[int] = None):
        if num_pages < 2:
            raise ValueError(
                f"PageTable: need at least 2 pages (page 0 is reserved), got {num_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages = max_pages
        self.prefix_caching = prefix_caching
        if window is not None and window < 1:
            raise ValueError(f"PageTable: window={window} must be >= 1 (or None)")
        self.window = window
        self.table = np.zeros((num_slots, max_pages), np.int32)
        self.evictions = 0
        self._owned = [0] * num_slots  # Table columns [0, owned) cover the slot's positions.
        self._first = [0] * num_slots  # Columns [0, first) are released (`trim`): page 0.
        self._free = list(range(1, num_pages))  # A heap: lowest page first.
        self._ref = [0] * num_pages  # Slots holding each page.
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # ref 0.
        self._page_of: dict[bytes, int] = {}  # Registered digest -> page.
        self._digest: dict[int, bytes] = {}  # Registered page -> digest.
        self._chain: list[list[bytes]] = [[] for _ in range(num_slots)]  # Full pages' digests.
        self._salt = [b""] * num_slots  # Where each slot's chain starts (`admit`).

    @property
    def num_free(self) -> int:
        """Pages a request can get: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages some slot holds."""
        return self.num_pages - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered pages (held or not)."""
        return len(self._digest)

    def pages_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size)

    def owned(self, slot: int) -> int:
        """Table columns of slot's positions [0, owned * page_size), released ones included."""
        return self._owned[slot]

    def held(self, slot: int) -> list[int]:
        """The pages slot holds (its columns [first, owned))."""
        return self.table[slot, self._first[slot] : self._owned[slot]].tolist()

    def committed(self, slot: int) -> int:
        """Full pages of slot whose digests are known (registered or not)."""
        return len(self._chain[slot])

    def _next_digest(self, parent: bytes, ids: Sequence[int]) -> bytes:
        return hashlib.sha256(parent + np.asarray(ids, np.int64).tobytes()).digest()

    def admit(self, slot: int, ids: Sequence[int], *, reuse: bool = True,
              first_chunk: Optional[int] = None, salt: bytes = b"") -> Optional[int]:
        """Gives the empty `slot` pages for the positions of `ids`, sharing the cached
        full pages of its longest cached prefix (with reuse and prefix caching, at most
        the pages before the last id). With a window and `first_chunk`, only the pages of
        the cached prefix and the next first_chunk positions (the first prefill chunk;
        later chunks `ensure` theirs once the window has moved). Returns the number of
        leading positions already in the cache (a multiple of page_size), or None when
        the pool is short (nothing changes then). `salt` starts the digest chain: pages
        of a different salt (another LoRA adapter) are never shared."""
        assert self._owned[slot] == 0, slot
        hits: list[tuple[bytes, int]] = []
        self._salt[slot] = salt
        if self.prefix_caching and reuse:
            digest, ps = salt, self.page_size
            for i in range((len(ids) - 1) // ps):
                digest = self._next_digest(digest, ids[i * ps : (i + 1) * ps])
                page = self._page_of.get(digest)
                if page is None:
                    break
                hits.append((digest, page))
        idle_hits = sum(self._ref[p] == 0 for _, p in hits)
        tokens = len(ids)
        if self.window is not None and first_chunk is not None:
            tokens = min(tokens, len(hits) * self.page_size + first_chunk)
        if self.pages_for(tokens) - len(hits) > self.num_free - idle_hits:
            return None
        for i, (digest, page) in enumerate(hits):
            self._lru.pop(page, None)
            self._ref[page] += 1
            self.table[slot, i] = page
        self._owned[slot] = len(hits)
        self._chain[slot] = [d for d, _ in hits]
        self.ensure(slot, tokens)  # Cannot fail: checked above.
        return len(hits) * self.page_size

    def _take(self) -> int:
        """A page for a slot: the lowest free one, else the least recently released
        cached one (evicted)."""
        if self._free:
            page = heapq.heappop(self._free)
        else:
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._digest.pop(page)]
            self.evictions += 1
        self._ref[page] = 1
        return page

    def ensure(self, slot: int, tokens: int) -> bool:
        """Gives `slot` pages for positions [0, tokens); all or nothing. False when the
        pool is short (nothing changes then)."""
        need = self.pages_for(tokens)
        if need > self.max_pages:
            raise ValueError(f"slot {slot}: {tokens} tokens need {need} pages > {self.max_pages}")
        extra = need - self._owned[slot]
        if extra <= 0:
            return True
        if extra > self.num_free:
            return False
        have = self._owned[slot]
        for i in range(extra):
            self.table[slot, have + i] = self._take()
        self._owned[slot] = need
        return True

    def commit(self, slot: int, ids: Sequence[int], n: int) -> None:
        """Positions [0, n) of `slot` hold the keys / values of ids[:n]: registers its
        full pages among them not yet registered (a page whose digest another page
        already has stays private)."""
        if not self.prefix_caching:
            return
        chain, ps = self._chain[slot], self.page_size
        for i in range(len(chain), min(n // ps, self._owned[slot])):
            parent = chain[-1] if chain else self._salt[slot]
            digest = self._next_digest(parent, ids[i * ps : (i + 1) * ps])
            chain.append(digest)
            page = int(self.table[slot, i])  # 0: released before its commit (not kept).
            if page and digest not in self._page_of:
                self._page_of[digest], self._digest[page] = page, digest

    def _drop(self, pages: Sequence[int]) -> None:
        """One reference less on each of `pages`: a page nobody holds any more goes to
        the LRU list if registered, else to the free list."""
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._digest:
                    self._lru[p] = None
                else:
                    heapq.heappush(self._free, p)

    def trim(self, slot: int, pos: int) -> int:
        """With a window: releases the pages of `slot` that end before pos - window + 1
        (`pos`: the first position the slot's next call queries; keys before that are
        masked for every query of the call). Returns how many were released."""
        if self.window is None:
            return 0
        first = self._first[slot]
        end = min(self._owned[slot], (pos - self.window + 1) // self.page_size)
        if end <= first:
            return 0
        self._drop(self.table[slot, first:end].tolist())
        self.table[slot, first:end] = 0
        self._first[slot] = end
        return end - first

    def release(self, slot: int) -> None:
        """Returns every page of `slot` (last first): cached ones to the LRU list, the
        others to the free list."""
        self._drop(self.held(slot)[::-1])
        self.table[slot] = 0
        self._owned[slot] = self._first[slot] = 0
        self._chain[slot] = []

    def drop_cached(self) -> None:
        """Forgets every registered page (the pool's contents were lost)."""
        for p in self._lru:
            heapq.heappush(self._free, p)
        self._lru.clear()
        self._page_of.clear()
        self._digest.clear()

    def rows(self, slots: list[int]) -> np.ndarray:
        """The table rows [len(slots), max_pages] of `slots`."""
        return self.table[np.asarray(slots, np.int64)]
