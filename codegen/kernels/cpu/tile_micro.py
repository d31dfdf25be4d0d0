"""kiln's AMX tile micro-kernels, written as LLVM IR and linked into the artifact, and the check
that comes before them.

Intel AMX (Sapphire Rapids and later Xeons) holds eight tiles of up to 16 rows × 64 bytes and
multiplies them whole: `tdpbf16ps` adds A [rows × 32 bf16] · B [16 pairs × 16 columns × 2 bf16]
into C [rows × 16 float32], 8,192 multiply-adds per instruction, where AVX-512 BF16's `vdpbf16ps`
does 32. B's rows are bf16 pairs of 16 columns side by side: layout packedNBx2's rows
(selection/layouts.py), so a panel of the weights bf16dot reads is already a run of B tiles, 2·nb
bf16 apart. TVM 0.27 has no tile types in TIR; its bundled LLVM compiles LLVM's tile intrinsics
(`llvm.x86.*.internal`, values of type x86_amx) and configures the tiles itself (ldtilecfg,
tilerelease). So kiln writes the micro-kernels as LLVM IR text, as it does the bf16 dots
(codegen/kernels/cpu/bf16_micro.py), and its TIR kernels call them:

    kiln_amx_bf16_{R}x{C}(acc, acc_stride, x, x_stride, w, w_stride, rows, steps):
    acc[i, j] += Σ_k x[i, k] · w[k, j]   for i < rows (at most 16·R), j < 16·C, k < 32·steps

with C tiles of acc held across the steps, R tiles of x rows and C tiles of w columns loaded per
step (R = C = 2: all eight tiles; each tile loaded serves two products). Strides are in bytes.

Linux hands a process the tile state only after it asks (kiln/cpu_tiles.py). `kiln_tiles_ready()`
asks once (KILN_CPU_TILES=off answers no without asking), remembers the answer, and the kernels run
their AVX-512 micro-kernels where it is no: an artifact with tile kernels runs on any CPU with the
rest of its instruction sets.

Both are hidden in the library (called by its kernels alone): each artifact loaded in a process
asks through its own, emulated or not.

Emulated tiles (`emulated=True`): the same IR with every tile instruction a call to a scalar
function of the same meaning (a tile a <256 x i32> value), and kiln_tiles_ready() yes without asking
Linux: the kernels' addressing, loops and fallbacks run and are tested on CPUs without AMX.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import tvm

from kiln.cpu_tiles import ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, OFF, OFF_SWITCH, XFEATURE_XTILEDATA

TILE_ROWS, TILE_BYTES = 16, 64            # a tile's most rows and bytes per row
BF16_STEP = TILE_BYTES // 2               # inputs one tdpbf16ps reduces over (32 bf16)
QUAD_BYTES = 4                            # a B tile row of tdpbssd: 4 bytes (inputs) of each of 16 columns
READY = "kiln_tiles_ready"
TILE_FEATURES = "+amx-tile,+amx-bf16,+amx-int8"


def bf16_name(row_tiles: int, col_tiles: int) -> str:
    return f"kiln_amx_bf16_{row_tiles}x{col_tiles}"


def int8_name(row_tiles: int, col_tiles: int, block: int, weights: str = "s8") -> str:
    """weights "s8": signed bytes (tdpbssd), "u8": unsigned (tdpbsud); x's are signed in both."""
    return f"kiln_amx_{weights}_{row_tiles}x{col_tiles}_k{block}"


INT8_DOTS = {"s8": "tdpbssd", "u8": "tdpbsud"}


@dataclass(frozen=True)
class _Tiles:
    """How the IR spells a tile and its instructions: AMX's, or the emulation's."""
    emulated: bool

    @property
    def type(self) -> str:
        return "<256 x i32>" if self.emulated else "x86_amx"

    def op(self, name: str) -> str:
        return f"@kiln_emulated_{name}" if self.emulated else f"@llvm.x86.{name}.internal"

    def load(self, out: str, rows: str, ptr: str, stride: str, width: int = TILE_BYTES) -> str:
        return f"  {out} = call {self.type} {self.op('tileloadd64')}(i16 {rows}, i16 {width}, ptr {ptr}, " \
               f"i64 {stride})"

    def zero(self, out: str, rows: str) -> str:
        return f"  {out} = call {self.type} {self.op('tilezero')}(i16 {rows}, i16 {TILE_BYTES})"

    def store(self, rows: str, ptr: str, stride: str, tile: str) -> str:
        return f"  call void {self.op('tilestored64')}(i16 {rows}, i16 {TILE_BYTES}, ptr {ptr}, i64 {stride}, " \
               f"{self.type} {tile})"

    def dot(self, name: str, out: str, rows: str, acc: str, a: str, b: str, depth: int = TILE_BYTES) -> str:
        """out = acc + a · b, a's rows `depth` bytes wide."""
        t = self.type
        return f"  {out} = call {t} {self.op(name)}(i16 {rows}, i16 {TILE_BYTES}, i16 {depth}, {t} {acc}, " \
               f"{t} {a}, {t} {b})"

    def declarations(self) -> list[str]:
        if self.emulated:
            return _EMULATION
        t = self.type
        return [f"declare {t} @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)",
                f"declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, {t})",
                f"declare {t} @llvm.x86.tilezero.internal(i16, i16)",
                f"declare {t} @llvm.x86.tdpbf16ps.internal(i16, i16, i16, {t}, {t}, {t})",
                *[f"declare {t} @llvm.x86.{dot}.internal(i16, i16, i16, {t}, {t}, {t})" for dot in INT8_DOTS.values()]]


def _prologue(name: str, parameters: str, row_tiles: int, b_rows: int) -> tuple[list[str], dict]:
    """A micro-kernel's entry block, and each row tile's row count: 16, the last one's rows - 16·(R - 1)."""
    lines = [f"define hidden void @{name}({parameters}, ptr noalias %x, i64 %x_stride, ptr noalias %w, "
             "i64 %w_stride, i64 %rows, i64 %steps) #1 {", "entry:",
             f"  %last64 = sub i64 %rows, {TILE_ROWS * (row_tiles - 1)}",
             "  %last = trunc i64 %last64 to i16",
             f"  %w_step = mul i64 %w_stride, {b_rows}"]
    lines += [f"  %x_row{r} = mul i64 %x_stride, {TILE_ROWS * r}" for r in range(row_tiles)]
    return lines, {r: "%last" if r == row_tiles - 1 else str(TILE_ROWS) for r in range(row_tiles)}


def _operands(tiles: _Tiles, shape: dict, col_tiles: int, a_width: int, b_rows: int) -> list[str]:
    """Step %k's A tiles (rows of x, a_width bytes from byte k·a_width) and B tiles (b_rows rows of w
    from row k·b_rows, 64 bytes each: 16 columns)."""
    lines = [f"  %x_k = mul i64 %k, {a_width}", "  %w_k = mul i64 %k, %w_step"]
    for r in shape:
        lines += [f"  %x_at{r} = add i64 %x_row{r}, %x_k",
                  f"  %x_ptr{r} = getelementptr i8, ptr %x, i64 %x_at{r}",
                  tiles.load(f"%a{r}", shape[r], f"%x_ptr{r}", "%x_stride", a_width)]
    for c in range(col_tiles):
        lines += [f"  %w_at{c} = add i64 %w_k, {TILE_BYTES * c}",
                  f"  %w_ptr{c} = getelementptr i8, ptr %w, i64 %w_at{c}",
                  tiles.load(f"%b{c}", str(b_rows), f"%w_ptr{c}", "%w_stride")]
    return lines


_LOOP_END = ["  %k_next = add i64 %k, 1", "  %done = icmp eq i64 %k_next, %steps",
             "  br i1 %done, label %exit, label %loop", "exit:"]


def bf16_micro_ir(row_tiles: int, col_tiles: int, tiles: _Tiles) -> str:
    """The LLVM IR definition of bf16_name(row_tiles, col_tiles): rows ≥ 16·(row_tiles - 1) + 1,
    steps ≥ 1."""
    grid = [(r, c) for r in range(row_tiles) for c in range(col_tiles)]
    t = tiles.type
    lines, shape = _prologue(bf16_name(row_tiles, col_tiles), "ptr noalias %acc, i64 %acc_stride", row_tiles,
                             TILE_ROWS)
    for r, c in grid:
        lines += [f"  %acc_at{r}_{c} = mul i64 %acc_stride, {TILE_ROWS * r}",
                  f"  %acc_ptr{r}_{c} = getelementptr i8, ptr %acc, i64 %acc_at{r}_{c}",
                  f"  %acc_tile{r}_{c} = getelementptr i8, ptr %acc_ptr{r}_{c}, i64 {TILE_BYTES * c}",
                  tiles.load(f"%start{r}_{c}", shape[r], f"%acc_tile{r}_{c}", "%acc_stride")]
    lines += ["  br label %loop", "loop:", "  %k = phi i64 [ 0, %entry ], [ %k_next, %loop ]"]
    lines += [f"  %sum{r}_{c} = phi {t} [ %start{r}_{c}, %entry ], [ %next{r}_{c}, %loop ]" for r, c in grid]
    lines += _operands(tiles, shape, col_tiles, TILE_BYTES, TILE_ROWS)
    lines += [tiles.dot("tdpbf16ps", f"%next{r}_{c}", shape[r], f"%sum{r}_{c}", f"%a{r}", f"%b{c}") for r, c in grid]
    lines += _LOOP_END
    lines += [tiles.store(shape[r], f"%acc_tile{r}_{c}", "%acc_stride", f"%next{r}_{c}") for r, c in grid]
    lines += ["  ret void", "}"]
    return "\n".join(lines)


def int8_micro_ir(weights: str, row_tiles: int, col_tiles: int, block: int, tiles: _Tiles) -> str:
    """The LLVM IR definition of int8_name(row_tiles, col_tiles, block, weights): per activation block
    k < steps, dots[k] = x's levels of the block · w's bytes (INT8_DOTS[weights]), each block's int32
    dots stored for the caller to scale (rows ≥ 16·(row_tiles - 1) + 1, steps ≥ 1)."""
    grid = [(r, c) for r in range(row_tiles) for c in range(col_tiles)]
    lines, shape = _prologue(int8_name(row_tiles, col_tiles, block, weights),
                             "ptr noalias %dots, i64 %dots_stride, i64 %block_stride", row_tiles, block // QUAD_BYTES)
    lines += ["  br label %loop", "loop:", "  %k = phi i64 [ 0, %entry ], [ %k_next, %loop ]",
              "  %dots_k = mul i64 %k, %block_stride", "  %dots_block = getelementptr i8, ptr %dots, i64 %dots_k"]
    lines += _operands(tiles, shape, col_tiles, block, block // QUAD_BYTES)
    for r, c in grid:
        lines += [tiles.zero(f"%zero{r}_{c}", shape[r]),
                  tiles.dot(INT8_DOTS[weights], f"%dot{r}_{c}", shape[r], f"%zero{r}_{c}", f"%a{r}", f"%b{c}", block),
                  f"  %dots_at{r}_{c} = mul i64 %dots_stride, {TILE_ROWS * r}",
                  f"  %dots_row{r}_{c} = getelementptr i8, ptr %dots_block, i64 %dots_at{r}_{c}",
                  f"  %dots_ptr{r}_{c} = getelementptr i8, ptr %dots_row{r}_{c}, i64 {TILE_BYTES * c}",
                  tiles.store(shape[r], f"%dots_ptr{r}_{c}", "%dots_stride", f"%dot{r}_{c}")]
    lines += [*_LOOP_END, "  ret void", "}"]
    return "\n".join(lines)


def ready_ir(emulated: bool) -> str:
    """kiln_tiles_ready(): 1 where this process may run tile instructions, asked of Linux once
    (emulated: granted without asking). State 0: not asked yet, 1: granted, 2: refused or switched off."""
    ask = ["  %granted = icmp eq i32 0, 0"] if emulated else [
        f"  %result = call i64 (i64, ...) @syscall(i64 {ARCH_PRCTL}, i64 {ARCH_REQ_XCOMP_PERM}, "
        f"i64 {XFEATURE_XTILEDATA})",
        "  %granted = icmp eq i64 %result, 0"]
    return "\n".join([
        f'@kiln_tiles_switch = private constant [{len(OFF_SWITCH) + 1} x i8] c"{OFF_SWITCH}\\00"',
        f'@kiln_tiles_off = private constant [{len(OFF) + 1} x i8] c"{OFF}\\00"',
        "@kiln_tiles_state = internal global i32 0, align 4",
        "declare i64 @syscall(i64, ...)", "declare ptr @getenv(ptr)", "declare i32 @strcmp(ptr, ptr)",
        f"define hidden i32 @{READY}() {{", "entry:",
        "  %known = load atomic i32, ptr @kiln_tiles_state monotonic, align 4",
        "  %asked = icmp ne i32 %known, 0",
        "  br i1 %asked, label %done, label %switch",
        "switch:",
        "  %setting = call ptr @getenv(ptr @kiln_tiles_switch)",
        "  %unset = icmp eq ptr %setting, null",
        "  br i1 %unset, label %ask, label %compare",
        "compare:",
        "  %differs = call i32 @strcmp(ptr %setting, ptr @kiln_tiles_off)",
        "  %on = icmp ne i32 %differs, 0",
        "  br i1 %on, label %ask, label %answer",
        "ask:",
        *ask,
        "  br label %answer",
        "answer:",
        "  %yes = phi i1 [ false, %compare ], [ %granted, %ask ]",
        "  %state = select i1 %yes, i32 1, i32 2",
        "  store atomic i32 %state, ptr @kiln_tiles_state monotonic, align 4",
        "  br label %done",
        "done:",
        "  %now = phi i32 [ %known, %entry ], [ %state, %answer ]",
        "  %ready = icmp eq i32 %now, 1",
        "  %out = zext i1 %ready to i32",
        "  ret i32 %out",
        "}"])


def tile_module_ir(kernels: list[tuple], triple: str, cpu: str, emulated: bool = False) -> str:
    """One LLVM IR module with kiln_tiles_ready and the tile micro-kernels `kernels` (("bf16", row tiles,
    column tiles) or ("s8" / "u8", row tiles, column tiles, block) each), for `triple` and `cpu` (with
    AMX's instruction sets, whatever the CPU's)."""
    tiles = _Tiles(emulated)
    parts = [f'target triple = "{triple}"', *tiles.declarations(), ready_ir(emulated)]
    parts += [bf16_micro_ir(*shape, tiles) if kind == "bf16" else int8_micro_ir(kind, *shape, tiles)
              for kind, *shape in sorted(set(kernels))]
    features = "" if emulated else f' "target-features"="{TILE_FEATURES}"'
    parts.append(f'attributes #1 = {{ nounwind "target-cpu"="{cpu}"{features} }}')
    return "\n\n".join(parts) + "\n"


def tile_module(kernels: list[tuple], target, emulated: bool = False):
    """The tile micro-kernels as a TVM runtime module (LLVM) for the LLVM `target`, for the Relax
    build to link into the library."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tile_micro.ll")
        with open(path, "w") as f:
            f.write(tile_module_ir(kernels, str(target.attrs["mtriple"]), str(target.attrs["mcpu"]), emulated))
        return tvm.runtime.load_module(path)


def _bf16_to_float(out: str, bits: str) -> list[str]:
    return [f"  {out}_w = zext i16 {bits} to i32", f"  {out}_s = shl i32 {out}_w, 16",
            f"  {out} = bitcast i32 {out}_s to float"]


def _emulated_dot(dot: str, acc: str, per_step: int, body: list[str]) -> str:
    """A tile product's scalar function: each C element (`acc`: float or i32) at row %i < m, column
    %j < n/4, summed over steps %q < k / per_step by `body` (from %sum to %sum_next)."""
    return "\n".join([
        f"define internal <256 x i32> @kiln_emulated_{dot}(i16 %m, i16 %n, i16 %k, <256 x i32> %c, "
        "<256 x i32> %a, <256 x i32> %b) #1 {",
        "entry:",
        "  %ct = alloca <256 x i32>, align 64", "  store <256 x i32> %c, ptr %ct",
        "  %at = alloca <256 x i32>, align 64", "  store <256 x i32> %a, ptr %at",
        "  %bt = alloca <256 x i32>, align 64", "  store <256 x i32> %b, ptr %bt",
        "  %rows = zext i16 %m to i64",
        "  %n64 = zext i16 %n to i64", "  %cols = udiv i64 %n64, 4",
        "  %k64 = zext i16 %k to i64", f"  %steps = udiv i64 %k64, {per_step}",
        "  br label %row", "row:",
        "  %i = phi i64 [ 0, %entry ], [ %i_next, %row_end ]", "  br label %col", "col:",
        "  %j = phi i64 [ 0, %row ], [ %j_next, %col_end ]",
        "  %c_at = mul i64 %i, 16", "  %c_idx = add i64 %c_at, %j",
        f"  %c_ptr = getelementptr {acc}, ptr %ct, i64 %c_idx",
        f"  %c0 = load {acc}, ptr %c_ptr", "  br label %step", "step:",
        "  %q = phi i64 [ 0, %col ], [ %q_next, %step ]",
        f"  %sum = phi {acc} [ %c0, %col ], [ %sum_next, %step ]",
        *body,
        "  %q_next = add i64 %q, 1", "  %more_q = icmp ult i64 %q_next, %steps",
        "  br i1 %more_q, label %step, label %col_end", "col_end:",
        f"  store {acc} %sum_next, ptr %c_ptr",
        "  %j_next = add i64 %j, 1", "  %more_j = icmp ult i64 %j_next, %cols",
        "  br i1 %more_j, label %col, label %row_end", "row_end:",
        "  %i_next = add i64 %i, 1", "  %more_i = icmp ult i64 %i_next, %rows",
        "  br i1 %more_i, label %row, label %exit", "exit:",
        "  %v = load <256 x i32>, ptr %ct", "  ret <256 x i32> %v", "}"])


def _bf16_pair_products() -> list[str]:
    """tdpbf16ps's step %q: pair q of row %i of A times pair q of column %j of B, the two products added
    in turn."""
    return ["  %a_row = mul i64 %i, 32", "  %q2 = mul i64 %q, 2", "  %a_idx = add i64 %a_row, %q2",
            "  %a_ptr0 = getelementptr i16, ptr %at, i64 %a_idx", "  %a_ptr1 = getelementptr i16, ptr %a_ptr0, i64 1",
            "  %b_row = mul i64 %q, 32", "  %j2 = mul i64 %j, 2", "  %b_idx = add i64 %b_row, %j2",
            "  %b_ptr0 = getelementptr i16, ptr %bt, i64 %b_idx", "  %b_ptr1 = getelementptr i16, ptr %b_ptr0, i64 1",
            "  %a0b = load i16, ptr %a_ptr0", "  %a1b = load i16, ptr %a_ptr1",
            "  %b0b = load i16, ptr %b_ptr0", "  %b1b = load i16, ptr %b_ptr1",
            *_bf16_to_float("%a0", "%a0b"), *_bf16_to_float("%a1", "%a1b"),
            *_bf16_to_float("%b0", "%b0b"), *_bf16_to_float("%b1", "%b1b"),
            "  %prod0 = fmul float %a0, %b0", "  %sum1 = fadd float %sum, %prod0",
            "  %prod1 = fmul float %a1, %b1", "  %sum_next = fadd float %sum1, %prod1"]


def _byte_product(extend: str) -> list[str]:
    """tdpbssd's or tdpbsud's step %q: byte q of row %i of A (signed) times byte q % 4 of quad q / 4 of
    column %j of B (widened by `extend`: sext signed, zext unsigned)."""
    return ["  %a_row = mul i64 %i, 64", "  %a_idx = add i64 %a_row, %q",
            "  %a_ptr = getelementptr i8, ptr %at, i64 %a_idx",
            "  %p = udiv i64 %q, 4", "  %in_quad = urem i64 %q, 4",
            "  %b_row = mul i64 %p, 64", "  %j4 = mul i64 %j, 4", "  %b_col = add i64 %j4, %in_quad",
            "  %b_idx = add i64 %b_row, %b_col", "  %b_ptr = getelementptr i8, ptr %bt, i64 %b_idx",
            "  %a8 = load i8, ptr %a_ptr", "  %b8 = load i8, ptr %b_ptr",
            "  %a32 = sext i8 %a8 to i32", f"  %b32 = {extend} i8 %b8 to i32",
            "  %prod = mul i32 %a32, %b32", "  %sum_next = add i32 %sum, %prod"]


# Scalar functions with the tile instructions' meaning (Intel's pseudo-code: rows × bytes of a
# tile, row i at byte 64·i; tdpbf16ps adds each pair's two products in turn). Their attributes are
# the micro-kernels' (#1): LLVM passes a <256 x i32> in registers only where both sides agree on
# the vector registers there are.
_EMULATION = [
    "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)",
    "\n".join([
        "define internal <256 x i32> @kiln_emulated_tileloadd64(i16 %rows, i16 %bytes, ptr %p, i64 %stride) #1 {",
        "entry:",
        "  %t = alloca <256 x i32>, align 64",
        "  store <256 x i32> zeroinitializer, ptr %t",
        "  %n = zext i16 %rows to i64", "  %width = zext i16 %bytes to i64",
        "  br label %loop", "loop:",
        "  %i = phi i64 [ 0, %entry ], [ %i_next, %loop ]",
        "  %from_at = mul i64 %i, %stride", "  %from = getelementptr i8, ptr %p, i64 %from_at",
        "  %to_at = mul i64 %i, 64", "  %to = getelementptr i8, ptr %t, i64 %to_at",
        "  call void @llvm.memcpy.p0.p0.i64(ptr %to, ptr %from, i64 %width, i1 false)",
        "  %i_next = add i64 %i, 1", "  %more = icmp ult i64 %i_next, %n",
        "  br i1 %more, label %loop, label %exit", "exit:",
        "  %v = load <256 x i32>, ptr %t", "  ret <256 x i32> %v", "}"]),
    "\n".join([
        "define internal void @kiln_emulated_tilestored64(i16 %rows, i16 %bytes, ptr %p, i64 %stride, "
        "<256 x i32> %v) #1 {",
        "entry:",
        "  %t = alloca <256 x i32>, align 64", "  store <256 x i32> %v, ptr %t",
        "  %n = zext i16 %rows to i64", "  %width = zext i16 %bytes to i64",
        "  br label %loop", "loop:",
        "  %i = phi i64 [ 0, %entry ], [ %i_next, %loop ]",
        "  %to_at = mul i64 %i, %stride", "  %to = getelementptr i8, ptr %p, i64 %to_at",
        "  %from_at = mul i64 %i, 64", "  %from = getelementptr i8, ptr %t, i64 %from_at",
        "  call void @llvm.memcpy.p0.p0.i64(ptr %to, ptr %from, i64 %width, i1 false)",
        "  %i_next = add i64 %i, 1", "  %more = icmp ult i64 %i_next, %n",
        "  br i1 %more, label %loop, label %exit", "exit:", "  ret void", "}"]),
    "define internal <256 x i32> @kiln_emulated_tilezero(i16 %rows, i16 %bytes) #1 {\n"
    "  ret <256 x i32> zeroinitializer\n}",
    _emulated_dot("tdpbf16ps", "float", 4, _bf16_pair_products()),
    _emulated_dot("tdpbssd", "i32", 1, _byte_product("sext")),
    _emulated_dot("tdpbsud", "i32", 1, _byte_product("zext")),
]
