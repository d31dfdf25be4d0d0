"""The KV page pool: which sequence owns which page, shared pages, and the prefix cache.

Pure bookkeeping (no tensors): the page tensors live in the model; this decides page ids, the
flat slot of every token (page * page_size + row), and which pages must be copied.

Every page is in exactly one state:
  free     refcount 0, holds nothing anyone wants;
  owned    refcount n >= 1: it appears in n block tables;
  idle     refcount 0, but its rows are registered in the prefix cache: a later request with the
           same prefix takes it back; a fresh page is taken from `free` first, then by evicting
           the least recently idle page.
A full page is registered under a chained digest (BLAKE2b-256 over the digest of the page before
it and its token ids), so a hit means the whole prefix up to and including that page is the same.
A hit is also checked against the page's stored token ids and parent digest, so a collision of
the digest does not hand a sequence the KV rows of other tokens (Python's `hash`, which this
replaced, is 64 bits and easy to collide on purpose; a 256-bit digest is not). Only full
pages are shared through the cache, and they are never written again. `fork` shares every page
of a table (for n > 1 samples of one prompt); the first write into a shared, partly filled last
page copies it first (copy-on-write): `grow` returns the (source, destination) page copies the
caller must make before it writes.

With a sliding window W over every layer (`window`), a query at position p reads keys p - W < j
<= p only, so once a sequence has computed N tokens, its pages wholly before position N - W + 1
are dead: `drop_dead_pages` releases them (a cached one goes idle, as on release) and leaves
FREED in their place in the table, which keeps page i at table index i. Long generations then
hold about (W + chunk) / page_size pages each, not their whole context.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from kiln.errors import KilnError


FREED = -1        # a table entry whose page was released as outside the window


def live_pages(num_tokens: int, chunk: int, page_size: int, window: int | None) -> int:
    """The most pages a sequence of `num_tokens` holds at once, computed `chunk` tokens a step,
    when pages wholly outside a `window` (None: no window) are dropped."""
    pages = -(-num_tokens // page_size)
    return pages if window is None else min(pages, -(-(window - 1 + chunk) // page_size) + 1)


class OutOfPages(KilnError):
    """The pool cannot supply the pages asked for (the scheduler preempts or waits)."""


@dataclass
class BlockTable:
    """A sequence's pages in order, how many token rows they hold, and the chained digests of
    its first len(hashes) full pages."""
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)
    dropped: int = 0                  # leading pages released as outside the window (FREED in pages)
    salt: bytes | None = None         # the first page's parent digest: a LoRA adapter's pages key apart


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0           # prompt tokens looked up
    hit_tokens: int = 0               # of those, found in the cache (their computation skipped)
    evicted_pages: int = 0


def page_digest(parent: bytes | None, tokens: list[int]) -> bytes:
    """The chained key of a full page: BLAKE2b-256 over the parent page's digest and the page's
    token ids as int64 (about a microsecond for a page of 16 tokens; it runs when a page fills)."""
    h = hashlib.blake2b(parent or b"", digest_size=32)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, window: int | None = None):
        if num_pages < 1:
            raise KilnError("the KV memory budget holds no page; give more KV memory")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.window = window              # the widest sliding window of any layer; None if one sees all
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))     # pop() hands out low ids first
        self._idle: OrderedDict[int, None] = OrderedDict()   # least recently idle first
        self._by_hash: dict[bytes, int] = {}                  # digest -> cached page
        self._hash_of: dict[int, bytes] = {}                  # cached page -> its digest
        self._key_of: dict[int, tuple] = {}                   # cached page -> (parent digest, token ids)
        self.stats = PrefixCacheStats()

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a request can get now: free ones plus idle cached ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def live_pages_for(self, num_tokens: int, chunk: int) -> int:
        return live_pages(num_tokens, chunk, self.page_size, self.window)

    def pages_needed(self, table: BlockTable, new_tokens: int) -> int:
        """Fresh pages `grow(table, new_tokens)` would take (a copy-on-write copy included)."""
        need = self.pages_for(table.num_tokens + new_tokens) - len(table.pages)
        return need + (1 if new_tokens and self._shared_partial_last(table) else 0)

    # -- page states ---------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self._idle:
            page, _ = self._idle.popitem(last=False)
            del self._by_hash[self._hash_of.pop(page)]
            del self._key_of[page]
            self.stats.evicted_pages += 1
        else:
            raise OutOfPages("KV cache is full")
        self.refcount[page] = 1
        return page

    def _incref(self, page: int) -> None:
        if self.refcount[page] == 0:
            del self._idle[page]
        self.refcount[page] += 1

    def _decref(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._hash_of:
                self._idle[page] = None
            else:
                self._free.append(page)

    def _shared_partial_last(self, table: BlockTable) -> bool:
        return bool(table.num_tokens % self.page_size) and self.refcount[table.pages[-1]] > 1

    # -- tables ------------------------------------------------------------------------------
    def grow(self, table: BlockTable, new_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Extend `table` by `new_tokens` rows. Returns the flat slot of each new row, and the page
        copies (source, destination) to make before writing them. Raises OutOfPages (changing
        nothing) when the pool cannot supply the pages."""
        if self.pages_needed(table, new_tokens) > self.num_free:
            raise OutOfPages(f"KV cache is full: need {self.pages_needed(table, new_tokens)} pages, "
                             f"{self.num_free} free")
        copies = []
        if new_tokens and self._shared_partial_last(table):
            shared = table.pages[-1]
            private = self._take()
            copies.append((shared, private))
            self._decref(shared)
            table.pages[-1] = private
        total = table.num_tokens + new_tokens
        table.pages += [self._take() for _ in range(self.pages_for(total) - len(table.pages))]
        p = self.page_size
        slots = [table.pages[t // p] * p + t % p for t in range(table.num_tokens, total)]
        table.num_tokens = total
        return slots, copies

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every page of `table`."""
        for page in table.pages:
            if page != FREED:
                self._incref(page)
        return BlockTable(list(table.pages), table.num_tokens, list(table.hashes), table.dropped, table.salt)

    def release(self, table: BlockTable) -> None:
        """Give back the table's pages; its cached pages become idle, the last page first, so that
        eviction takes a prefix's tail before its head."""
        for page in reversed(table.pages):
            if page != FREED:
                self._decref(page)
        table.pages, table.num_tokens, table.hashes, table.dropped = [], 0, [], 0

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keep the table's first `num_tokens` rows (a speculative step's rejected guesses go): the
        pages past the last kept row are released. A registered page is never cut, and rows were
        written only in private pages (`grow` copies a shared one first), so no other table sees it."""
        if num_tokens < len(table.hashes) * self.page_size or num_tokens > table.num_tokens:
            raise ValueError(f"cannot truncate a table of {table.num_tokens} rows ({len(table.hashes)} pages "
                             f"registered) to {num_tokens}")
        keep = self.pages_for(num_tokens)
        for page in reversed(table.pages[keep:]):
            if page != FREED:
                self._decref(page)
        del table.pages[keep:]
        table.num_tokens = num_tokens

    def drop_dead_pages(self, table: BlockTable, num_computed: int) -> int:
        """Release the pages no query of this sequence will read again: with a window W, those
        wholly before position num_computed - W + 1. Returns how many were released."""
        if self.window is None:
            return 0
        dead = min(max(0, num_computed - self.window + 1) // self.page_size, len(table.pages))
        for i in range(table.dropped, dead):           # each step looks only at newly dead pages
            self._decref(table.pages[i])
            table.pages[i] = FREED
        newly, table.dropped = max(0, dead - table.dropped), max(dead, table.dropped)
        return newly

    def adopt(self, token_ids: list[int], num_tokens: int, first_page: int) -> BlockTable:
        """A table for a sequence whose K/V rows come from elsewhere (runtime/kv_transfer.py): fresh
        pages for its first `num_tokens` rows, those before page `first_page` left FREED (outside
        the window), the full ones registered in the prefix cache. The caller writes the pages.
        Raises OutOfPages (changing nothing) when the pool cannot supply them."""
        live = self.pages_for(num_tokens) - first_page
        if live > self.num_free:
            raise OutOfPages(f"KV cache is full: need {live} pages, {self.num_free} free")
        table = BlockTable([FREED] * first_page + [self._take() for _ in range(live)], num_tokens, dropped=first_page)
        if self.prefix_caching:       # the chain runs through the dropped pages, which are not registered
            p = self.page_size
            for i in range(first_page):
                table.hashes.append(self._chain(table.hashes[-1] if table.hashes else None, token_ids[i * p:(i + 1) * p]))
            self.register_full_pages(table, token_ids, num_tokens)
        return table

    # -- prefix cache ------------------------------------------------------------------------
    def _chain(self, parent: bytes | None, tokens: list[int]) -> bytes:
        return page_digest(parent, tokens)

    def match_prefix(self, table: BlockTable, token_ids: list[int]) -> int:
        """Fill an empty `table` with the cached pages of the longest cached prefix of `token_ids`
        (full pages only, and never the page holding the last token, whose logits must be
        computed). Returns the number of tokens found."""
        if table.pages:
            raise ValueError("match_prefix needs an empty block table")
        p = self.page_size
        self.stats.queried_tokens += len(token_ids)
        if not self.prefix_caching:
            return 0
        parent = table.salt
        for i in range((len(token_ids) - 1) // p):
            tokens = token_ids[i * p:(i + 1) * p]
            h = self._chain(parent, tokens)
            page = self._by_hash.get(h)
            # The digest only finds the page; its own parent digest and token ids decide the hit.
            if page is None or self._key_of[page] != (parent, tuple(tokens)):
                break
            self._incref(page)
            table.pages.append(page)
            table.hashes.append(h)
            parent = h
        table.num_tokens = len(table.pages) * p
        self.stats.hit_tokens += table.num_tokens
        return table.num_tokens

    def register_full_pages(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        """Register the table's pages that `num_computed` rows have filled, keyed by their tokens."""
        if not self.prefix_caching:
            return
        p = self.page_size
        while (len(table.hashes) + 1) * p <= num_computed:
            i = len(table.hashes)
            parent, tokens = table.hashes[-1] if table.hashes else table.salt, token_ids[i * p:(i + 1) * p]
            h = self._chain(parent, tokens)
            table.hashes.append(h)
            page = table.pages[i]
            if h not in self._by_hash and page not in self._hash_of:
                self._by_hash[h] = page
                self._hash_of[page] = h
                self._key_of[page] = (parent, tuple(tokens))

    def cached_pages(self) -> int:
        return len(self._hash_of)

    # -- invariants (tests) ----------------------------------------------------------------------
    def check(self, tables: list[BlockTable]) -> None:
        """Raise AssertionError unless every page is in exactly one state and reference counts
        equal the number of tables holding each page."""
        held = [0] * self.num_pages
        for table in tables:
            for page in table.pages:
                if page != FREED:
                    held[page] += 1
        assert held == self.refcount, "reference counts differ from the block tables"
        free, idle = set(self._free), set(self._idle)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & idle, "a page is both free and idle"
        for page in range(self.num_pages):
            states = (page in free) + (page in idle) + (self.refcount[page] > 0)
            assert states == 1, f"page {page} is in {states} states"
            assert (page in idle) <= (page in self._hash_of), f"idle page {page} is not cached"
        assert all(self._by_hash[h] == pg for pg, h in self._hash_of.items()), "cache maps disagree"
        assert len(self._by_hash) == len(self._hash_of) == len(self._key_of), "cache maps disagree"
