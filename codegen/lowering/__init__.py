"""Lowering, one module per op family: each emits the Relax calls of its IR ops, choosing a kernel
from `codegen/kernels/` by the target's capabilities, the step kind and the layer's KV spec."""
