"""kiln's CPU kernels: paged attention and the KV append, the packed GEMMs and GEMVs (float, bf16
dot products, int8 activations with AVX2 or AVX-512 VNNI), and the schedules of the kernels TVM
legalises from Relax ops."""
