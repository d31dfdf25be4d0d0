"""kiln's TIR kernels, one folder per device (`cpu/`, `gpu/`), with what both share here: the
weight formats and layouts the kernels read, rope applied as q and k load, and the bridge to TVM's
own kernel factories. Kernels import nothing from the lowering above them."""
