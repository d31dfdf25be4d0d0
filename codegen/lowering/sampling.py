"""Token sampling as Relax functions, compiled with the model so it runs where the logits are.

The functions compute exactly the draw `runtime/sampler.py` defines (its module docstring has the
definition), so on the same logits and the same uniform number they pick the same token:

    apply_penalties(logits f32[r, v], rows i32[s], pen_rows i32[n], pen_tokens i32[n],
                    pen_bias f64[n], pen_repetition f64[n], pen_subtract f64[n]) -> f32[s, v]
        The processed logits of the sampled rows: row i is logits[rows[i]], and entry e rewrites
        token pen_tokens[e] of row pen_rows[e] (an index into the s rows) as
        ((x + bias) / rep if x + bias > 0 else (x + bias) * rep) - subtract, in float64, rounded
        to float32. Entries are unique per (row, token); a masked stop id has bias -inf.
    sample_greedy(logits f32[r, v], rows i32[s]) -> i32[s]
        argmax of logits[rows[i]], ties -> lowest id.
    sample_plain(logits, rows, temperature f64[s], min_p f64[s], uniform f64[s]) -> i32[s]
        temperature, min-p and the draw; no sort (rows without top-k or top-p).
    sample_sorted(logits, rows, temperature, top_k i32[s], top_p f64[s], min_p, uniform) -> i32[s]
        as sample_plain, after top-k (0 = off) and top-p (1 = off) thresholds found on the
        row sorted by value.
    token_logprobs(logits, rows, tokens i32[s]) -> (top_ids i32[s, K], top_logprobs f64[s, K],
                                                   token_logprob f64[s])
        log-softmax of logits[rows[i]]: its K largest entries (K = min(20, vocab)) and the entry of
        tokens[i].
    apply_token_mask(logits, rows, bitmask i32[s, w]) -> f32[s, v]
        logits[rows[i]] with every token whose bit (bit t % 32 of word t // 32) is clear set to
        -inf: a structured output's grammar mask (runtime/grammar.py), applied before the draw.

Every dim is symbolic but K. Weights, sums and thresholds are float64 (COMPUTE_DTYPE), as in NumPy,
so the cumulative sums the draw searches agree with NumPy's to ~1e-16 and only a uniform that lands
that close to a boundary can pick differently (in float32, with float32 uniforms, 80 of 640 draws
from random logits over 128256 tokens differed). On GPU targets the default pipeline dispatches sort and cumsum to
GPU kernels (DispatchSortScan) and dlight schedules the rest. Launches per call at vocab 128256:
greedy 2, plain 7, sorted 25 (a merge sort of 12, two 3-launch scans), penalties 2, logprobs 18.
"""
from __future__ import annotations

import tvm
from tvm import relax, te, tirx, topi
from tvm.script import tirx as T

from kiln.interface import MAX_LOGPROBS, SAMPLER_FUNCTIONS

COMPUTE_DTYPE = "float64"


def _f(value) -> tirx.PrimExpr:
    return tirx.const(value, COMPUTE_DTYPE)


def _scaled(value, temperature, i):
    return value.astype(COMPUTE_DTYPE) / temperature[i]


def _let(name: str, value, body):
    """body(v) with v bound to value once: a float64 divide or exp is not recomputed per use."""
    var = tirx.Var(name, value.ty)
    return tirx.Let(var, value, body(var))


def _kept_weight(value, zmax, temperature, i, keep):
    """The weight of logit `value` of row i if keep(weight), else 0: with z = value / temperature[i],
    exp(z - zmax), exactly 1 where z is the maximum (+inf included) and 0 in a row of -inf."""
    def weight(z):
        top = tirx.Select(zmax > _f(float("-inf")), _f(1.0), _f(0.0))
        return _let("e", tirx.Select(z == zmax, top, tirx.exp(z - zmax)),
                    lambda e: tirx.Select(keep(e), e, _f(0.0)))
    return _let("z", _scaled(value, temperature, i), weight)


# ---------------------------------------------------------------------------- TE kernels
# On GPUs dlight schedules a reduction over the vocab only in the shapes its rules know: a max/min
# reduction followed by an elementwise epilogue (GeneralReduction), inputs read at affine indices
# (rows gathered first, row totals computed apart). Anything else falls back to one thread per row.

def _gather_rows(logits, rows):
    """x[i, t] = logits[rows[i], t]. [s, v] f32"""
    return te.compute((rows.shape[0], logits.shape[1]), lambda i, t: logits[rows[i].astype("int64"), t],
                      name="gather_rows")


def _masked(x, bitmask):
    """x where the token's bit is set, else -inf. [s, v] f32"""
    def keep(i, t):
        word = bitmask[i, t // 32]
        allowed = ((word >> (t % 32).astype("int32")) & 1) == 1
        return tirx.Select(allowed, x[i, t], tirx.const(float("-inf"), "float32"))
    return te.compute(x.shape, keep, name="masked")


def _greedy(x):
    """argmax of each row, ties -> lowest id (TVM's argmax reducer), and 0 for a row of -inf. [s] i32"""
    best = topi.argmax(x, axis=1)
    return te.compute(best.shape, lambda i: tirx.max(best[i], 0).astype("int32"), name="greedy")


def _scaled_max(x, temperature):
    """zmax[i] = max_t x[i, t] / temperature[i], in float64. A row of -inf gives the lowest finite
    float (te.max's start), whose weights come out 0 as they should. [s] f64"""
    t = te.reduce_axis((0, x.shape[1]), "t")
    top = te.compute((x.shape[0],), lambda i: te.max(x[i, t], axis=t), name="row_max")
    return te.compute(top.shape, lambda i: _scaled(top[i], temperature, i), name="zmax")


def _plain_weights(x, zmax, temperature, min_p):
    """w[i, t]: the token's weight if min-p keeps it, else 0. [s, v] f64"""
    return te.compute(x.shape, lambda i, t: _kept_weight(x[i, t], zmax[i], temperature, i, lambda e: e >= min_p[i]),
                      name="plain_weights")


def _kth(sx, top_k, i):
    """The top_k[i]-th largest value of sorted row i (the smallest when top-k is off)."""
    v = sx.shape[1]
    k = top_k[i].astype("int64")
    return sx[i, tirx.Select(tirx.any(k <= 0, k >= v), v, k) - 1]


def _sorted_topk_weights(sx, temperature, top_k):
    """Over the row sorted best first: each value's weight if top-k keeps it, else 0. [s, v] f64"""
    def w(i, j):
        return _let("zmax", _scaled(sx[i, 0], temperature, i), lambda zmax: _kept_weight(
            sx[i, j], zmax, temperature, i, lambda e: sx[i, j] >= _kth(sx, top_k, i)))
    return te.compute(sx.shape, w, name="topk_weights")


def _part_of_total(cdf, fraction):
    """fraction[i] * cdf[i, v - 1]: a share of each row's total weight. [s] f64"""
    last = cdf.shape[1] - 1
    return te.compute(fraction.shape, lambda i: fraction[i] * cdf[i, last], name="part_of_total")


def _threshold(sorted_cdf, bound, sx, top_k, top_p):
    """The least value each row keeps: the top-k one, raised to the value at the first sorted
    position whose cumulative weight reaches bound[i] when top-p is on. [s] f32"""
    s, v = sorted_cdf.shape
    j = te.reduce_axis((0, v), "j")
    first = te.compute((s,), lambda i: te.min(tirx.Select(sorted_cdf[i, j] >= bound[i], j, v - 1), axis=j),
                       name="nucleus_end")

    def threshold(i):
        kth = _kth(sx, top_k, i)
        return tirx.Select(top_p[i] >= _f(1.0), kth, tirx.max(kth, sx[i, first[i]]))
    return te.compute((s,), threshold, name="threshold")


def _sorted_weights(x, sx, threshold, temperature, min_p):
    """w[i, t]: the token's weight if x >= the row's threshold and min-p keeps it, else 0. [s, v] f64"""
    def w(i, t):
        return _let("zmax", _scaled(sx[i, 0], temperature, i), lambda zmax: _kept_weight(
            x[i, t], zmax, temperature, i, lambda e: tirx.all(x[i, t] >= threshold[i], e >= min_p[i])))
    return te.compute(x.shape, w, name="sorted_weights")


def _inverse_cdf(w, cdf, target):
    """The first kept token whose cumulative weight exceeds target[i], else the last kept one, else
    (no weight at all: a row of -inf) token 0. [s] i32

    One min-reduction over keys: kept tokens past the target key as their id (< v), other kept
    tokens as 2v - 1 - id (the last kept one is the smallest of those), dropped tokens as 2v."""
    s, v = w.shape
    t = te.reduce_axis((0, v), "t")

    def key(i):
        passed = tirx.Select(cdf[i, t] > target[i], t, 2 * v - 1 - t)
        return tirx.Select(w[i, t] > _f(0.0), passed, 2 * v)
    keys = te.compute((s,), lambda i: te.min(key(i), axis=t), name="pick_key")

    def pick(i):
        k = keys[i]
        return tirx.Select(k < v, k, tirx.Select(k < 2 * v, 2 * v - 1 - k, tirx.const(0, "int64"))).astype("int32")
    return te.compute((s,), pick, name="pick")


def _log_normaliser(x):
    """logsumexp of each row, in float64: max + log(sum(exp(x - max))). [s] f64"""
    s, v = x.shape
    t = te.reduce_axis((0, v), "t")
    m = te.compute((s,), lambda i: te.max(x[i, t], axis=t), name="row_max")
    t2 = te.reduce_axis((0, v), "t2")
    total = te.compute((s,), lambda i: te.sum(tirx.exp(x[i, t2].astype(COMPUTE_DTYPE) - m[i].astype(COMPUTE_DTYPE)),
                                              axis=t2), name="sum_exp")
    return te.compute((s,), lambda i: m[i].astype(COMPUTE_DTYPE) + tirx.log(total[i]), name="logz")


def _logprobs_of(values, logz):
    return te.compute(values.shape, lambda i, j: values[i, j].astype(COMPUTE_DTYPE) - logz[i], name="top_logprobs")


def _token_logprob(x, tokens, logz):
    return te.compute(tokens.shape, lambda i: x[i, tokens[i].astype("int64")].astype(COMPUTE_DTYPE) - logz[i],
                      name="token_logprob")


@T.prim_func(private=True, s_tir=True)
def _penalize(var_x: T.handle, var_rows: T.handle, var_tokens: T.handle, var_bias: T.handle,
              var_rep: T.handle, var_sub: T.handle):
    """In place: x[row, token] = ((x + bias) / rep if x + bias > 0 else (x + bias) * rep) - sub.

    Entries are unique per (row, token), so each element has one reader-writer. The block lists x
    among its writes only: a block that reads and writes one buffer cannot be bound to GPU threads,
    and the read is of the very element it writes."""
    s, v, n = T.int64(), T.int64(), T.int64()
    x = T.match_buffer(var_x, (s, v), "float32")
    rows = T.match_buffer(var_rows, (n,), "int32")
    tokens = T.match_buffer(var_tokens, (n,), "int32")
    bias = T.match_buffer(var_bias, (n,), "float64")
    rep = T.match_buffer(var_rep, (n,), "float64")
    sub = T.match_buffer(var_sub, (n,), "float64")
    for e in range(n):
        with T.sblock("penalize"):
            ve = T.axis.spatial(n, e)
            T.reads(rows[ve], tokens[ve], bias[ve], rep[ve], sub[ve])
            T.writes(x[T.Cast("int64", rows[ve]), T.Cast("int64", tokens[ve])])
            biased = T.Cast("float64", x[T.Cast("int64", rows[ve]), T.Cast("int64", tokens[ve])]) + bias[ve]
            x[T.Cast("int64", rows[ve]), T.Cast("int64", tokens[ve])] = T.Cast(
                "float32", T.if_then_else(biased > T.float64(0), biased / rep[ve], biased * rep[ve]) - sub[ve])


# ---------------------------------------------------------------------------- Relax functions

def _tensor(name: str, shape, dtype: str) -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, dtype))


def add_sampling_functions(mod: tvm.IRModule, vocab_size: int | None = None) -> tvm.IRModule:
    """Return `mod` with the sampling functions added (before the target's Relax pipeline runs).

    `vocab_size`, when known, bounds the logprobs' K (min(20, vocab))."""
    top = MAX_LOGPROBS if vocab_size is None else min(MAX_LOGPROBS, vocab_size)
    r, v, s, n = (tirx.Var(name, "int64") for name in ("r", "v", "s", "n"))
    bb = relax.BlockBuilder(mod)

    def define(key: str, body, *extra: tuple[str, tuple, str]) -> None:
        """Add SAMPLER_FUNCTIONS[key](logits f32[r, v], rows i32[s], *extra) returning body(x, *extra),
        x being the gathered rows f32 [s, v]."""
        params = [_tensor("logits", (r, v), "float32"), _tensor("rows", (s,), "int32"),
                  *(_tensor(name, shape, dtype) for name, shape, dtype in extra)]
        with bb.function(SAMPLER_FUNCTIONS[key], params):
            with bb.dataflow():
                out = bb.emit_output(body(call(_gather_rows, *params[:2]), *params[2:]))
            bb.emit_func_output(out)

    def row(name: str, dtype: str = COMPUTE_DTYPE):
        return name, (s,), dtype

    def call(fn, *args):
        return bb.emit_te(fn, *args, primfunc_name_hint=fn.__name__.lstrip("_"))

    def draw(w, uniform):
        """The token of each row that uniform picks by inverse CDF over weights w [s, v]."""
        cdf = bb.emit(relax.op.cumsum(w, axis=1))
        return call(_inverse_cdf, w, cdf, call(_part_of_total, cdf, uniform))

    def penalties(x, *entries):
        gv = bb.add_func(_penalize.with_attr("op_pattern", 8), "penalize")
        return relax.call_tir_inplace(gv, [x, *entries], 0, relax.TensorType((s, v), "float32"))

    def greedy(x):
        return call(_greedy, x)

    def plain(x, temperature, min_p, uniform):
        return draw(call(_plain_weights, x, call(_scaled_max, x, temperature), temperature, min_p), uniform)

    def sorted_(x, temperature, top_k, top_p, min_p, uniform):
        sx = bb.emit(relax.op.sort(x, axis=1, descending=True))
        sorted_cdf = bb.emit(relax.op.cumsum(call(_sorted_topk_weights, sx, temperature, top_k), axis=1))
        threshold = call(_threshold, sorted_cdf, call(_part_of_total, sorted_cdf, top_p), sx, top_k, top_p)
        return draw(call(_sorted_weights, x, sx, threshold, temperature, min_p), uniform)

    def logprobs(x, tokens):
        logz = call(_log_normaliser, x)
        best = bb.emit(relax.op.topk(x, k=top, axis=1, ret_type="both", largest=True, dtype="int32"))
        values, ids = bb.emit(relax.TupleGetItem(best, 0)), bb.emit(relax.TupleGetItem(best, 1))
        return relax.Tuple([ids, call(_logprobs_of, values, logz), call(_token_logprob, x, tokens, logz)])

    define("penalties", penalties, ("pen_rows", (n,), "int32"), ("pen_tokens", (n,), "int32"),
           *((f"pen_{k}", (n,), "float64") for k in ("bias", "repetition", "subtract")))
    define("greedy", greedy)
    define("plain", plain, row("temperature"), row("min_p"), row("uniform"))
    define("sorted", sorted_, row("temperature"), row("top_k", "int32"), row("top_p"), row("min_p"), row("uniform"))
    define("logprobs", logprobs, row("tokens", "int32"))
    define("mask", lambda x, bitmask: call(_masked, x, bitmask), ("bitmask", (s, tirx.Var("w", "int64")), "int32"))
    return bb.get()
