"""kiln's mixture-of-experts kernels (ir/moe_ops.py), for the CPU and, with GPU thread bindings,
for CUDA and the other GPU targets.

moe_router is one kernel: a task per token computes its scores, masks groups, picks the top_k
and writes its dense routing row. moe_experts is four steps:
  1. plan      routing [T, E] -> rows grouped by expert: row_token, row_expert, row_weight [T·k]
               and, per token, its rows token_rows [T, k] in expert order (-1: none). One serial
               task, O(T·E) comparisons.
  2. gate_up   h[r] = x[row_token[r]] @ gate_up[row_expert[r]].T, then act(gate) * up
  3. down      y[r] = round(h[r] @ down[row_expert[r]].T) * row_weight[r]
  4. combine   out[t] = sum of y[token_rows[t, :]] in float32, rounded once
Steps 2 and 3 are grouped GEMMs: only the chosen experts' weights are read (a decode step of one
token reads k experts), and rows of one expert are adjacent, so on the CPU a tile of rows reads
each block of its expert's packed weight panel once (codegen/kernels/cpu/packed_linear.py schedule_packed), and on
CUDA a thread block multiplies its rows on tensor cores once per expert among them. Rows
past the routed ones (a token routed to fewer than k experts) repeat the last row's expert with
weight 0, so they read no other expert's weights and add nothing.
"""
from __future__ import annotations

import functools

from tvm import te
from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat

from .tir_values import LOWEST
from .weight_format import epilogue_scale, weight_value


def _tasks(gpu: bool):
    """A CPU thread, or a GPU thread block, per task."""
    return (lambda n: T.thread_binding(n, thread="blockIdx.x")) if gpu else T.parallel


@functools.cache
def router_kernel(experts: int, scheme: str, top_k: int, normalize: bool, scaling: float, n_group: int,
                  topk_group: int, gpu: bool):
    """moe_router over f32 logits [T, E] (and the score-correction bias f32[E] for sigmoid_group_top2)."""
    E, k, per_group = experts, top_k, experts // n_group
    softmax_first = scheme in ("softmax_topk", "softmax_group_max")
    grouped = scheme in ("softmax_group_max", "sigmoid_group_top2") and n_group > 1
    scope = "local" if gpu else "global"
    tasks = _tasks(gpu)

    @T.macro
    def route(logits, bias, out, tokens):
        for t in tasks(tokens):
            with T.sblock("route"):
                tt = T.axis.spatial(tokens, t)
                T.reads(logits[tt, 0:E], *([] if bias is None else [bias[0:E]]))
                T.writes(out[tt, 0:E])
                scores = T.sblock_alloc_buffer((E,), "float32", scope=scope)
                choice = T.sblock_alloc_buffer((E,), "float32", scope=scope)
                chosen = T.sblock_alloc_buffer((k,), "int32", scope=scope)
                weight = T.sblock_alloc_buffer((k,), "float32", scope=scope)
                group = T.sblock_alloc_buffer((n_group,), "float32", scope=scope)
                keep = T.sblock_alloc_buffer((n_group,), "int32", scope=scope)
                acc = T.sblock_alloc_buffer((2,), "float32", scope=scope)
                best = T.sblock_alloc_buffer((1,), "int32", scope=scope)
                if softmax_first:
                    acc[0] = T.float32(LOWEST)
                    for e in range(E):
                        acc[0] = T.max(acc[0], logits[tt, e])
                    acc[1] = T.float32(0)
                    for e in range(E):
                        scores[e] = T.exp(logits[tt, e] - acc[0])
                        acc[1] = acc[1] + scores[e]
                    for e in range(E):
                        scores[e] = scores[e] / acc[1]
                elif scheme == "sigmoid_group_top2":
                    for e in range(E):
                        scores[e] = T.float32(1) / (T.float32(1) + T.exp(T.float32(0) - logits[tt, e]))
                else:
                    for e in range(E):
                        scores[e] = logits[tt, e]
                for e in range(E):
                    choice[e] = scores[e] if bias is None else scores[e] + bias[e]
                if grouped:
                    for g in range(n_group):        # a group's score: its best, or its best two
                        acc[0] = T.float32(LOWEST)
                        acc[1] = T.float32(LOWEST)
                        for i in range(per_group):
                            v = choice[g * per_group + i]
                            if v > acc[0]:
                                acc[1] = acc[0]
                                acc[0] = v
                            elif v > acc[1]:
                                acc[1] = v
                        group[g] = acc[0] if scheme == "softmax_group_max" else acc[0] + acc[1]
                        keep[g] = 0
                    for _ in range(topk_group):
                        best[0] = -1
                        for g in range(n_group):
                            if keep[g] == 0 and (best[0] < 0 or group[g] > group[T.max(best[0], 0)]):
                                best[0] = g
                        keep[T.max(best[0], 0)] = 1
                    for e in range(E):
                        if keep[e // per_group] == 0:
                            choice[e] = T.float32(LOWEST)
                for j in range(k):                  # the k best, ties to the lower expert
                    best[0] = -1
                    for e in range(E):
                        if choice[e] > T.float32(LOWEST) and (best[0] < 0 or choice[e] > choice[T.max(best[0], 0)]):
                            best[0] = e
                    chosen[j] = best[0]
                    if best[0] >= 0:
                        weight[j] = scores[best[0]]
                        choice[best[0]] = T.float32(LOWEST)
                    else:
                        weight[j] = T.float32(0)
                if scheme == "topk_softmax":        # softmax over the k chosen logits
                    acc[1] = T.float32(0)
                    for j in range(k):
                        weight[j] = T.exp(weight[j] - scores[T.max(chosen[0], 0)])
                        acc[1] = acc[1] + weight[j]
                    for j in range(k):
                        weight[j] = weight[j] / acc[1]
                if normalize:
                    acc[1] = T.float32(0)
                    for j in range(k):
                        acc[1] = acc[1] + weight[j]
                    if scheme == "sigmoid_group_top2":
                        acc[1] = acc[1] + T.float32(1e-20)
                    for j in range(k):
                        weight[j] = weight[j] / acc[1]
                for e in range(E):
                    out[tt, e] = T.float32(0)
                for j in range(k):
                    if chosen[j] >= 0:
                        out[tt, chosen[j]] = weight[j] * T.float32(scaling)

    if scheme != "sigmoid_group_top2":   # only the form asked for is parsed
        @T.prim_func(private=True, s_tir=True)
        def moe_router(var_logits: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            tokens = T.int64()
            logits = T.match_buffer(var_logits, (tokens, E), "float32")
            out = T.match_buffer(var_out, (tokens, E), "float32")
            route(logits, None, out, tokens)
        return moe_router

    @T.prim_func(private=True, s_tir=True)
    def moe_router_biased(var_logits: T.handle, var_bias: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        tokens = T.int64()
        logits = T.match_buffer(var_logits, (tokens, E), "float32")
        bias = T.match_buffer(var_bias, (E,), "float32")
        out = T.match_buffer(var_out, (tokens, E), "float32")
        route(logits, bias, out, tokens)

    return moe_router_biased


@functools.cache
def plan_kernel(experts: int, top_k: int, gpu: bool):
    """routing f32[T, E] -> row_token, row_expert i32[T·k], row_weight f32[T·k], token_rows i32[T, k]."""
    E, k = experts, top_k
    scope = "local" if gpu else "global"
    tasks = _tasks(gpu)

    @T.prim_func(private=True, s_tir=True)
    def moe_plan(var_routing: T.handle, var_row_token: T.handle, var_row_expert: T.handle,
                 var_row_weight: T.handle, var_token_rows: T.handle):
        T.func_attr({"tirx.noalias": True})
        tokens = T.int64()
        routing = T.match_buffer(var_routing, (tokens, E), "float32")
        row_token = T.match_buffer(var_row_token, (tokens * k,), "int32")
        row_expert = T.match_buffer(var_row_expert, (tokens * k,), "int32")
        row_weight = T.match_buffer(var_row_weight, (tokens * k,), "float32")
        token_rows = T.match_buffer(var_token_rows, (tokens, k), "int32")
        for task in tasks(1):
            with T.sblock("plan"):
                T.reads(routing[0:tokens, 0:E])
                T.writes(row_token[0:tokens * k], row_expert[0:tokens * k], row_weight[0:tokens * k],
                         token_rows[0:tokens, 0:k])
                n = T.sblock_alloc_buffer((2,), "int32", scope=scope)      # rows so far, placed
                for t in range(tokens):
                    for j in range(k):
                        token_rows[t, j] = -1
                n[0] = 0
                for e in range(E):
                    for t in range(tokens):
                        if routing[t, e] > T.float32(0):
                            n[1] = 0
                            for j in range(k):          # the token's first free slot
                                if n[1] == 0 and token_rows[t, j] < 0:
                                    token_rows[t, j] = n[0]
                                    n[1] = 1
                            if n[1] == 1:
                                row_token[n[0]] = T.Cast("int32", t)
                                row_expert[n[0]] = e
                                row_weight[n[0]] = routing[t, e]
                                n[0] = n[0] + 1
                for r in range(tokens * k):             # unrouted rows: the last expert again, weight 0
                    if r >= T.Cast("int64", n[0]):
                        row_token[r] = 0
                        row_expert[r] = T.if_then_else(n[0] > 0, row_expert[T.max(n[0] - 1, 0)], 0)
                        row_weight[r] = T.float32(0)

    return moe_plan


class _ExpertScale:
    """One expert's scales seen as a 2-D (or 1-D) tensor, for WeightFormat.value."""

    def __init__(self, scale, expert):
        self.scale, self.expert = scale, expert

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        return self.scale[(self.expert, *index)]


def grouped_gemm(x, rows, w, scale, row_weight, n_out: int, n_in: int, nb: int | None, dtype: str,
                  fmt: WeightFormat, gather: bool):
    """y[r, j] = sum_k X[r, k] W_e[j, k] for e = row_expert[r]; X[r] = x[row_token[r]] when `gather`.
    Rounded to dtype, then × row_weight[r] and rounded again when given."""
    row_token, row_expert = rows
    n_rows = row_expert.shape[0]
    red = te.reduce_axis((0, n_in), "k")

    def weight(r, j, kk):
        e = row_expert[r]
        load = (lambda jj, k2: w[e, jj // nb, k2, jj % nb]) if nb else (lambda jj, k2: w[e, jj, k2])
        return weight_value(fmt, load, None if scale is None else _ExpertScale(scale, e), j, kk)

    acc = te.compute((n_rows, n_out), lambda r, j: te.sum(
        (x[row_token[r], red] if gather else x[r, red]).astype("float32") * weight(r, j, red), axis=red), name="acc")

    def epilogue(r, j):
        y = acc[r, j]
        if epilogue_scale(fmt, scale) is not None:
            y = y * scale[row_expert[r], j]
        y = y.astype(dtype)
        if row_weight is not None:
            y = (y.astype("float32") * row_weight[r]).astype(dtype)
        return y
    return te.compute((n_rows, n_out), epilogue, name="y")


@functools.cache
def combine_kernel(hidden: int, top_k: int, dtype: str, gpu: bool):
    """out[t, j] = sum over the token's rows of y[row, j], in float32, rounded once; a task per token."""
    scope = "local" if gpu else "global"
    tasks = _tasks(gpu)
    lanes = 16 if hidden % 16 == 0 and not gpu else 1      # vectors on the CPU, scalars in a GPU thread
    lane = T.serial if gpu else T.vectorized

    @T.prim_func(private=True, s_tir=True)
    def moe_combine(var_y: T.handle, var_token_rows: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        tokens, rows = T.int64(), T.int64()
        y = T.match_buffer(var_y, (rows, hidden), dtype)
        token_rows = T.match_buffer(var_token_rows, (tokens, top_k), "int32")
        out = T.match_buffer(var_out, (tokens, hidden), dtype)
        for t in tasks(tokens):
            with T.sblock("combine"):
                tt = T.axis.spatial(tokens, t)
                T.reads(y[0:rows, 0:hidden], token_rows[tt, 0:top_k])
                T.writes(out[tt, 0:hidden])
                acc = T.sblock_alloc_buffer((hidden,), "float32", scope=scope)
                for jo in range(hidden // lanes):
                    for ji in lane(lanes):
                        acc[jo * lanes + ji] = T.float32(0)
                for slot in range(top_k):
                    if token_rows[tt, slot] >= 0:
                        for jo in range(hidden // lanes):
                            for ji in lane(lanes):
                                acc[jo * lanes + ji] = acc[jo * lanes + ji] + T.Cast(
                                    "float32", y[token_rows[tt, slot], jo * lanes + ji])
                for jo in range(hidden // lanes):
                    for ji in lane(lanes):
                        out[tt, jo * lanes + ji] = T.Cast(dtype, acc[jo * lanes + ji])

    return moe_combine
