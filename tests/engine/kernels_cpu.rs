//! The CPU built-in kernels against straightforward references, constructor errors, and
//! the borrow rules of kernel arguments.
#![cfg(not(tributary_loom))]
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use proptest::prelude::*;
use tributary::{
    kernels::{self, from_bytes, run_on_host, to_bytes, Access, RoutineSpec},
    Bf16, DType, Element, Error, NodeId, TensorNode, F16,
};

// ---------------------------------------------------------------------------------------
// Helpers.

/// xorshift64: deterministic, dependency-free test data.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in [-2, 2).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
    }
}

/// A float dtype as the tests see it: conversions through `f64` and a relative tolerance.
trait TF: Element + PartialEq {
    const TOL: f64;
    fn to(self) -> f64;
    fn of(x: f64) -> Self;
}

impl TF for f32 {
    const TOL: f64 = 1e-6;
    fn to(self) -> f64 {
        self as f64
    }
    fn of(x: f64) -> f32 {
        x as f32
    }
}

impl TF for f64 {
    const TOL: f64 = 1e-13;
    fn to(self) -> f64 {
        self
    }
    fn of(x: f64) -> f64 {
        x
    }
}

impl TF for F16 {
    const TOL: f64 = 1e-3;
    fn to(self) -> f64 {
        self.to_f32() as f64
    }
    fn of(x: f64) -> F16 {
        F16::from_f32(x as f32)
    }
}

impl TF for Bf16 {
    const TOL: f64 = 8e-3;
    fn to(self) -> f64 {
        self.to_f32() as f64
    }
    fn of(x: f64) -> Bf16 {
        Bf16::from_f32(x as f32)
    }
}

fn rand_vec<T: TF>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::of(rng.uniform())).collect()
}

fn wide<T: TF>(xs: &[T]) -> Vec<f64> {
    xs.iter().map(|x| x.to()).collect()
}

/// `got[i]` is within `T::TOL * (1 + scale[i])` of `want[i]`, where `scale[i]` bounds the
/// magnitudes that went into `want[i]`.
fn assert_close<T: TF>(what: &str, got: &[T], want: &[f64], scale: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let g = g.to();
        let tol = T::TOL * (1.0 + s.abs());
        assert!(
            (g - w).abs() <= tol,
            "{what} [{}] element {i}: got {g}, want {w} (tolerance {tol})",
            T::DTYPE
        );
    }
}

/// A tiny host interpreter: node contents as bytes, routines run in program order.
#[derive(Default)]
struct Host(HashMap<NodeId, Vec<u8>>);

impl Host {
    fn set<T: Element>(&mut self, node: &TensorNode, data: &[T]) {
        node.check_data(T::DTYPE, data.len()).unwrap();
        self.0.insert(node.id(), to_bytes(data));
    }

    fn get<T: Element>(&self, node: &TensorNode) -> Vec<T> {
        from_bytes(&self.0[&node.id()]).unwrap()
    }

    fn run_merge(&mut self, spec: &RoutineSpec, merge: Option<&[u8]>) -> Result<(), String> {
        let mut bufs: Vec<Vec<u8>> = spec
            .params
            .iter()
            .map(|p| {
                self.0.get(&p.node.id()).cloned().unwrap_or_else(|| {
                    // Never-initialised outputs start as garbage, to catch unwritten elements.
                    vec![0xA5; p.node.size_in_bytes().unwrap_or(0) as usize]
                })
            })
            .collect();
        run_on_host(spec, &mut bufs, merge)?;
        for (p, b) in spec.params.iter().zip(bufs) {
            if p.access.writes() {
                self.0.insert(p.node.id(), b);
            }
        }
        Ok(())
    }

    fn run(&mut self, spec: Result<RoutineSpec, Error>) {
        let spec = spec.unwrap();
        self.run_merge(&spec, None).unwrap();
    }
}

fn node(label: &str, dtype: DType, dims: &[usize]) -> TensorNode {
    TensorNode::new(label, dtype, dims)
}

macro_rules! for_floats {
    ($f:ident) => {
        $f::<f32>();
        $f::<f64>();
        $f::<F16>();
        $f::<Bf16>();
    };
}

// ---------------------------------------------------------------------------------------
// fill and copy: every dtype, exact.

#[test]
fn fill_every_dtype() {
    let mut h = Host::default();
    let shape = [2, 3];
    let cases: [(DType, f64); 6] = [
        (DType::F32, 0.1),
        (DType::F64, 0.1),
        (DType::F16, 0.1),
        (DType::BF16, 0.1),
        (DType::I32, -3.7),
        (DType::U8, 300.0),
    ];
    let nodes: Vec<_> = cases
        .iter()
        .map(|(d, v)| {
            let n = node("f", *d, &shape);
            h.run(kernels::fill(&n, *v));
            n
        })
        .collect();
    assert_eq!(h.get::<f32>(&nodes[0]), vec![0.1f32; 6]);
    assert_eq!(h.get::<f64>(&nodes[1]), vec![0.1f64; 6]);
    assert_eq!(h.get::<F16>(&nodes[2]), vec![F16::from_f32(0.1); 6]);
    assert_eq!(h.get::<Bf16>(&nodes[3]), vec![Bf16::from_f32(0.1); 6]);
    assert_eq!(h.get::<i32>(&nodes[4]), vec![-3; 6]);
    assert_eq!(h.get::<u8>(&nodes[5]), vec![255; 6]);
    // Saturating casts, NaN to zero.
    let i = node("i", DType::I32, &[3]);
    h.run(kernels::fill(&i, -1e20));
    assert_eq!(h.get::<i32>(&i), vec![i32::MIN; 3]);
    h.run(kernels::fill(&i, f64::NAN));
    assert_eq!(h.get::<i32>(&i), vec![0; 3]);
    let u = node("u", DType::U8, &[2]);
    h.run(kernels::fill(&u, -5.0));
    assert_eq!(h.get::<u8>(&u), vec![0; 2]);
}

#[test]
fn copy_every_dtype_is_bitwise() {
    let mut rng = Rng::new(1);
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U8,
    ] {
        let mut h = Host::default();
        // A reshaping copy: same element count, different shapes.
        let src = node("src", dtype, &[6]);
        let dst = node("dst", dtype, &[2, 3]);
        // Arbitrary bits, including NaN payloads and signed zeros for floats.
        let bytes: Vec<u8> = (0..6 * dtype.size_in_bytes())
            .map(|_| rng.next_u64() as u8)
            .collect();
        h.0.insert(src.id(), bytes.clone());
        h.run(kernels::copy(&dst, &src));
        assert_eq!(h.0[&dst.id()], bytes, "{dtype}");
        assert_eq!(h.0[&src.id()], bytes, "{dtype}: source untouched");
    }
}

// ---------------------------------------------------------------------------------------
// add_into and add_merge: floats and i32.

fn add_into_float<T: TF>() {
    let mut rng = Rng::new(2);
    let mut h = Host::default();
    let (d, s) = (node("d", T::DTYPE, &[4, 5]), node("s", T::DTYPE, &[20]));
    let (dv, sv) = (rand_vec::<T>(&mut rng, 20), rand_vec::<T>(&mut rng, 20));
    h.set(&d, &dv);
    h.set(&s, &sv);
    h.run(kernels::add_into(&d, &s));
    let want: Vec<f64> = dv.iter().zip(&sv).map(|(a, b)| a.to() + b.to()).collect();
    let scale: Vec<f64> = dv
        .iter()
        .zip(&sv)
        .map(|(a, b)| a.to().abs() + b.to().abs())
        .collect();
    assert_close("add_into", &h.get::<T>(&d), &want, &scale);
    assert_eq!(h.get::<T>(&s), sv, "source untouched");
}

fn add_merge_float<T: TF>() {
    let mut rng = Rng::new(3);
    let mut h = Host::default();
    let g = node("g", T::DTYPE, &[7]);
    let (gv, mv) = (rand_vec::<T>(&mut rng, 7), rand_vec::<T>(&mut rng, 7));
    h.set(&g, &gv);
    let spec = kernels::add_merge(&g).unwrap();
    assert_eq!(spec.merge.as_ref(), Some(&g));
    h.run_merge(&spec, Some(&to_bytes(&mv))).unwrap();
    let want: Vec<f64> = gv.iter().zip(&mv).map(|(a, b)| a.to() + b.to()).collect();
    let scale: Vec<f64> = gv
        .iter()
        .zip(&mv)
        .map(|(a, b)| a.to().abs() + b.to().abs())
        .collect();
    assert_close("add_merge", &h.get::<T>(&g), &want, &scale);
}

#[test]
fn add_into_and_add_merge_floats() {
    for_floats!(add_into_float);
    for_floats!(add_merge_float);
}

#[test]
fn add_into_and_add_merge_i32_wrap() {
    let mut h = Host::default();
    let (d, s) = (node("d", DType::I32, &[4]), node("s", DType::I32, &[4]));
    h.set(&d, &[1, -5, i32::MAX, 7]);
    h.set(&s, &[2, 5, 1, -10]);
    h.run(kernels::add_into(&d, &s));
    assert_eq!(h.get::<i32>(&d), vec![3, 0, i32::MIN, -3]);
    let spec = kernels::add_merge(&d).unwrap();
    h.run_merge(&spec, Some(&to_bytes(&[10i32, 20, 30, 40])))
        .unwrap();
    assert_eq!(h.get::<i32>(&d), vec![13, 20, i32::MIN + 30, 37]);
}

// ---------------------------------------------------------------------------------------
// scale, axpy, sgd_step, mul, relu, relu_backward: floats.

fn pointwise<T: TF>() {
    let mut rng = Rng::new(4);
    let n = 33;
    let mut h = Host::default();
    let x = node("x", T::DTYPE, &[3, 11]);
    let y = node("y", T::DTYPE, &[n]);
    let z = node("z", T::DTYPE, &[n]);
    let (xv, yv) = (rand_vec::<T>(&mut rng, n), rand_vec::<T>(&mut rng, n));
    let (xw, yw) = (wide(&xv), wide(&yv));
    let mag: Vec<f64> = xw
        .iter()
        .zip(&yw)
        .map(|(a, b)| 2.0 * (a.abs() + b.abs()))
        .collect();
    h.set(&x, &xv);
    h.set(&y, &yv);

    h.run(kernels::scale(&z, &x, -0.75));
    let want: Vec<f64> = xw.iter().map(|a| -0.75 * a).collect();
    assert_close("scale", &h.get::<T>(&z), &want, &mag);

    h.run(kernels::mul(&z, &x, &y));
    let want: Vec<f64> = xw.iter().zip(&yw).map(|(a, b)| a * b).collect();
    let sq: Vec<f64> = xw.iter().zip(&yw).map(|(a, b)| (a * b).abs()).collect();
    assert_close("mul", &h.get::<T>(&z), &want, &sq);

    h.run(kernels::relu(&z, &x));
    let want: Vec<f64> = xw.iter().map(|&a| if a > 0.0 { a } else { 0.0 }).collect();
    // relu and relu_backward only select values: exact.
    assert_eq!(wide(&h.get::<T>(&z)), want, "relu");

    h.run(kernels::relu_backward(&z, &y, &x));
    let want: Vec<f64> = xw
        .iter()
        .zip(&yw)
        .map(|(&p, &g)| if p > 0.0 { g } else { 0.0 })
        .collect();
    assert_eq!(wide(&h.get::<T>(&z)), want, "relu_backward");

    h.run(kernels::axpy(&y, &x, 0.5));
    let want: Vec<f64> = yw.iter().zip(&xw).map(|(b, a)| b + 0.5 * a).collect();
    assert_close("axpy", &h.get::<T>(&y), &want, &mag);

    h.set(&y, &yv);
    h.run(kernels::sgd_step(&y, &x, 0.1));
    let want: Vec<f64> = yw.iter().zip(&xw).map(|(b, a)| b - 0.1 * a).collect();
    assert_close("sgd_step", &h.get::<T>(&y), &want, &mag);
    assert_eq!(h.get::<T>(&x), xv, "inputs untouched");
}

#[test]
fn pointwise_floats() {
    for_floats!(pointwise);
}

#[test]
fn relu_edge_values() {
    let mut h = Host::default();
    let (d, s) = (node("d", DType::F32, &[5]), node("s", DType::F32, &[5]));
    h.set(
        &s,
        &[-0.0f32, 0.0, f32::NAN, f32::NEG_INFINITY, f32::INFINITY],
    );
    h.run(kernels::relu(&d, &s));
    let out = h.get::<f32>(&d);
    assert_eq!(out[0].to_bits(), 0.0f32.to_bits(), "relu(-0) = +0");
    assert_eq!(out[1], 0.0);
    assert!(out[2].is_nan(), "NaN propagates");
    assert_eq!(&out[3..], &[0.0, f32::INFINITY]);
}

// ---------------------------------------------------------------------------------------
// Row/column ops: add_row_bias and sum_rows.

fn row_ops<T: TF>() {
    let mut rng = Rng::new(5);
    let (m, n) = (6, 4);
    let mut h = Host::default();
    let a = node("a", T::DTYPE, &[m, n]);
    let bias = node("bias", T::DTYPE, &[n]);
    let col = node("col", T::DTYPE, &[n]);
    let (av, bv) = (rand_vec::<T>(&mut rng, m * n), rand_vec::<T>(&mut rng, n));
    let (aw, bw) = (wide(&av), wide(&bv));
    h.set(&a, &av);
    h.set(&bias, &bv);

    h.run(kernels::sum_rows(&col, &a));
    let want: Vec<f64> = (0..n)
        .map(|j| (0..m).map(|i| aw[i * n + j]).sum())
        .collect();
    let scale: Vec<f64> = (0..n)
        .map(|j| (0..m).map(|i| aw[i * n + j].abs()).sum())
        .collect();
    assert_close("sum_rows", &h.get::<T>(&col), &want, &scale);

    h.run(kernels::add_row_bias(&a, &bias));
    let want: Vec<f64> = (0..m * n).map(|ij| aw[ij] + bw[ij % n]).collect();
    let scale: Vec<f64> = (0..m * n)
        .map(|ij| aw[ij].abs() + bw[ij % n].abs())
        .collect();
    assert_close("add_row_bias", &h.get::<T>(&a), &want, &scale);
}

#[test]
fn row_ops_floats() {
    for_floats!(row_ops);
}

// ---------------------------------------------------------------------------------------
// matmul variants: bitwise equal to a naive triple loop (same summation order).

trait Wide: TF + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    const ZERO: Self;
}
impl Wide for f32 {
    const ZERO: f32 = 0.0;
}
impl Wide for f64 {
    const ZERO: f64 = 0.0;
}

/// `c[i,j] = Σ_p at(i,p) * bt(p,j)`, summed from zero in increasing p.
fn naive<T: Wide>(
    m: usize,
    k: usize,
    n: usize,
    at: impl Fn(usize, usize) -> T,
    bt: impl Fn(usize, usize) -> T,
) -> Vec<T> {
    let mut c = vec![T::ZERO; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = T::ZERO;
            for p in 0..k {
                s = s + at(i, p) * bt(p, j);
            }
            c[i * n + j] = s;
        }
    }
    c
}

fn check_matmuls<T: Wide + PartialEq>(m: usize, k: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut h = Host::default();
    let c = node("c", T::DTYPE, &[m, n]);

    // c = a b
    let (a, b) = (node("a", T::DTYPE, &[m, k]), node("b", T::DTYPE, &[k, n]));
    let (av, bv) = (
        rand_vec::<T>(&mut rng, m * k),
        rand_vec::<T>(&mut rng, k * n),
    );
    h.set(&a, &av);
    h.set(&b, &bv);
    h.run(kernels::matmul(&c, &a, &b));
    let want = naive(m, k, n, |i, p| av[i * k + p], |p, j| bv[p * n + j]);
    assert_eq!(h.get::<T>(&c), want, "matmul {m}x{k}x{n}");

    // c = aᵀ b, a: [k, m]
    let (a, b) = (node("a", T::DTYPE, &[k, m]), node("b", T::DTYPE, &[k, n]));
    let (av, bv) = (
        rand_vec::<T>(&mut rng, k * m),
        rand_vec::<T>(&mut rng, k * n),
    );
    h.set(&a, &av);
    h.set(&b, &bv);
    h.run(kernels::matmul_tn(&c, &a, &b));
    let want = naive(m, k, n, |i, p| av[p * m + i], |p, j| bv[p * n + j]);
    assert_eq!(h.get::<T>(&c), want, "matmul_tn {m}x{k}x{n}");

    // c = a bᵀ, b: [n, k]
    let (a, b) = (node("a", T::DTYPE, &[m, k]), node("b", T::DTYPE, &[n, k]));
    let (av, bv) = (
        rand_vec::<T>(&mut rng, m * k),
        rand_vec::<T>(&mut rng, n * k),
    );
    h.set(&a, &av);
    h.set(&b, &bv);
    h.run(kernels::matmul_nt(&c, &a, &b));
    let want = naive(m, k, n, |i, p| av[i * k + p], |p, j| bv[j * k + p]);
    assert_eq!(h.get::<T>(&c), want, "matmul_nt {m}x{k}x{n}");

    // Against an f64 reference too, so that the naive loop is not wrong the same way.
    let (a, b) = (node("a", T::DTYPE, &[m, k]), node("b", T::DTYPE, &[k, n]));
    h.set(&a, &av);
    let bv2 = rand_vec::<T>(&mut rng, k * n);
    h.set(&b, &bv2);
    h.run(kernels::matmul(&c, &a, &b));
    let (aw, bw) = (wide(&av), wide(&bv2));
    let want = naive(m, k, n, |i, p| aw[i * k + p], |p, j| bw[p * n + j]);
    let scale = naive(
        m,
        k,
        n,
        |i, p| aw[i * k + p].abs(),
        |p, j| bw[p * n + j].abs(),
    );
    assert_close("matmul vs f64", &h.get::<T>(&c), &want, &scale);
}

#[test]
fn matmul_variants_match_naive() {
    for (i, &(m, k, n)) in [(1, 1, 1), (3, 4, 5), (7, 2, 3), (5, 9, 1), (16, 16, 16)]
        .iter()
        .enumerate()
    {
        check_matmuls::<f32>(m, k, n, 10 + i as u64);
        check_matmuls::<f64>(m, k, n, 20 + i as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn matmul_variants_any_dims(m in 0usize..6, k in 0usize..6, n in 0usize..6, seed in any::<u64>()) {
        check_matmuls::<f32>(m, k, n, seed);
        check_matmuls::<f64>(m, k, n, seed);
    }
}

/// `f16`/`bf16` matmuls (exact mode, as `run_on_host` runs them): the operands widened to
/// `f32`, each output summed in `f32` in increasing `p`, rounded once to the dtype.
fn check_half_matmuls<T: TF>(m: usize, k: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut h = Host::default();
    let c = node("c", T::DTYPE, &[m, n]);
    let f = |x: &T| x.to() as f32;
    let round = |v: Vec<f32>| v.into_iter().map(|x| T::of(x as f64)).collect::<Vec<T>>();
    for layout in ["nn", "tn", "nt"] {
        let (a_dims, b_dims) = match layout {
            "nn" => ([m, k], [k, n]),
            "tn" => ([k, m], [k, n]),
            _ => ([m, k], [n, k]),
        };
        let (a, b) = (node("a", T::DTYPE, &a_dims), node("b", T::DTYPE, &b_dims));
        let (av, bv) = (
            rand_vec::<T>(&mut rng, m * k),
            rand_vec::<T>(&mut rng, k * n),
        );
        h.set(&a, &av);
        h.set(&b, &bv);
        let want = match layout {
            "nn" => {
                h.run(kernels::matmul(&c, &a, &b));
                naive(m, k, n, |i, p| f(&av[i * k + p]), |p, j| f(&bv[p * n + j]))
            }
            "tn" => {
                h.run(kernels::matmul_tn(&c, &a, &b));
                naive(m, k, n, |i, p| f(&av[p * m + i]), |p, j| f(&bv[p * n + j]))
            }
            _ => {
                h.run(kernels::matmul_nt(&c, &a, &b));
                naive(m, k, n, |i, p| f(&av[i * k + p]), |p, j| f(&bv[j * k + p]))
            }
        };
        let got = h.get::<T>(&c);
        assert!(
            got == round(want),
            "matmul_{layout} {m}x{k}x{n} ({})",
            T::DTYPE
        );
    }
}

#[test]
fn half_precision_matmuls_sum_in_f32_and_round_once() {
    for (i, &(m, k, n)) in [(1, 1, 1), (3, 4, 5), (7, 2, 3), (16, 33, 9)]
        .iter()
        .enumerate()
    {
        check_half_matmuls::<F16>(m, k, n, 30 + i as u64);
        check_half_matmuls::<Bf16>(m, k, n, 40 + i as u64);
    }
}

#[test]
fn kernels_are_deterministic() {
    let mut rng = Rng::new(77);
    let (m, k, n) = (13, 17, 11);
    let run = |av: &[f32], bv: &[f32]| {
        let mut h = Host::default();
        let (c, a, b) = (
            node("c", DType::F32, &[m, n]),
            node("a", DType::F32, &[m, k]),
            node("b", DType::F32, &[k, n]),
        );
        h.set(&a, av);
        h.set(&b, bv);
        h.run(kernels::matmul(&c, &a, &b));
        to_bytes(&h.get::<f32>(&c))
    };
    let (av, bv) = (
        rand_vec::<f32>(&mut rng, m * k),
        rand_vec::<f32>(&mut rng, k * n),
    );
    let first = run(&av, &bv);
    for _ in 0..3 {
        assert_eq!(run(&av, &bv), first);
    }
}

// ---------------------------------------------------------------------------------------
// softmax_xent: loss against a reference, gradient against finite differences.

fn softmax_ref(z: &[f64], y: &[f64], m: usize, c: usize) -> (f64, Vec<f64>) {
    let mut loss = 0.0;
    let mut grad = vec![0.0; m * c];
    for i in 0..m {
        let row = &z[i * c..(i + 1) * c];
        let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        for j in 0..c {
            let p = (row[j] - mx).exp() / s;
            loss -= y[i * c + j] * p.ln();
            grad[i * c + j] = p - y[i * c + j];
        }
    }
    (loss, grad)
}

fn onehot(rng: &mut Rng, m: usize, c: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * c];
    for i in 0..m {
        y[i * c + (rng.next_u64() % c as u64) as usize] = 1.0;
    }
    y
}

fn softmax_xent_matches_reference<T: TF>() {
    let mut rng = Rng::new(8);
    let (m, c) = (5, 4);
    let mut h = Host::default();
    let loss = node("loss", T::DTYPE, &[1]);
    let dl = node("dlogits", T::DTYPE, &[m, c]);
    let z = node("logits", T::DTYPE, &[m, c]);
    let y = node("labels", T::DTYPE, &[m, c]);
    // Logits spread widely, to exercise the max shift.
    let zv: Vec<T> = (0..m * c).map(|_| T::of(rng.uniform() * 4.0)).collect();
    let yw = onehot(&mut rng, m, c);
    let yv: Vec<T> = yw.iter().map(|&v| T::of(v)).collect();
    h.set(&z, &zv);
    h.set(&y, &yv);
    let scale = 0.25;
    h.run(kernels::softmax_xent(&loss, &dl, &z, &y, scale));
    let (want_loss, want_grad) = softmax_ref(&wide(&zv), &yw, m, c);
    // Loss: about log-sum-exp magnitudes (|z| <= 8) per row.
    assert_close("loss", &h.get::<T>(&loss), &[want_loss], &[8.0 * m as f64]);
    let want_grad: Vec<f64> = want_grad.iter().map(|g| g * scale).collect();
    assert_close("dlogits", &h.get::<T>(&dl), &want_grad, &vec![1.0; m * c]);
}

#[test]
fn softmax_xent_floats() {
    for_floats!(softmax_xent_matches_reference);
}

#[test]
fn softmax_xent_gradient_matches_finite_differences() {
    let mut rng = Rng::new(9);
    let (m, c) = (3, 5);
    let loss = node("loss", DType::F64, &[1]);
    let dl = node("dlogits", DType::F64, &[m, c]);
    let z = node("logits", DType::F64, &[m, c]);
    let y = node("labels", DType::F64, &[m, c]);
    let zv: Vec<f64> = (0..m * c).map(|_| rng.uniform() * 3.0).collect();
    let yv = onehot(&mut rng, m, c);
    let eval = |zv: &[f64]| {
        let mut h = Host::default();
        h.set(&z, zv);
        h.set(&y, &yv);
        h.run(kernels::softmax_xent(&loss, &dl, &z, &y, 1.0));
        (h.get::<f64>(&loss)[0], h.get::<f64>(&dl))
    };
    let (_, grad) = eval(&zv);
    let eps = 1e-6;
    for idx in 0..m * c {
        let mut plus = zv.clone();
        plus[idx] += eps;
        let mut minus = zv.clone();
        minus[idx] -= eps;
        let fd = (eval(&plus).0 - eval(&minus).0) / (2.0 * eps);
        assert!(
            (fd - grad[idx]).abs() < 1e-7,
            "element {idx}: finite difference {fd}, kernel {}",
            grad[idx]
        );
    }
}

// ---------------------------------------------------------------------------------------
// The built-ins compose into backprop: a 2-layer MLP gradient against finite differences.

#[test]
fn mlp_backprop_matches_finite_differences() {
    let mut rng = Rng::new(10);
    let (m, d, hdim, c) = (4, 3, 5, 3);
    let f = |l: &str, dims: &[usize]| node(l, DType::F64, dims);
    let (x, w1, b1, w2, b2, y) = (
        f("x", &[m, d]),
        f("w1", &[d, hdim]),
        f("b1", &[hdim]),
        f("w2", &[hdim, c]),
        f("b2", &[c]),
        f("y", &[m, c]),
    );
    let (z1, a1, z2, loss, dz2) = (
        f("z1", &[m, hdim]),
        f("a1", &[m, hdim]),
        f("z2", &[m, c]),
        f("loss", &[1]),
        f("dz2", &[m, c]),
    );
    let (dw2, db2, da1, dz1, dw1, db1) = (
        f("dw2", &[hdim, c]),
        f("db2", &[c]),
        f("da1", &[m, hdim]),
        f("dz1", &[m, hdim]),
        f("dw1", &[d, hdim]),
        f("db1", &[hdim]),
    );
    let mut h = Host::default();
    let xv: Vec<f64> = (0..m * d).map(|_| rng.uniform()).collect();
    let w1v: Vec<f64> = (0..d * hdim).map(|_| rng.uniform()).collect();
    let b1v: Vec<f64> = (0..hdim).map(|_| rng.uniform() * 0.5).collect();
    let w2v: Vec<f64> = (0..hdim * c).map(|_| rng.uniform()).collect();
    let b2v: Vec<f64> = (0..c).map(|_| rng.uniform() * 0.5).collect();
    let yv = onehot(&mut rng, m, c);
    h.set(&x, &xv);
    h.set(&b1, &b1v);
    h.set(&w2, &w2v);
    h.set(&b2, &b2v);
    h.set(&y, &yv);
    let grad_scale = 1.0 / m as f64;
    let forward = |h: &mut Host, w1v: &[f64]| {
        h.set(&w1, w1v);
        h.run(kernels::matmul(&z1, &x, &w1));
        h.run(kernels::add_row_bias(&z1, &b1));
        h.run(kernels::relu(&a1, &z1));
        h.run(kernels::matmul(&z2, &a1, &w2));
        h.run(kernels::add_row_bias(&z2, &b2));
        h.run(kernels::softmax_xent(&loss, &dz2, &z2, &y, grad_scale));
        h.get::<f64>(&loss)[0] * grad_scale // mean loss
    };
    forward(&mut h, &w1v);
    h.run(kernels::matmul_tn(&dw2, &a1, &dz2));
    h.run(kernels::sum_rows(&db2, &dz2));
    h.run(kernels::matmul_nt(&da1, &dz2, &w2));
    h.run(kernels::relu_backward(&dz1, &da1, &z1));
    h.run(kernels::matmul_tn(&dw1, &x, &dz1));
    h.run(kernels::sum_rows(&db1, &dz1));
    let dw1v = h.get::<f64>(&dw1);
    assert_eq!(h.get::<f64>(&db1).len(), hdim);
    assert_eq!(h.get::<f64>(&db2).len(), c);
    let eps = 1e-6;
    for idx in 0..d * hdim {
        let mut p = w1v.clone();
        p[idx] += eps;
        let mut q = w1v.clone();
        q[idx] -= eps;
        let mut hp = Host(h.0.clone());
        let fd = (forward(&mut hp, &p) - forward(&mut hp, &q)) / (2.0 * eps);
        assert!(
            (fd - dw1v[idx]).abs() < 1e-6,
            "dw1[{idx}]: finite difference {fd}, backprop {}",
            dw1v[idx]
        );
    }
    // One SGD step lowers the loss.
    let before = forward(&mut h, &w1v);
    h.run(kernels::sgd_step(&w1, &dw1, 0.1));
    let stepped = h.get::<f64>(&w1);
    let after = forward(&mut h, &stepped);
    assert!(after < before, "loss {before} -> {after}");
}

// ---------------------------------------------------------------------------------------
// Constructor errors.

#[test]
fn constructor_errors_are_typed() {
    let f32n = |l: &str, d: &[usize]| node(l, DType::F32, d);
    let (a, b) = (f32n("a", &[4]), f32n("b", &[4]));
    let wrong = node("w", DType::F64, &[4]);
    let ints = node("i", DType::I32, &[4]);
    let bytes = node("u", DType::U8, &[4]);

    let dtype = |r: Result<RoutineSpec, Error>| matches!(r, Err(Error::DTypeMismatch { .. }));
    let size = |r: Result<RoutineSpec, Error>| matches!(r, Err(Error::SizeMismatch { .. }));
    let invalid = |r: Result<RoutineSpec, Error>| matches!(r, Err(Error::InvalidRoutine { .. }));

    // Dtypes differ, or are not supported by the built-in.
    assert!(dtype(kernels::copy(&a, &wrong)));
    assert!(dtype(kernels::add_into(&a, &wrong)));
    assert!(dtype(kernels::add_into(
        &bytes,
        &node("u2", DType::U8, &[4])
    )));
    assert!(dtype(kernels::add_merge(&bytes)));
    assert!(dtype(kernels::scale(
        &ints,
        &node("i2", DType::I32, &[4]),
        2.0
    )));
    assert!(dtype(kernels::axpy(&a, &wrong, 1.0)));
    assert!(dtype(kernels::sgd_step(
        &ints,
        &node("i2", DType::I32, &[4]),
        1.0
    )));
    assert!(dtype(kernels::mul(&a, &b, &wrong)));
    assert!(dtype(kernels::relu(&ints, &node("i2", DType::I32, &[4]))));
    assert!(dtype(kernels::matmul(
        &node("i1", DType::I32, &[2, 2]),
        &node("i2", DType::I32, &[2, 2]),
        &node("i3", DType::I32, &[2, 2])
    )));
    assert!(dtype(kernels::matmul(
        &f32n("c", &[2, 2]),
        &node("a64", DType::F64, &[2, 2]),
        &f32n("b", &[2, 2])
    )));
    assert!(dtype(kernels::softmax_xent(
        &node("l64", DType::F64, &[1]),
        &f32n("dl", &[2, 3]),
        &f32n("z", &[2, 3]),
        &f32n("y", &[2, 3]),
        1.0
    )));

    // Sizes and shapes.
    assert!(size(kernels::copy(&a, &f32n("c", &[5]))));
    assert!(size(kernels::add_into(&a, &f32n("c", &[2, 3]))));
    assert!(size(kernels::relu_backward(&a, &b, &f32n("c", &[3]))));
    let (c23, a24) = (f32n("c", &[2, 3]), f32n("a", &[2, 4]));
    assert!(size(kernels::matmul(&c23, &a24, &f32n("b", &[3, 3])))); // inner dims
    assert!(size(kernels::matmul(&c23, &a24, &f32n("b", &[4, 2])))); // c's shape
    assert!(size(kernels::matmul(
        &c23,
        &f32n("a", &[8]),
        &f32n("b", &[4, 3])
    ))); // not 2-D
    assert!(size(kernels::matmul_tn(&c23, &a24, &f32n("b", &[2, 3])))); // aᵀ is [4,2]
    assert!(kernels::matmul_tn(&f32n("c", &[4, 3]), &a24, &f32n("b", &[2, 3])).is_ok());
    assert!(size(kernels::matmul_nt(&c23, &a24, &f32n("b", &[4, 3])))); // bᵀ needs [3,4]
    assert!(kernels::matmul_nt(&c23, &a24, &f32n("b", &[3, 4])).is_ok());
    assert!(size(kernels::add_row_bias(&c23, &f32n("bias", &[2]))));
    assert!(size(kernels::add_row_bias(
        &f32n("v", &[6]),
        &f32n("bias", &[6])
    )));
    assert!(size(kernels::sum_rows(&f32n("s", &[2]), &c23)));
    let (dl, z, y) = (f32n("dl", &[2, 3]), f32n("z", &[2, 3]), f32n("y", &[2, 3]));
    assert!(size(kernels::softmax_xent(
        &f32n("l", &[2]),
        &dl,
        &z,
        &y,
        1.0
    )));
    assert!(size(kernels::softmax_xent(
        &f32n("l", &[1]),
        &dl,
        &z,
        &f32n("y", &[5]),
        1.0
    )));
    assert!(kernels::softmax_xent(&f32n("l", &[1]), &dl, &z, &y, 1.0).is_ok());

    // The same node twice.
    assert!(invalid(kernels::add_into(&a, &a)));
    assert!(invalid(kernels::copy(&a, &a)));
    assert!(invalid(kernels::mul(&a, &b, &b)));
    assert!(invalid(kernels::scale(&a, &a, 2.0)));
    let sq = f32n("sq", &[2, 2]);
    assert!(invalid(kernels::matmul(&f32n("c", &[2, 2]), &sq, &sq)));
    assert!(invalid(kernels::softmax_xent(
        &f32n("l", &[1]),
        &z,
        &z,
        &y,
        1.0
    )));
}

// ---------------------------------------------------------------------------------------
// Custom kernels and the borrow rules of their arguments.

#[test]
fn custom_kernel_runs_and_borrow_flags_refuse_aliasing() {
    let a = node("a", DType::F32, &[3]);
    let b = node("b", DType::F32, &[3]);
    let spec = RoutineSpec::custom(
        "double",
        vec![(a.clone(), Access::ReadWrite), (b.clone(), Access::Read)],
        None,
        |args| {
            // Read-write parameter: a shared view first ...
            let before: f32 = args.input::<f32>(0)?.iter().sum();
            // ... then a mutable one is refused,
            if args.output::<f32>(0).is_ok() {
                return Err("mutable borrow after a shared one was allowed".into());
            }
            // reading parameter 1 as the wrong type is refused,
            if args.input::<i32>(1).is_ok() {
                return Err("dtype mismatch allowed".into());
            }
            // a Read parameter cannot be written,
            if args.output::<f32>(1).is_ok() {
                return Err("wrote a Read parameter".into());
            }
            // and shared borrows can coexist.
            let x = args.input::<f32>(1)?;
            let x2 = args.input::<f32>(1)?;
            if x != x2 || before.is_nan() {
                return Err("shared views differ".into());
            }
            Ok(())
        },
    )
    .unwrap();
    let mut h = Host::default();
    h.set(&a, &[1.0f32, 2.0, 3.0]);
    h.set(&b, &[4.0f32, 5.0, 6.0]);
    h.run_merge(&spec, None).unwrap();

    // Mutable twice is refused; a custom error is reported.
    let twice = RoutineSpec::custom("twice", vec![(a.clone(), Access::Write)], None, |args| {
        let first = args.output::<f32>(0)?;
        first[0] = 9.0;
        match args.output::<f32>(0) {
            Ok(_) => Err("second mutable borrow allowed".into()),
            Err(e) => Err(format!("second mutable borrow: {e}")),
        }
    })
    .unwrap();
    let err = h.run_merge(&twice, None).unwrap_err();
    assert!(err.contains("already borrowed mutably"), "{err}");
    assert_eq!(h.get::<f32>(&a), vec![1.0, 2.0, 3.0], "unchanged on error");

    // A custom kernel using the merge buffer.
    let merge_sum = RoutineSpec::custom(
        "merge_sum",
        vec![(a.clone(), Access::ReadWrite)],
        Some(a.clone()),
        |args| {
            let m = args.merge::<f32>()?;
            let out = args.output::<f32>(0)?;
            for (o, x) in out.iter_mut().zip(m) {
                *o += 2.0 * x;
            }
            Ok(())
        },
    )
    .unwrap();
    h.run_merge(&merge_sum, Some(&to_bytes(&[1.0f32, 1.0, 1.0])))
        .unwrap();
    assert_eq!(h.get::<f32>(&a), vec![3.0, 4.0, 5.0]);
    assert!(
        h.run_merge(&merge_sum, None).is_err(),
        "merge buffer missing"
    );
}

#[test]
fn scale_in_place_and_copy_range() {
    use tributary::{kernels, DType, TensorNode};
    let x = TensorNode::new("x", DType::F32, [4]);
    let spec = kernels::scale_in_place(&x, 0.5).unwrap();
    let mut bufs = vec![kernels::to_bytes(&[2.0f32, 4.0, -6.0, 1.0])];
    kernels::run_on_host(&spec, &mut bufs, None).unwrap();
    assert_eq!(
        kernels::from_bytes::<f32>(&bufs[0]).unwrap(),
        vec![1.0, 2.0, -3.0, 0.5]
    );

    let dst = TensorNode::new("dst", DType::I32, [6]);
    let src = TensorNode::new("src", DType::I32, [3]);
    let spec = kernels::copy_range(&dst, 2, &src, 1, 2).unwrap();
    let mut bufs = vec![
        kernels::to_bytes(&[0i32; 6]),
        kernels::to_bytes(&[7i32, 8, 9]),
    ];
    kernels::run_on_host(&spec, &mut bufs, None).unwrap();
    assert_eq!(
        kernels::from_bytes::<i32>(&bufs[0]).unwrap(),
        vec![0, 0, 8, 9, 0, 0]
    );
    // Out-of-bounds ranges and dtype mismatches are refused at construction.
    assert!(kernels::copy_range(&dst, 5, &src, 0, 2).is_err());
    assert!(kernels::copy_range(&dst, 0, &src, 2, 2).is_err());
    let f = TensorNode::new("f", DType::F32, [3]);
    assert!(kernels::copy_range(&dst, 0, &f, 0, 1).is_err());
}
