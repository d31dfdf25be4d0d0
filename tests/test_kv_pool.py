"""The KV page pool: property tests (hypothesis) over random operation sequences, and the prefix
cache, copy-on-write and eviction order on small cases."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runtime.kv_pool import BlockTable, OutOfPages, PagePool

PAGE = 4

ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free", "register"]),
                         st.integers(0, 7), st.integers(1, 9), st.integers(0, 3)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(2, 12))
def test_no_page_is_leaked_or_double_freed(operations, num_pages):
    """After any sequence of allocate / append / fork / free / cache / evict, every page is in
    exactly one state and reference counts equal the block tables holding each page."""
    pool = PagePool(num_pages, PAGE)
    tables: list[tuple[BlockTable, list[int]]] = []        # table, the token ids its rows hold
    for op, which, n, vocab in operations:
        if op == "new":
            ids = [(which + i) % (vocab + 1) for i in range(n + PAGE)]
            table = BlockTable()
            try:
                cached = pool.match_prefix(table, ids)
                pool.grow(table, len(ids) - cached)
            except OutOfPages:
                pool.release(table)
                continue
            tables.append((table, ids))
        elif not tables:
            continue
        else:
            table, ids = tables[which % len(tables)]
            if op == "grow":
                before = (list(table.pages), table.num_tokens)
                try:
                    _, copies = pool.grow(table, n)
                    ids += [which] * n
                    for src, dst in copies:               # a copy goes to a page only this table holds
                        assert pool.refcount[dst] == 1 and dst in table.pages
                except OutOfPages:
                    assert (list(table.pages), table.num_tokens) == before      # nothing changed
            elif op == "fork":
                tables.append((pool.fork(table), list(ids)))
            elif op == "free":
                pool.release(table)
                tables.remove((table, ids))
            elif op == "register":
                pool.register_full_pages(table, ids, table.num_tokens)
        pool.check([t for t, _ in tables])
    for table, _ in tables:
        pool.release(table)
    pool.check([])
    assert pool.num_free == num_pages


def test_prefix_cache_hits_full_pages_only_and_never_the_last_token():
    pool = PagePool(8, PAGE)
    ids = list(range(11))                                  # pages: [0-3] [4-7] [8-10]
    first = BlockTable()
    pool.grow(first, len(ids))
    pool.register_full_pages(first, ids, len(ids))
    second = BlockTable()
    assert pool.match_prefix(second, ids) == 8             # two full pages shared
    assert second.pages == first.pages[:2] and pool.refcount[first.pages[0]] == 2
    third = BlockTable()
    assert pool.match_prefix(third, list(range(8))) == 4  # the page holding the last token is computed
    other = BlockTable()
    assert pool.match_prefix(other, [0, 1, 2, 99, 4, 5, 6, 7, 8]) == 0   # a different first page
    assert pool.stats.hit_tokens == 12


def test_released_cached_pages_are_reused_then_evicted_tail_first():
    pool = PagePool(3, PAGE)
    ids = list(range(9))
    table = BlockTable()
    pool.grow(table, 9)
    pool.register_full_pages(table, ids, 9)
    pool.release(table)
    assert pool.num_free == 3 and pool.cached_pages() == 2
    again = BlockTable()
    assert pool.match_prefix(again, ids) == 8              # still cached while idle
    pool.release(again)
    fresh = BlockTable()
    pool.grow(fresh, 2 * PAGE)                             # one free page, then one eviction
    assert pool.stats.evicted_pages == 1
    head = BlockTable()
    assert pool.match_prefix(head, ids) == 4              # the tail page went first; the head survives


def test_fork_shares_pages_and_copies_the_partial_page_on_first_write():
    pool = PagePool(6, PAGE)
    parent = BlockTable()
    pool.grow(parent, 6)                                   # one full page, one with 2 rows
    child = pool.fork(parent)
    assert child.pages == parent.pages and all(pool.refcount[p] == 2 for p in parent.pages)
    slots, copies = pool.grow(child, 1)
    assert copies == [(parent.pages[1], child.pages[1])] and child.pages[0] == parent.pages[0]
    assert slots == [child.pages[1] * PAGE + 2]
    _, copies = pool.grow(parent, 1)                       # the parent's page is its own again
    assert copies == []
    pool.check([parent, child])


def test_grow_raises_and_changes_nothing_when_pages_run_out():
    pool = PagePool(2, PAGE)
    table = BlockTable()
    pool.grow(table, 8)
    with pytest.raises(OutOfPages):
        pool.grow(table, 1)
    assert table.num_tokens == 8 and len(table.pages) == 2


def test_a_digest_collision_never_reuses_another_prefix_s_page(monkeypatch):
    """Every page digests the same (a forced collision): a lookup finds the cached page by its
    digest, but its token ids (or its parent's) differ, so the page is not reused."""
    from kiln.runtime import kv_pool
    monkeypatch.setattr(kv_pool, "page_digest", lambda parent, tokens: b"collision")
    pool = PagePool(8, PAGE)
    first, ids = BlockTable(), list(range(9))              # pages: [0-3] [4-7] [8]
    pool.grow(first, len(ids))
    pool.register_full_pages(first, ids, len(ids))
    assert pool.cached_pages() == 1                        # the second page's digest is taken
    other = BlockTable()
    assert pool.match_prefix(other, [9, 9, 9, 9, 4]) == 0  # same digest, other tokens: a miss
    same = BlockTable()
    assert pool.match_prefix(same, ids) == 4               # the genuine first page still hits, the
    assert same.pages == first.pages[:1]                   # second (same digest too) does not
    pool.check([first, other, same])


def test_digests_chain_over_the_whole_prefix():
    from kiln.runtime.kv_pool import page_digest
    a, b = page_digest(None, [1, 2, 3, 4]), page_digest(None, [1, 2, 3, 5])
    assert a != b and len(a) == 32
    assert page_digest(a, [5, 6, 7, 8]) != page_digest(b, [5, 6, 7, 8])
    assert page_digest(None, [1 << 40]) != page_digest(None, [0])   # ids wider than 32 bits count
