"""FlashInfer's plans, made on the host once per step before the step's launches.

An artifact compiled with `--attention flashinfer` runs FlashInfer's batch prefill in its steps that
are not plain decodes (the manifest's `flashinfer` record says how). FlashInfer splits each step's
work over thread blocks on the host from the step's row and page counts (its plan), writes that
schedule into an int workspace on the device, and its kernels read it there. kiln plans through the
function the artifact's library exports (`kiln_flashinfer_plan`); one plan per distinct sliding window
of the layers, each with its own int workspace and page-locked host copy; one float workspace for the
split-KV partial outputs. The plans enter the step as inputs (host tensors of FlashInfer's plan info).
Steps whose entry does not run FlashInfer (decode steps: kiln's kernel, in CUDA graphs) get the
same tensors and leave them unread.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .tvm_bridge import device, empty, host_tensor, library_function, pinned_device

PLANNED_STEPS = ("mixed", "prefill")        # the entries whose attention is FlashInfer's (selection/order.py)
PINNED_RING = 3      # a plan's host copy is read by a copy the stream runs later: steps in flight keep theirs


class FlashInferPlanner:
    def __init__(self, record: dict, library: Path, on_device, page_size: int):
        self.record, self.page_size, self.steps = record, page_size, 0
        self.plan = library_function(library, "kiln_flashinfer_plan")
        host = pinned_device(on_device) or device("cpu")
        ws = record["float_workspace"]
        self.workspaces = {ws["input"]: empty((ws["bytes"],), "uint8", on_device)}
        self.pinned = {}
        for p in record["plans"]:
            self.workspaces[p["int_workspace"]] = empty((p["int_workspace_bytes"],), "uint8", on_device)
            self.pinned[p["input"]] = [empty((p["int_workspace_bytes"],), "uint8", host) for _ in range(PINNED_RING)]
        self.float_workspace = self.workspaces[ws["input"]]
        # what steps that do not plan pass: the workspaces and placeholder plans, the same tensors every step
        self.unplanned = {**self.workspaces,
                          **{p["input"]: host_tensor(np.zeros(1, np.int64)) for p in record["plans"]}}

    def inputs(self, step: dict[str, np.ndarray], kind: str) -> dict:
        """The FlashInfer inputs of a step of entry `kind` with the host arrays `step`: planned where
        the entry runs FlashInfer."""
        if kind not in PLANNED_STEPS:
            return self.unplanned
        qo_indptr = step["q_indptr"].astype(np.int32)
        page_indptr = step["page_indptr"].astype(np.int32)
        pages = np.diff(page_indptr)
        kv_lengths = np.where(pages > 0, (pages - 1) * self.page_size + step["last_page_len"], 0).astype(np.int32)
        host = [host_tensor(a) for a in (qo_indptr, page_indptr, kv_lengths)]
        r, planned = self.record, {}
        self.steps += 1
        for p in r["plans"]:
            pinned = self.pinned[p["input"]][self.steps % PINNED_RING]
            info = self.plan(self.float_workspace, self.workspaces[p["int_workspace"]], pinned,
                             *host, int(qo_indptr[-1]), len(pages), r["q_heads"], r["kv_heads"], self.page_size,
                             r["head_dim"], p["window_left"])
            planned[p["input"]] = host_tensor(np.array(list(info), np.int64))
        return {**self.workspaces, **planned}
