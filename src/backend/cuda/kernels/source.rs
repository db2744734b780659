//! The CUDA C of the built-ins: one program per dtype, generated from the templates below.
//!
//! [`builtin_source`] replaces each template's placeholders with concrete C. `{T}` is the
//! dtype's name, as in the entry points `<kernel>_{T}`. `{S}` is the storage type, `{B}` the
//! unsigned integer of the element's size, and `{C}` the computation type: `double` for
//! `f64`, else `float`. The prelude's `LOAD`/`STORE`/`ADD`/`SUB`/`MUL`/`DIV`/`EXP`/`LOG`
//! macros do the rest. The text is a pure function of the dtype, so the stream may cache the
//! module under its [`super::Program`] key.
//!
//! How results match the CPU's exact mode is in DESIGN.md §5, "CUDA". Arithmetic uses the
//! `__f*_rn` intrinsics, which the compiler never contracts into fused multiply-adds.
//! `f16`/`bf16` convert with the same integer code as [`crate::F16`] and [`crate::Bf16`], so
//! the programs include no header. `softmax_xent` uses CUDA's `expf`/`logf`, within a few ulp
//! of Rust's, and sums the rows' losses in another order than the CPU.
//!
//! `tests/backends/cuda_kernels.rs` also builds these programs for the host with a C++ compiler, the
//! intrinsics shimmed as IEEE operations. It compares every built-in with the CPU backend
//! without a GPU.

use crate::node::DType;

/// Threads per block of the element-wise kernels (one cheap item per thread: large blocks).
pub(super) const ELEMENTWISE_BLOCK: u32 = 256;

/// Threads per block of the matmuls (a `k`-long loop per output: smaller blocks spread
/// small outputs over more multiprocessors).
pub(super) const MATMUL_BLOCK: u32 = 128;

/// Threads per block of the kernels with one thread per row or column (`sum_rows`,
/// `softmax_xent_grad`): there are few items, each a long loop, so small blocks.
pub(super) const ROWS_BLOCK: u32 = 64;

/// Threads of the single block that sums the rows' losses of `softmax_xent` (the size of
/// its shared array).
pub(super) const LOSS_BLOCK: u32 = 256;

/// The parts of a program that depend on the dtype.
struct Types {
    name: &'static str,
    storage: &'static str,
    bits: &'static str,
    compute: &'static str,
    prelude: &'static str,
}

const F32_PRELUDE: &str = r#"#define LOAD(x) (x)
#define STORE(x) (x)
#define ADD(a, b) __fadd_rn((a), (b))
#define SUB(a, b) __fsub_rn((a), (b))
#define MUL(a, b) __fmul_rn((a), (b))
#define DIV(a, b) __fdiv_rn((a), (b))
#define EXP(x) expf(x)
#define LOG(x) logf(x)
"#;

const F64_PRELUDE: &str = r#"#define LOAD(x) (x)
#define STORE(x) (x)
#define ADD(a, b) __dadd_rn((a), (b))
#define SUB(a, b) __dsub_rn((a), (b))
#define MUL(a, b) __dmul_rn((a), (b))
#define DIV(a, b) __ddiv_rn((a), (b))
#define EXP(x) exp(x)
#define LOG(x) log(x)
"#;

const F16_PRELUDE: &str = r#"#define LOAD(x) f16_to_f32(x)
#define STORE(x) f32_to_f16(x)
#define ADD(a, b) __fadd_rn((a), (b))
#define SUB(a, b) __fsub_rn((a), (b))
#define MUL(a, b) __fmul_rn((a), (b))
#define DIV(a, b) __fdiv_rn((a), (b))
#define EXP(x) expf(x)
#define LOG(x) logf(x)
"#;

const BF16_PRELUDE: &str = r#"#define LOAD(x) bf16_to_f32(x)
#define STORE(x) f32_to_bf16(x)
#define ADD(a, b) __fadd_rn((a), (b))
#define SUB(a, b) __fsub_rn((a), (b))
#define MUL(a, b) __fmul_rn((a), (b))
#define DIV(a, b) __fdiv_rn((a), (b))
#define EXP(x) expf(x)
#define LOG(x) logf(x)
"#;

fn types(dtype: DType) -> Types {
    let (storage, bits, compute, prelude) = match dtype {
        DType::F32 => ("float", "u32", "float", F32_PRELUDE),
        DType::F64 => ("double", "u64", "double", F64_PRELUDE),
        DType::F16 => ("u16", "u16", "float", F16_PRELUDE),
        DType::BF16 => ("u16", "u16", "float", BF16_PRELUDE),
        DType::I32 => ("int", "u32", "", ""),
        DType::U8 => ("u8", "u8", "", ""),
    };
    Types {
        name: dtype.name(),
        storage,
        bits,
        compute,
        prelude,
    }
}

/// Types, the grid-stride loop, and the `f16`/`bf16` conversions of `src/node.rs`.
const COMMON: &str = r#"typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define GRID_STRIDE(i, n) \
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ float f16_to_f32(u16 h) {
  u32 sign = ((u32)h & 0x8000u) << 16;
  u32 exp = ((u32)h >> 10) & 0x1fu;
  u32 man = (u32)h & 0x3ffu;
  u32 bits;
  if (exp == 0u) {
    if (man == 0u) {
      bits = sign;
    } else {
      int e = 127 - 15 + 1;
      u32 m = man;
      while ((m & 0x400u) == 0u) {
        m <<= 1;
        e -= 1;
      }
      bits = sign | ((u32)e << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127u - 15u) << 23) | (man << 13);
  }
  return __uint_as_float(bits);
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
  u32 bits = __float_as_uint(x);
  u32 sign = (bits >> 16) & 0x8000u;
  int exp = (int)((bits >> 23) & 0xffu);
  u32 man = bits & 0x7fffffu;
  if (exp == 0xff) {
    return (u16)(sign | 0x7c00u | (man != 0u ? 0x0200u : 0u));
  }
  int e = exp - 127 + 15;
  if (e >= 0x1f) {
    return (u16)(sign | 0x7c00u);
  }
  if (e <= 0) {
    if (e < -10) {
      return (u16)sign;
    }
    u32 m = man | 0x800000u;
    u32 shift = (u32)(14 - e);
    u32 half = 1u << (shift - 1u);
    u32 rem = m & ((1u << shift) - 1u);
    u32 out = m >> shift;
    if (rem > half || (rem == half && (out & 1u) == 1u)) {
      out += 1u;
    }
    return (u16)(sign | out);
  }
  u32 out = ((u32)e << 10) | (man >> 13);
  u32 rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (out & 1u) == 1u)) {
    out += 1u;
  }
  return (u16)(sign | out);
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
  return __uint_as_float((u32)h << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float x) {
  u32 bits = __float_as_uint(x);
  if (x != x) {
    return (u16)((bits >> 16) | 0x40u);
  }
  u32 round = 0x7fffu + ((bits >> 16) & 1u);
  return (u16)((bits + round) >> 16);
}
"#;

/// Bitwise kernels, every dtype. `fill` takes the element's bits (computed on the host
/// exactly as the CPU backend converts the value); `copy_range` serves `copy` too.
const BITWISE: &str = r#"
extern "C" __global__ void fill_{T}({B}* dst, u64 n, {V} value) {
  GRID_STRIDE(i, n) { dst[i] = ({B})value; }
}

extern "C" __global__ void copy_range_{T}({B}* dst, const {B}* src, u64 dst_offset,
                                          u64 src_offset, u64 n) {
  GRID_STRIDE(i, n) { dst[dst_offset + i] = src[src_offset + i]; }
}
"#;

/// `dst += src` on `i32`, wrapping.
const ADD_I32: &str = r#"
extern "C" __global__ void add_into_i32(int* dst, const int* src, u64 n) {
  GRID_STRIDE(i, n) { dst[i] = (int)((u32)dst[i] + (u32)src[i]); }
}
"#;

/// The float kernels (every float dtype).
const FLOAT: &str = r#"
extern "C" __global__ void add_into_{T}({S}* dst, const {S}* src, u64 n) {
  GRID_STRIDE(i, n) { dst[i] = STORE(ADD(LOAD(dst[i]), LOAD(src[i]))); }
}

extern "C" __global__ void scale_{T}({S}* dst, const {S}* src, {C} alpha, u64 n) {
  GRID_STRIDE(i, n) { dst[i] = STORE(MUL(alpha, LOAD(src[i]))); }
}

extern "C" __global__ void axpy_{T}({S}* y, const {S}* x, {C} alpha, u64 n) {
  GRID_STRIDE(i, n) { y[i] = STORE(ADD(LOAD(y[i]), MUL(alpha, LOAD(x[i])))); }
}

extern "C" __global__ void sgd_step_{T}({S}* w, const {S}* g, {C} lr, u64 n) {
  GRID_STRIDE(i, n) { w[i] = STORE(SUB(LOAD(w[i]), MUL(lr, LOAD(g[i])))); }
}

extern "C" __global__ void mul_{T}({S}* dst, const {S}* a, const {S}* b, u64 n) {
  GRID_STRIDE(i, n) { dst[i] = STORE(MUL(LOAD(a[i]), LOAD(b[i]))); }
}

extern "C" __global__ void relu_{T}({S}* dst, const {S}* src, u64 n) {
  GRID_STRIDE(i, n) {
    {C} x = LOAD(src[i]);
    dst[i] = STORE((x > ({C})0 || x != x) ? x : ({C})0);
  }
}

extern "C" __global__ void relu_backward_{T}({S}* dgrad_in, const {S}* grad_out,
                                             const {S}* pre_activation, u64 n) {
  GRID_STRIDE(i, n) {
    {C} g = LOAD(grad_out[i]);
    dgrad_in[i] = STORE(LOAD(pre_activation[i]) > ({C})0 ? g : ({C})0);
  }
}

extern "C" __global__ void add_row_bias_{T}({S}* dst, const {S}* bias, u64 mn, u64 n) {
  GRID_STRIDE(i, mn) { dst[i] = STORE(ADD(LOAD(dst[i]), LOAD(bias[i % n]))); }
}

/* One thread per column, summing the rows in increasing order. */
extern "C" __global__ void sum_rows_{T}({S}* dst, const {S}* src, u64 m, u64 n) {
  GRID_STRIDE(j, n) {
    {C} acc = ({C})0;
    for (u64 i = 0; i < m; ++i) {
      acc = ADD(acc, LOAD(src[i * n + j]));
    }
    dst[j] = STORE(acc);
  }
}

/* The row's maximum (first to last, as the CPU) and the sum of exp(z - max). */
__device__ __forceinline__ void softmax_row_{T}(const {S}* z, u64 c, {C}* mx, {C}* s) {
  {C} m = LOAD(z[0]);
  for (u64 j = 1; j < c; ++j) {
    {C} zj = LOAD(z[j]);
    if (zj > m) {
      m = zj;
    }
  }
  {C} sum = ({C})0;
  for (u64 j = 0; j < c; ++j) {
    sum = ADD(sum, EXP(SUB(LOAD(z[j]), m)));
  }
  *mx = m;
  *s = sum;
}

/* One thread per row: dlogits = (exp(z - mx) / s - y) * grad_scale. */
extern "C" __global__ void softmax_xent_grad_{T}({S}* dlogits, const {S}* logits,
                                                 const {S}* labels, {C} grad_scale, u64 m,
                                                 u64 c) {
  if (c == 0) {
    return;
  }
  GRID_STRIDE(row, m) {
    const {S}* z = logits + row * c;
    const {S}* y = labels + row * c;
    {S}* g = dlogits + row * c;
    {C} mx, s;
    softmax_row_{T}(z, c, &mx, &s);
    for (u64 j = 0; j < c; ++j) {
      {C} e = EXP(SUB(LOAD(z[j]), mx));
      g[j] = STORE(MUL(SUB(DIV(e, s), LOAD(y[j])), grad_scale));
    }
  }
}

/* One block: thread t sums the losses of rows t, t + blockDim.x, ..., then thread 0 sums
   the threads' partial sums in thread order. */
extern "C" __global__ void softmax_xent_loss_{T}({S}* loss, const {S}* logits,
                                                 const {S}* labels, u64 m, u64 c) {
  __shared__ {C} partial[{LOSS_BLOCK}];
  {C} total = ({C})0;
  if (c > 0) {
    for (u64 row = threadIdx.x; row < m; row += blockDim.x) {
      const {S}* z = logits + row * c;
      const {S}* y = labels + row * c;
      {C} mx, s;
      softmax_row_{T}(z, c, &mx, &s);
      {C} lse = ADD(mx, LOG(s));
      {C} row_loss = ({C})0;
      for (u64 j = 0; j < c; ++j) {
        row_loss = ADD(row_loss, MUL(LOAD(y[j]), SUB(lse, LOAD(z[j]))));
      }
      total = ADD(total, row_loss);
    }
  }
  partial[threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    {C} sum = ({C})0;
    for (u32 t = 0; t < blockDim.x; ++t) {
      sum = ADD(sum, partial[t]);
    }
    loss[0] = STORE(sum);
  }
}
"#;

/// The matmuls' simple kernels (every float; `f16`/`bf16` summed in `float`, rounded once):
/// one thread per output element, summing in increasing `p` from zero, which is the CPU's
/// exact order for every loop order it uses. Used on devices whose blocks cannot hold a
/// 16 x 16 tile.
const MATMUL: &str = r#"
extern "C" __global__ void matmul_{T}({S}* c, const {S}* a, const {S}* b, u64 m, u64 k,
                                      u64 n) {
  GRID_STRIDE(ij, m * n) {
    u64 i = ij / n, j = ij % n;
    {C} acc = ({C})0;
    for (u64 p = 0; p < k; ++p) {
      acc = ADD(acc, MUL(LOAD(a[i * k + p]), LOAD(b[p * n + j])));
    }
    c[ij] = STORE(acc);
  }
}

extern "C" __global__ void matmul_tn_{T}({S}* c, const {S}* a, const {S}* b, u64 m, u64 k,
                                         u64 n) {
  GRID_STRIDE(ij, m * n) {
    u64 i = ij / n, j = ij % n;
    {C} acc = ({C})0;
    for (u64 p = 0; p < k; ++p) {
      acc = ADD(acc, MUL(LOAD(a[p * m + i]), LOAD(b[p * n + j])));
    }
    c[ij] = STORE(acc);
  }
}

extern "C" __global__ void matmul_nt_{T}({S}* c, const {S}* a, const {S}* b, u64 m, u64 k,
                                         u64 n) {
  GRID_STRIDE(ij, m * n) {
    u64 i = ij / n, j = ij % n;
    {C} acc = ({C})0;
    for (u64 p = 0; p < k; ++p) {
      acc = ADD(acc, MUL(LOAD(a[i * k + p]), LOAD(b[j * k + p])));
    }
    c[ij] = STORE(acc);
  }
}
"#;

/// Side of the square output tile of the tiled matmuls (blocks of `TILE` x `TILE`
/// threads).
pub(super) const TILE: u32 = 16;

/// A tiled matmul: each block computes `TILE` x `TILE` outputs (blocks stride over the
/// tiles), staging `TILE`-wide slices of `a` and `b` in shared memory. Each thread still
/// sums its output in increasing `p` from zero, so the result is the simple kernel's, bit
/// for bit. `{LOAD_A}`/`{LOAD_B}` fill `at[i][p]` and `bt[p][j]` (coalesced reads of the
/// operand's layout; the `+ 1` column avoids bank conflicts on transposed stores).
const MATMUL_TILED: &str = r#"
extern "C" __global__ void {NAME}_tiled_{T}({S}* c, const {S}* a, const {S}* b, u64 m,
                                            u64 k, u64 n) {
  __shared__ {S} at[{TILE}][{TILE} + 1];
  __shared__ {S} bt[{TILE}][{TILE} + 1];
  u64 tiles_m = (m + {TILE} - 1) / {TILE}, tiles_n = (n + {TILE} - 1) / {TILE};
  u32 tx = threadIdx.x, ty = threadIdx.y;
  for (u64 tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
    u64 i0 = tile / tiles_n * {TILE}, j0 = tile % tiles_n * {TILE};
    u64 i = i0 + ty, j = j0 + tx;
    {C} acc = ({C})0;
    for (u64 p0 = 0; p0 < k; p0 += {TILE}) {
      {LOAD_A}
      {LOAD_B}
      __syncthreads();
      u64 steps = k - p0 < {TILE} ? k - p0 : {TILE};
      for (u64 q = 0; q < steps; ++q) {
        acc = ADD(acc, MUL(LOAD(at[ty][q]), LOAD(bt[q][tx])));
      }
      __syncthreads();
    }
    if (i < m && j < n) {
      c[i * n + j] = STORE(acc);
    }
  }
}
"#;

/// `at[i - i0][p - p0] = a(i, p)` for `a: [m, k]` (row-major).
const LOAD_A_ROWS: &str =
    "{ u64 p = p0 + tx; at[ty][tx] = (i < m && p < k) ? a[i * k + p] : ({S})0; }";
/// `at[i - i0][p - p0] = a(p, i)` for `a: [k, m]` (the transposed operand of `matmul_tn`).
const LOAD_A_COLUMNS: &str = "{ u64 ii = i0 + tx, p = p0 + ty; \
     at[tx][ty] = (ii < m && p < k) ? a[p * m + ii] : ({S})0; }";
/// `bt[p - p0][j - j0] = b(p, j)` for `b: [k, n]`.
const LOAD_B_ROWS: &str =
    "{ u64 p = p0 + ty; bt[ty][tx] = (p < k && j < n) ? b[p * n + j] : ({S})0; }";
/// `bt[p - p0][j - j0] = b(j, p)` for `b: [n, k]` (the transposed operand of `matmul_nt`).
const LOAD_B_COLUMNS: &str = "{ u64 jj = j0 + ty, p = p0 + tx; \
     bt[tx][ty] = (p < k && jj < n) ? b[jj * k + p] : ({S})0; }";

/// The C type of `fill`'s value parameter: the element's bits, widened to `u32` except
/// for 8-byte elements.
pub(super) const fn fill_value_is_u64(dtype: DType) -> bool {
    dtype.size_in_bytes() == 8
}

/// The CUDA C of every built-in kernel for `dtype` (see the module doc).
pub(super) fn builtin_source(dtype: DType) -> String {
    let t = types(dtype);
    let mut out = format!("/* tributary built-in kernels for {} */\n", t.name);
    out.push_str(COMMON);
    out.push_str(t.prelude);
    let value = if fill_value_is_u64(dtype) {
        "u64"
    } else {
        "u32"
    };
    out.push_str(&BITWISE.replace("{V}", value));
    match dtype {
        DType::I32 => out.push_str(ADD_I32),
        DType::U8 => {}
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
            out.push_str(&FLOAT.replace("{LOSS_BLOCK}", &LOSS_BLOCK.to_string()));
            out.push_str(MATMUL);
            for (name, load_a, load_b) in [
                ("matmul", LOAD_A_ROWS, LOAD_B_ROWS),
                ("matmul_tn", LOAD_A_COLUMNS, LOAD_B_ROWS),
                ("matmul_nt", LOAD_A_ROWS, LOAD_B_COLUMNS),
            ] {
                out.push_str(
                    &MATMUL_TILED
                        .replace("{LOAD_A}", load_a)
                        .replace("{LOAD_B}", load_b)
                        .replace("{NAME}", name)
                        .replace("{TILE}", &TILE.to_string()),
                );
            }
        }
    }
    out.replace("{T}", t.name)
        .replace("{S}", t.storage)
        .replace("{B}", t.bits)
        .replace("{C}", t.compute)
}
