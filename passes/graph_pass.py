"""The one form every pass takes: a dataclass whose fields are its options, with a `name` (what
--print-after, --disable-pass and the pass records call it) and a `rewrite` of the graph. Calling
the pass rewrites a copy: the graph it was given stays as it was (tests compare the two)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph

from .rewrite import editable_copy


@dataclass(frozen=True)
class GraphPass:
    name: ClassVar[str] = ""

    def __call__(self, graph: Graph) -> Graph:
        return self.rewrite(editable_copy(graph))

    def rewrite(self, graph: Graph) -> Graph:
        """The rewritten graph, from `graph`: a copy this pass may edit in place."""
        raise NotImplementedError(f"{type(self).__name__} names no rewrite")
