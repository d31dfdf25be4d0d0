"""float32 exp on LLVM CPU targets as inline arithmetic that vectorises, in place of libm.

TVM lowers `exp` to LLVM's exp intrinsic, which LLVM turns into one libm `expf` call per lane: a
vectorised SwiGLU or softmax loop stops at every element for a call. kiln registers its own
lowering for float32 (scalars and vectors) on the llvm target instead:
  - x clamped to [-87.33, 88] (exp stays a normal float32; 88 keeps 2^n finite);
  - n = round(x / ln 2), r = x - n ln 2 in two parts (Cody–Waite: n ln2_hi is exact), |r| ≤ ln2 / 2;
  - e^r from a degree-6 polynomial (Cephes' expf coefficients, error within 2 ulp over the range);
  - 2^n built in the exponent bits, times e^r.
Other dtypes keep TVM's lowering. Below -87.33 the result is the smallest normal float32 (~1e-38),
not 0: a softmax weight or sigmoid that small adds nothing a float32 sum can see.
"""
from __future__ import annotations

import tvm
from tvm import tirx

LOW, HIGH = -87.33654475, 88.0
LOG2E, LN2_HI, LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
LEVEL = 200                        # above TVM's own rules for llvm


def _exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    lanes = x.ty.dtype.lanes

    def c(value, dtype="float32"):
        scalar = tirx.const(value, dtype)
        return scalar if lanes == 1 else tirx.Broadcast(scalar, lanes)

    x = tirx.max(tirx.min(x, c(HIGH)), c(LOW))
    n = tirx.floor(x * c(LOG2E) + c(0.5))
    r = x - n * c(LN2_HI) - n * c(LN2_LO)
    p = c(POLY[0])
    for coefficient in POLY[1:]:
        p = p * r + c(coefficient)
    e_r = p * r * r + r + c(1.0)
    int_type = "int32" if lanes == 1 else f"int32x{lanes}"
    float_type = "float32" if lanes == 1 else f"float32x{lanes}"
    bits = (tirx.Cast(int_type, n) + c(127, "int32")) << c(23, "int32")
    return e_r * tirx.call_intrin(float_type, "tirx.reinterpret", bits)


_tvm_lowering = None                # TVM's llvm rule, for the dtypes kiln leaves to it


def _lower_exp(call: tirx.Call):
    (x,) = call.args
    if str(x.ty.dtype).startswith("float32"):
        return _exp(x)
    return _tvm_lowering(call)


def register_exp_lowering() -> None:
    """Lower float32 exp as above in every llvm build of this process (once)."""
    global _tvm_lowering
    if _tvm_lowering is None:
        _tvm_lowering = tvm.ir.Op.get("tirx.exp").get_attr("llvm.FLowerIntrinsic")
        tirx.op.register_intrin_lowering("tirx.exp", target="llvm", f=_lower_exp, level=LEVEL)
