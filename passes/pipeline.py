"""The pass manager and the pipeline: passes run in order, the graph is verified after each.

The list is empty in this first cut (the graph the frontend builds is what
codegen lowers); fusion, quantisation and KV-layout passes join it here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kiln.ir import Graph, verify

Pass = Callable[[Graph], Graph]


@dataclass
class PassRecord:
    name: str
    seconds: float


def pipeline_for(target_name: str) -> list[tuple[str, Pass]]:
    """The passes for a target, in order."""
    return []


def run_pipeline(graph: Graph, target_name: str, dump: Callable[[str, Graph], None] | None = None
                 ) -> tuple[Graph, list[PassRecord]]:
    verify(graph)
    records = []
    for name, rewrite in pipeline_for(target_name):
        t0 = time.perf_counter()
        graph = verify(rewrite(graph))
        records.append(PassRecord(name, time.perf_counter() - t0))
        if dump:
            dump(name, graph)
    return graph, records
