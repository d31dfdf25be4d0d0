"""kiln's CUDA kernels, written as CUDA source called from TIR: paged attention, the tensor-core
GEMM and the decode GEMV, with their offline tuning tables."""
