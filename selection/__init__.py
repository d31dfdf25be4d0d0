"""Kernel selection: which kernel runs each op, chosen in one place, free of TVM.

Per family (attention, MLA, linear, MoE grouped GEMMs) a table of kernel records says what each
kernel can run (`supports(site)`, over a site that describes the op in one kind of step); each target
holds its kernels in order of preference (order.py, `Target.kernels`). The select_kernels pass
(passes/select_kernels.py) records on every such node the first record that supports it, per step
kind (choice.py); codegen emits what is recorded (by name), the compiler gives each step kind whose
kernels differ its own entry, and the manifest and `kiln inspect` report the recorded choices.
Kernels with one form per kind of device (MoE routing, MLA's per-head linear, elementwise ops) are no
choice: codegen builds them for the target's threads.

What a kernel takes (shapes.py), which tensor-core tiles it runs (tiles.py), how it reads a weight
(formats.py) and how the weight is stored for it (layouts.py) live here too, so that a kernel is
chosen only where it runs, and codegen's kernels refuse what the records would not choose.
"""
