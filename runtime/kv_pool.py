"""The KV page pool: which pages are free, which belong to which sequence.

Pure bookkeeping (no tensors): the page tensors live in the model runner;
this decides page ids and the flat slot of every token (page * page_size + row).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import KilnError


@dataclass
class BlockTable:
    """A sequence's pages in order and how many tokens they hold."""
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise KilnError("the KV memory budget holds no page; give more KV memory")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, table: BlockTable, new_tokens: int) -> list[int]:
        """Extend `table` by `new_tokens` rows; return the flat slot of each new row."""
        total = table.num_tokens + new_tokens
        need = self.pages_for(total) - len(table.pages)
        if need > len(self._free):
            raise KilnError(f"KV cache is full: need {need} more pages, {len(self._free)} free")
        table.pages += [self._free.pop() for _ in range(need)]
        p = self.page_size
        slots = [table.pages[t // p] * p + t % p for t in range(table.num_tokens, total)]
        table.num_tokens = total
        return slots

    def release(self, table: BlockTable) -> None:
        self._free.extend(reversed(table.pages))
        table.pages, table.num_tokens = [], 0
