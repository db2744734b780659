//! The CPU matmuls in their two modes, [`KernelMode`]. See DESIGN.md §5, "The CPU's two kernel
//! modes". `Exact` keeps the summation order every backend reproduces. `Fast` calls
//! `matrixmultiply`'s blocked kernels on one thread. The same inputs always give the same bits,
//! but not the exact mode's bits.

use super::{check_len, product, KResult, Num, Real};
use crate::kernels::{args::KernelArgs, KernelMode};

/// Which operand is transposed: `Nn` is `a b`, `Tn` is `aᵀ b`, `Nt` is `a bᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Layout {
    Nn,
    Tn,
    Nt,
}

impl Layout {
    /// The element counts of `(c, a, b)` for an `m x k` by `k x n` product.
    fn lens(self, m: usize, k: usize, n: usize) -> Result<(usize, usize, usize), String> {
        let c = product(m, n)?;
        Ok(match self {
            Layout::Nn => (c, product(m, k)?, product(k, n)?),
            Layout::Tn => (c, product(k, m)?, product(k, n)?),
            Layout::Nt => (c, product(m, k)?, product(n, k)?),
        })
    }
}

/// A computation type `matrixmultiply` multiplies natively (`f32`, `f64`).
pub(super) trait Gemm: Num {
    /// `c = a b` with element strides (row, column) for each operand.
    ///
    /// # Safety
    ///
    /// For every operand `x` of `r x s` elements (`a`: `m x k`, `b`: `k x n`, `c`:
    /// `m x n`) and every `i < r`, `j < s`, `x + i * rs + j * cs` must lie inside one live
    /// allocation of `Self`; `a` and `b` must be readable, `c` writable, and `c` must not
    /// overlap `a` or `b`; `c`'s strides must not make two of its elements alias.
    unsafe fn gemm(
        dims: (usize, usize, usize),
        a: (*const Self, isize, isize),
        b: (*const Self, isize, isize),
        c: (*mut Self, isize, isize),
    );
}

/// `Gemm` through one of `matrixmultiply`'s functions.
macro_rules! gemm_through {
    ($t:ty, $f:path) => {
        impl Gemm for $t {
            unsafe fn gemm(
                (m, k, n): (usize, usize, usize),
                (a, rsa, csa): (*const $t, isize, isize),
                (b, rsb, csb): (*const $t, isize, isize),
                (c, rsc, csc): (*mut $t, isize, isize),
            ) {
                // SAFETY: the caller's contract is the library's: operands in bounds for the
                // given dimensions and strides, `c` writable and not overlapping `a` or `b`.
                // With `beta = 0` `c` is only written, never read.
                unsafe { $f(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, 0.0, c, rsc, csc) }
            }
        }
    };
}

gemm_through!(f32, matrixmultiply::sgemm);
gemm_through!(f64, matrixmultiply::dgemm);

/// Runs a matmul of `layout` in `mode`: `c[m,n] = op(a) op(b)`.
///
/// `f32` and `f64` are multiplied in place. `f16` and `bf16` go through `f32`: the operands
/// widened (exactly), multiplied in `f32` in `mode`, each output rounded once to `T` (ties
/// to even), as the Vulkan and CUDA kernels do.
pub(super) fn matmul<T: Real>(
    args: &KernelArgs<'_>,
    layout: Layout,
    dims: (usize, usize, usize),
    mode: KernelMode,
) -> KResult
where
    T::C: Gemm,
{
    let (m, k, n) = dims;
    let (c_len, a_len, b_len) = layout.lens(m, k, n)?;
    let c = args.output::<T>(0)?;
    let a = args.input::<T>(1)?;
    let b = args.input::<T>(2)?;
    check_len("c", c.len(), c_len)?;
    check_len("a", a.len(), a_len)?;
    check_len("b", b.len(), b_len)?;
    if let (Some(a), Some(b)) = (T::as_comp(a), T::as_comp(b)) {
        if let Some(c) = T::as_comp_mut(&mut *c) {
            return multiply(layout, dims, c, a, b, mode);
        }
    }
    let widen = |x: &[T]| x.iter().map(|v| v.load()).collect::<Vec<T::C>>();
    let mut wide = vec![T::C::ZERO; c.len()];
    multiply(layout, dims, &mut wide, &widen(a), &widen(b), mode)?;
    for (out, w) in c.iter_mut().zip(wide) {
        *out = T::store(w);
    }
    Ok(())
}

/// The product in the computation type, operands in place.
fn multiply<N: Gemm>(
    layout: Layout,
    (m, k, n): (usize, usize, usize),
    c: &mut [N],
    a: &[N],
    b: &[N],
    mode: KernelMode,
) -> KResult {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        c.fill(N::ZERO);
        return Ok(());
    }
    match mode {
        KernelMode::Exact => {
            exact(layout, (m, k, n), c, a, b);
            Ok(())
        }
        KernelMode::Fast => fast(layout, (m, k, n), c, a, b),
    }
}

/// `matrixmultiply` over the operands in place: a transposed operand is the same memory
/// read with swapped strides, so nothing is copied here (the library packs its blocks).
fn fast<N: Gemm>(
    layout: Layout,
    (m, k, n): (usize, usize, usize),
    c: &mut [N],
    a: &[N],
    b: &[N],
) -> KResult {
    // Every dimension is at most a slice length, so it fits `isize`; checked anyway.
    let stride = |x: usize| isize::try_from(x).map_err(|_| format!("dimension {x} too large"));
    let (mi, ki, ni) = (stride(m)?, stride(k)?, stride(n)?);
    let (ra, ca) = match layout {
        Layout::Nn | Layout::Nt => (ki, 1), // a: [m,k]
        Layout::Tn => (1, mi),              // a: [k,m], read as its transpose
    };
    let (rb, cb) = match layout {
        Layout::Nn | Layout::Tn => (ni, 1), // b: [k,n]
        Layout::Nt => (1, ki),              // b: [n,k], read as its transpose
    };
    // SAFETY: the lengths were checked against the layout (`Layout::lens`): `a` holds the
    // `m x k` operand at strides `(ra, ca)`, `b` the `k x n` one at `(rb, cb)` and `c` the
    // `m x n` result at `(n, 1)`, so every element the library addresses lies inside its
    // slice. `c` is a `&mut` borrow distinct from the shared `a` and `b`, so it overlaps
    // neither.
    unsafe {
        N::gemm(
            (m, k, n),
            (a.as_ptr(), ra, ca),
            (b.as_ptr(), rb, cb),
            (c.as_mut_ptr(), ni, 1),
        )
    };
    Ok(())
}

/// The exact order: each `c[i,j]` summed from zero in increasing `p`, one rounding per
/// multiply and per add. The loop orders (i-p-j, p-i-j, i-j-p) are the cache-friendly ones
/// for each layout; none changes the order of any one output's sum.
fn exact<N: Num>(layout: Layout, (m, k, n): (usize, usize, usize), c: &mut [N], a: &[N], b: &[N]) {
    match layout {
        Layout::Nn => {
            c.fill(N::ZERO);
            for (c_row, a_row) in c.chunks_exact_mut(n).zip(a.chunks_exact(k)) {
                for (&a_ip, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
                    for (c_ij, &b_pj) in c_row.iter_mut().zip(b_row) {
                        *c_ij = *c_ij + a_ip * b_pj;
                    }
                }
            }
        }
        Layout::Tn => {
            c.fill(N::ZERO);
            for (a_row, b_row) in a.chunks_exact(m).zip(b.chunks_exact(n)) {
                for (&a_pi, c_row) in a_row.iter().zip(c.chunks_exact_mut(n)) {
                    for (c_ij, &b_pj) in c_row.iter_mut().zip(b_row) {
                        *c_ij = *c_ij + a_pi * b_pj;
                    }
                }
            }
        }
        Layout::Nt => {
            for (c_row, a_row) in c.chunks_exact_mut(n).zip(a.chunks_exact(k)) {
                for (c_ij, b_row) in c_row.iter_mut().zip(b.chunks_exact(k)) {
                    let mut acc = N::ZERO;
                    for (&x, &y) in a_row.iter().zip(b_row) {
                        acc = acc + x * y;
                    }
                    *c_ij = acc;
                }
            }
        }
    }
}
