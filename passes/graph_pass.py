"""The one form every pass takes: a dataclass whose fields are its options, with a `name` (what
--print-after, --disable-pass and the pass records call it) and `__call__(graph) -> graph`, which
rewrites a copy and leaves the graph it was given as it was."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph


@dataclass(frozen=True)
class GraphPass:
    name: ClassVar[str] = ""

    def __call__(self, graph: Graph) -> Graph:
        raise NotImplementedError(f"{type(self).__name__} names no rewrite")
