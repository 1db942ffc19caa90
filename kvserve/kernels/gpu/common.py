"""Triton helpers shared by the kernels: a dot product that stays correct in the interpreter, a
float conversion that rounds as the GPU does, and int4 nibbles turned into numbers."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """A kernel's first step. Launched with programmatic dependent launch (`launch_options`), a kernel may
    start while the one before it in the stream is ending: it waits here until that one has finished
    and its writes are visible, before touching memory, and then lets the next kernel start in turn.
    So each kernel still sees all of the one before (and, by induction, of every earlier one); what
    overlaps is only the launch. Nothing without it (and nothing in the interpreter)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def tile_index(given, AXIS: tl.constexpr):
    """A tile's index along grid axis AXIS: `given` (a kernel whose programs loop over tiles), or where None
    (a program a tile) this program's, read where it is used, as the launched kernels always did (read at
    their entry instead, ptxas orders a kernel's instructions otherwise)."""
    if given is None:
        return tl.program_id(AXIS)
    else:
        return given


@triton.jit
def tile_count(given, AXIS: tl.constexpr):
    """The tiles along grid axis AXIS: `given`, or where None the grid's programs along it."""
    if given is None:
        return tl.num_programs(AXIS)
    else:
        return given


@triton.jit
def prefetch_rows(ptr, cols, N, stride, first, count, LINES: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines of `count` elements from `first` in each weight row
    `cols` (clamped to N - 1) of ptr [N, stride], up to the last of them, and go on without waiting:
    `prefetch.global.L2`, a hint that changes no value. A matmul does this before `wait_for_prior`
    (launched with `prefetch_lines`, only on a GPU), as no kernel ever writes a weight; its loads after
    the wait then find the lines in L2 instead of memory."""
    if LINES > 0:
        per_line: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
        offsets = tl.minimum(tl.arange(0, LINES) * per_line, count - 1)
        rows = tl.minimum(cols, N - 1).to(tl.int64)
        tl.inline_asm_elementwise(
            asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            constraints="=r,l",
            args=[ptr + rows[:, None] * stride + first + offsets[None, :]],
            dtype=tl.int32,
            is_pure=False,  # kept, though nothing reads its result
            pack=1,
        )


@triton.jit
def dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b, accumulated in float32. On a GPU 16-bit operands go to the tensor cores as they
    are, and float32 operands use exact float32 products (`ieee`, never TF32). The interpreter
    multiplies bfloat16 as the integers it stores them in, so there both operands become float32
    first (exact, as bfloat16 and float16 widen losslessly), and its dot (numpy's float32 matmul)
    sums a row in an order that can follow the row's place in the tile and the tile's shape, which
    the tensor cores never do: so there each output is a sum over K of its own products, the same
    for every row."""
    if INTERPRET:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (float32) converted to `dtype`, rounded to nearest even as on a GPU. The interpreter
    truncates float32 to bfloat16, so there the rounding is done on the bits."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # add half an ulp of bfloat16, ties to even
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def gated_product(gate, up, GELU: tl.constexpr, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """act(gate) * up for float32 gate and up (each as stored in `dtype`), act SiLU or (GELU) tanh-GELU,
    the activation rounded to `dtype` before the product and the product rounded to it, as
    `F.silu(gate) * up` stores them: elementwise.gated_activation's kernel and a matmul's epilogue that
    applies it (matmul's `activation`) both compute it here, so their bits are one."""
    if GELU:  # 0.5 x (1 + tanh(y)) = x / (1 + exp(-2 y)), y = sqrt(2 / pi) (x + 0.044715 x^3): no cancellation
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:  # x / (1 + exp(-x))
        act = gate / (1.0 + tl.exp(-gate))
    act = cast(act, dtype, INTERPRET).to(tl.float32)  # PyTorch stores the activation first
    return cast(act * up, dtype, INTERPRET)


@triton.jit
def rope_values(x, rolled, cos, sin_signed, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Rotate-half RoPE of float32 values: x * cos + rolled * sin_signed in `dtype`, x * cos rounded to it
    first, as torch.addcmul(x * cos, ...) stores it (rolled: the value half a head away). RoPE's kernel
    and the q/k/v projection's epilogue that applies it (matmul's `rope`) both compute it here."""
    x_cos = cast(x * cos, dtype, INTERPRET).to(tl.float32)
    return cast(x_cos + rolled * sin_signed, dtype, INTERPRET)


@triton.jit
def nibble_to_float(byte, HIGH: tl.constexpr, PERMUTE: tl.constexpr, INTERPRET: tl.constexpr):
    """The low (HIGH: high) nibble of each uint8 as float32, exactly. PERMUTE (on a GPU): an AND (and a
    shift) per four bytes, then per byte a PRMT that builds the bits of 2**23 + nibble and a subtraction
    of 2**23, where the conversion instruction runs at a fraction of the FMAs' rate. The same values,
    so the same bits downstream: the int4 matmul's step took 0.91 -> 0.83 ms for one row on an H200
    (bench/gpu_kernels.py, `int4-convert`; OR-ing the nibble into 2**23's bits measured slower than
    the instruction)."""
    if PERMUTE and not INTERPRET:
        shift: tl.constexpr = "shr.b32 t, $4, 4;" if HIGH else "mov.b32 t, $4;"
        bits = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, m; " + shift + " and.b32 t, t, 0x0F0F0F0F; mov.b32 m, 0x4B000000;"
            " prmt.b32 $0, t, m, 0x7540; prmt.b32 $1, t, m, 0x7541;"
            " prmt.b32 $2, t, m, 0x7542; prmt.b32 $3, t, m, 0x7543; }",
            constraints="=r,=r,=r,=r,r",
            args=[byte],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        )
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    else:
        return (byte >> 4 if HIGH else byte & 15).to(tl.float32)


@triton.jit
def nibble_fma_bf16(byte, scale, low, HIGH: tl.constexpr, INTERPRET: tl.constexpr):
    """fma(scale, nibble, low) rounded once to bfloat16, for the low (HIGH: high) nibble of each uint8,
    with bfloat16 scale and low. On a GPU, per two weights: a PRMT builds the bits of bfloat16 2**7 +
    nibble (exponent byte 0x43 beside the nibble), a packed FMA subtracts 2**7 exactly, a second
    multiplies by the scale and adds low with one rounding; no float32 value and no conversion
    instruction, where `nibble_to_float` then an FMA and a rounding take about four instructions per
    weight. The interpreter rounds the same exact value once: the product of a nibble and a bfloat16 is
    exact in float32, and where the float32 sum lands on a tie between two bfloat16 values with an error
    (a min far smaller than the product), one float32 step toward the exact sum keeps the second
    rounding from going the other way."""
    if INTERPRET:
        nibble = (byte >> 4 if HIGH else byte & 15).to(tl.float32)
        product, low = scale.to(tl.float32) * nibble, low.to(tl.float32)
        total = product + low
        low_part = total - product  # TwoSum: total + error == product + low exactly
        error = (product - (total - low_part)) + (low - low_part)
        bits = total.to(tl.int32, bitcast=True)
        tie = ((bits & 0xFFFF) == 0x8000) & (error != 0.0)
        step = tl.where((error > 0.0) == (total > 0.0), 1, -1)  # away from zero where the error is
        total = tl.where(tie, (bits + step).to(tl.float32, bitcast=True), total)
        return cast(total, tl.bfloat16, INTERPRET)
    else:
        # operands: $0 $1 the four weights as two bfloat16 pairs; $2 four bytes; $3 $4 scales; $5 $6 lows
        # (the outputs written last: no input is read after an output that may share its register)
        shift: tl.constexpr = "shr.b32 t, $2, 4;" if HIGH else "mov.b32 t, $2;"
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, e, one, neg, a, b; " + shift + " and.b32 t, t, 0x0F0F0F0F;"
            " mov.b32 e, 0x43434343; mov.b32 one, 0x3F803F80; mov.b32 neg, 0xC300C300;"
            " prmt.b32 a, t, e, 0x5140; prmt.b32 b, t, e, 0x5342;"
            " fma.rn.bf16x2 a, a, one, neg; fma.rn.bf16x2 b, b, one, neg;"
            " fma.rn.bf16x2 a, a, $3, $5; fma.rn.bf16x2 b, b, $4, $6; mov.b32 $0, a; mov.b32 $1, b; }",
            constraints="=r,=r,r,r,r,r,r",
            args=[byte, scale, low],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )


@triton.jit
def split4(words):
    """[R, 4] -> four [R] tensors (columns 0..3); free where a thread holds a row's four words."""
    even, odd = tl.split(tl.reshape(words, (words.shape[0], 2, 2)))  # columns (0, 2) and (1, 3)
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _load4(pointer):
    """The four int32 words at each 16-byte aligned `pointer` [M], by one 128-bit load per row (a
    tl.load of [M, 4] would spread a row's words over threads, and every output's thread needs them)."""
    return tl.inline_asm_elementwise(
        asm="ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
        constraints="=r,=r,=r,=r,l",
        args=[pointer],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _signed_bytes(words):
    """int32 words [R, W] -> their bytes as signed integers [R, 4 * W], byte j of word t at 4t + j (the
    interpreter's way to what dp4a reads)."""
    shifts = tl.arange(0, 4) * 8
    return tl.reshape((words[:, :, None] << (24 - shifts)[None, None, :]) >> 24, (words.shape[0], 4 * words.shape[1]))


@triton.jit
def _input_bytes(q):
    """The int8 inputs of a group at pointers q [R, M] (eight int32 words each) as signed integers
    [R, M, 32] (the interpreter's way to what dp4a reads)."""
    words = tl.load(q[:, :, None] + tl.arange(0, 8)[None, None, :])  # [R, M, 8]
    flat = _signed_bytes(tl.reshape(words, (q.shape[0] * q.shape[1], 8)))
    return tl.reshape(flat, (q.shape[0], q.shape[1], 32))


@triton.jit
def group_dot(w, q, INTERPRET: tl.constexpr):
    """The exact integer sums over a group of 32 of code * q: w [N, 4] int32, a GGML Q4 group's 16 bytes
    per output (word t: the codes of inputs 4t..4t+3 in its low nibbles, 16+4t..16+4t+3 in its high
    ones); q [1, M] (or [N, M]: an output's own inputs), pointers to each row's eight int32 words of the
    group's int8 inputs (word t: inputs 4t..4t+3) -> [N, M] (outputs first: the layout the weights are
    loaded in, so no data moves between threads). On a GPU per output and row: four ANDs keep the low nibbles and four the high ones in
    place (16 x the code), eight dp4a sum the products, and the high sum is shifted back by 4 (exact: a
    multiple of 16); no float and no conversion."""
    if INTERPRET:  # the same sums from every byte at once
        shifts = tl.arange(0, 4) * 8
        inputs = _input_bytes(q)  # [1 or N, M, 32]
        codes = tl.reshape((w[:, :, None] >> shifts[None, None, :]) & 255, (w.shape[0], 16))  # byte 4t + j
        codes = tl.reshape(tl.permute(tl.join(codes & 15, codes >> 4), (0, 2, 1)), (w.shape[0], 32))
        return tl.sum(codes[:, None, :] * inputs, axis=2)
    else:
        w0, w1, w2, w3 = split4(w)
        x0, x1, x2, x3 = _load4(q)
        x4, x5, x6, x7 = _load4(q + 4)
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 l, h, sl, sh; "
            " and.b32 l, $1, 0x0F0F0F0F; dp4a.u32.s32 sl, l, $5, 0; and.b32 h, $1, 0xF0F0F0F0; dp4a.u32.s32 sh, h, $9, 0;"
            " and.b32 l, $2, 0x0F0F0F0F; dp4a.u32.s32 sl, l, $6, sl; and.b32 h, $2, 0xF0F0F0F0; dp4a.u32.s32 sh, h, $10, sh;"
            " and.b32 l, $3, 0x0F0F0F0F; dp4a.u32.s32 sl, l, $7, sl; and.b32 h, $3, 0xF0F0F0F0; dp4a.u32.s32 sh, h, $11, sh;"
            " and.b32 l, $4, 0x0F0F0F0F; dp4a.u32.s32 sl, l, $8, sl; and.b32 h, $4, 0xF0F0F0F0; dp4a.u32.s32 sh, h, $12, sh;"
            " shr.s32 sh, sh, 4; add.s32 $0, sl, sh; }",
            constraints="=r" + ",r" * 12,
            args=[
                w0[:, None],
                w1[:, None],
                w2[:, None],
                w3[:, None],
                x0,
                x1,
                x2,
                x3,
                x4,
                x5,
                x6,
                x7,
            ],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def int8_group_dot(w_low, w_high, q, INTERPRET: tl.constexpr):
    """The exact integer sums over a group of 32 of code * q for int8 codes (GGML's Q8_0): w_low, w_high
    [N, 4] int32, words 0..3 and 4..7 of each output's 32 code bytes (word t: inputs 4t..4t+3); q as
    `group_dot`'s -> [N, M]. On a GPU eight dp4a per output and row."""
    if INTERPRET:
        inputs = _input_bytes(q)  # [1 or N, M, 32]
        words = tl.reshape(tl.join(w_low, w_high), (w_low.shape[0], 4, 2))  # [N, 4, 2]: word t and 4 + t
        codes = _signed_bytes(tl.reshape(tl.permute(words, (0, 2, 1)), (w_low.shape[0], 8)))  # words 0..7
        return tl.sum(codes[:, None, :] * inputs, axis=2)
    else:
        w0, w1, w2, w3 = split4(w_low)
        w4, w5, w6, w7 = split4(w_high)
        x0, x1, x2, x3 = _load4(q)
        x4, x5, x6, x7 = _load4(q + 4)
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; dp4a.s32.s32 t, $1, $9, 0; dp4a.s32.s32 t, $2, $10, t; dp4a.s32.s32 t, $3, $11, t;"
            " dp4a.s32.s32 t, $4, $12, t; dp4a.s32.s32 t, $5, $13, t; dp4a.s32.s32 t, $6, $14, t;"
            " dp4a.s32.s32 t, $7, $15, t; dp4a.s32.s32 t, $8, $16, t; mov.b32 $0, t; }",
            constraints="=r" + ",r" * 16,
            args=[
                w0[:, None],
                w1[:, None],
                w2[:, None],
                w3[:, None],
                w4[:, None],
                w5[:, None],
                w6[:, None],
                w7[:, None],
                x0,
                x1,
                x2,
                x3,
                x4,
                x5,
                x6,
                x7,
            ],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def store_groups(words, d, s, group, mask, words_ptr, d_ptr, s_ptr):
    """`quantize_groups`' results for groups [R, G] (words [R * G, 8], d and s [R * G], row-major) stored
    where `mask` at the group indices `group` [R, G] of outputs of groups of 32 (d and s one per group,
    words eight): every kernel that quantizes stores its int8 form so."""
    R: tl.constexpr = group.shape[0]
    G: tl.constexpr = group.shape[1]
    tl.store(d_ptr + group, tl.reshape(d, (R, G)), mask=mask)
    tl.store(s_ptr + group, tl.reshape(s, (R, G)), mask=mask)
    word = group[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    tl.store(words_ptr + word, tl.reshape(words, (R, G, 8)), mask=mask[:, :, None])


@triton.jit
def round_to_int(x, INTERPRET: tl.constexpr):
    """float32 x rounded to the nearest integer, ties to even, as int32 (one conversion instruction on a
    GPU; the interpreter adds and subtracts 1.5 * 2**23, which rounds the same for |x| < 2**22). Outside
    int32's range, and NaN, INT_MIN, as x86's conversion gives (the CPU's quantize_group), where the
    GPU's would saturate: a group whose largest |x| is below about 4e-37 has 1 / d infinite, so x * (1 / d)
    infinite or NaN."""
    inside = tl.abs(x) < 2147483648.0  # False for NaN
    x = tl.where(inside, x, 0.0)
    if INTERPRET:
        rounded = ((x + 12582912.0) - 12582912.0).to(tl.int32)
    else:
        rounded = tl.inline_asm_elementwise(
            asm="cvt.rni.s32.f32 $0, $1;", constraints="=r,r", args=[x], dtype=tl.int32, is_pure=True, pack=1
        )
    return tl.where(inside, rounded, -2147483648)


@triton.jit
def quantize_groups(x, INTERPRET: tl.constexpr):
    """Groups of 32 inputs x [G, 32] (float32) quantized as the CPU's quantize_group: d = max|x| / 127,
    q = x * (1 / d) rounded to nearest even and saturated to int8, s = d * (the sum of the unsaturated
    integers) -> (q as eight int32 words per group [G, 8], byte j of word t input 4t + j; d [G]; s [G]).
    Every kernel that quantizes inputs for the int4 x int8 matmuls calls this: the same bits."""
    d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    inv = tl.where(d != 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0.0, d, 1.0)), 0.0)
    q = round_to_int(x * inv[:, None], INTERPRET)
    s = d * tl.sum(q, axis=1).to(tl.float32)
    q = tl.minimum(tl.maximum(q, -128), 127) & 255
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    words = tl.sum(tl.reshape(q, (x.shape[0], 8, 4)) << shifts, axis=2)  # disjoint bytes: the sum is an OR
    return words, d, s
