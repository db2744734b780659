//! One suite, run on every backend present (DESIGN.md §4, "tests/"): the CPU backend
//! always, the Vulkan backend when a driver loads (2 logical devices x 2 streams, e.g. on
//! Mesa's lavapipe), and Vulkan again with host access to pool memory switched off (the
//! staging path of discrete GPUs).
//!
//! Every test body is written once over a `Kind`; `for_each_backend!` (in
//! `tributary_testkit`) makes one `#[test]` per backend kind (`cpu::name`, `vulkan::name`,
//! `vulkan_staging::name`); see `tributary_testkit::support` for skipping and
//! `TRIBUTARY_REQUIRE_VULKAN`.
//!
//! Results are compared with the CPU built-ins (`kernels::run_on_host`): bitwise for
//! everything but `softmax_xent`, whose `exp`/`log` come from the driver (tolerances in
//! [`tolerance`]).

#![cfg(not(tributary_loom))]
#![allow(clippy::unwrap_used)]

use support::{all, backend, failing, slow_copy_on, slow_fill_on, slow_fill_wgsl, Kind, N};
use tributary::{
    kernels::{
        self, from_bytes, to_bytes, Access, CudaKernel, CudaScalar, RoutineSpec, ShaderKernel,
    },
    memory::PoolConfig,
    protocol::Context,
    Bf16, DType, Engine, Error, HostedKind, MemoryMode, MergeBufferUse, Sharing, TensorNode, F16,
};
use tributary_testkit::{for_each_backend, support};

/// An engine of 2 devices x 2 streams on `kind`.
fn engine(kind: Kind, test: &str) -> Option<Engine> {
    let b = backend(kind, 2, test)?;
    Some(Engine::with_backend(b, 2, PoolConfig::default()).expect("engine"))
}

for_each_backend!(staging:
    builtins_match_cpu,
    large_dispatches_stride_over_the_grid,
    host_transfers_and_memset,
    raw_war_waw_across_streams,
    cross_device_copies_in_all_merge_modes,
    copy_merge_takes_the_other_replica_bitwise,
    failure_propagates_with_its_root_cause,
    foreign_kernels_are_refused_at_link,
    pools_are_reused_under_endless_work,
    long_reductions_are_exact_or_refused,
    queues_check_plans_and_never_truncate,
    programs_run_like_their_plans,
);

// ---------------------------------------------------------------------------------------
// Data helpers.

/// Deterministic pseudo-random numbers in [-2, 2), with exact zeros and small integers
/// mixed in (relu edges, exact sums); never subnormal.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let u = (self.0 >> 11) as f64 / (1u64 << 53) as f64;
        match self.0 % 11 {
            0 => 0.0,
            1 => ((self.0 >> 20) % 5) as f64 - 2.0,
            _ => u * 4.0 - 2.0,
        }
    }
}

/// `n` random elements of `dtype`, as bytes.
fn random(dtype: DType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let v: Vec<f64> = (0..n).map(|_| rng.next()).collect();
    match dtype {
        DType::F32 => to_bytes(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        DType::F64 => to_bytes(&v),
        DType::F16 => to_bytes(
            &v.iter()
                .map(|&x| F16::from_f32(x as f32))
                .collect::<Vec<_>>(),
        ),
        DType::BF16 => to_bytes(
            &v.iter()
                .map(|&x| Bf16::from_f32(x as f32))
                .collect::<Vec<_>>(),
        ),
        DType::I32 => to_bytes(&v.iter().map(|&x| (x * 1e9) as i32).collect::<Vec<_>>()),
        DType::U8 => v.iter().map(|&x| ((x + 2.0) * 60.0) as u8).collect(),
    }
}

/// One-hot rows of `c` classes, as bytes of `dtype`.
fn one_hot(dtype: DType, m: usize, c: usize) -> Vec<u8> {
    let v: Vec<f64> = (0..m * c)
        .map(|i| if i % c == (i / c * 7) % c { 1.0 } else { 0.0 })
        .collect();
    match dtype {
        DType::F32 => to_bytes(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        DType::F64 => to_bytes(&v),
        DType::F16 => to_bytes(
            &v.iter()
                .map(|&x| F16::from_f32(x as f32))
                .collect::<Vec<_>>(),
        ),
        DType::BF16 => to_bytes(
            &v.iter()
                .map(|&x| Bf16::from_f32(x as f32))
                .collect::<Vec<_>>(),
        ),
        _ => unreachable!("one-hot labels are floats"),
    }
}

/// Uploads `bytes` as the value of hosted `node` into a child of `ctx`.
fn upload(e: &mut Engine, ctx: &Context, node: &TensorNode, bytes: &[u8]) -> Context {
    let r = match node.dtype() {
        DType::F32 => e.init_from_host(ctx, node, &from_bytes::<f32>(bytes).unwrap()),
        DType::F64 => e.init_from_host(ctx, node, &from_bytes::<f64>(bytes).unwrap()),
        DType::F16 => e.init_from_host(ctx, node, &from_bytes::<F16>(bytes).unwrap()),
        DType::BF16 => e.init_from_host(ctx, node, &from_bytes::<Bf16>(bytes).unwrap()),
        DType::I32 => e.init_from_host(ctx, node, &from_bytes::<i32>(bytes).unwrap()),
        DType::U8 => e.init_from_host(ctx, node, bytes),
    };
    r.unwrap_or_else(|err| panic!("upload of {node}: {err}"))
}

/// Reads `node`'s buffer in `ctx` as bytes.
fn download(e: &mut Engine, ctx: &Context, node: &TensorNode) -> Vec<u8> {
    let r = match node.dtype() {
        DType::F32 => e.read::<f32>(ctx, node).map(|v| to_bytes(&v)),
        DType::F64 => e.read::<f64>(ctx, node).map(|v| to_bytes(&v)),
        DType::F16 => e.read::<F16>(ctx, node).map(|v| to_bytes(&v)),
        DType::BF16 => e.read::<Bf16>(ctx, node).map(|v| to_bytes(&v)),
        DType::I32 => e.read::<i32>(ctx, node).map(|v| to_bytes(&v)),
        DType::U8 => e.read::<u8>(ctx, node),
    };
    r.unwrap_or_else(|err| panic!("read of {node}: {err}"))
}

/// The largest allowed difference of `got` from `want` for a built-in: `None` = bitwise.
fn tolerance(builtin: &str, dtype: DType) -> Option<f64> {
    match (builtin, dtype) {
        ("softmax_xent", DType::F32) => Some(1e-5),
        ("softmax_xent", DType::F64) => Some(1e-12),
        ("softmax_xent", DType::F16) => Some(1e-3),
        ("softmax_xent", DType::BF16) => Some(8e-3),
        _ => None,
    }
}

fn as_f64(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => from_bytes::<f32>(bytes)
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect(),
        DType::F64 => from_bytes::<f64>(bytes).unwrap(),
        DType::F16 => from_bytes::<F16>(bytes)
            .unwrap()
            .iter()
            .map(|x| x.to_f32() as f64)
            .collect(),
        DType::BF16 => from_bytes::<Bf16>(bytes)
            .unwrap()
            .iter()
            .map(|x| x.to_f32() as f64)
            .collect(),
        DType::I32 => from_bytes::<i32>(bytes)
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect(),
        DType::U8 => bytes.iter().map(|&x| x as f64).collect(),
    }
}

/// Compares one output: bitwise, or within a relative tolerance (of the magnitude, at
/// least 1).
fn check_output(what: &str, dtype: DType, tol: Option<f64>, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    match tol {
        None => {
            if got != want {
                let (g, w) = (as_f64(dtype, got), as_f64(dtype, want));
                let first = g
                    .iter()
                    .zip(&w)
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                    .unwrap_or(0);
                panic!(
                    "{what}: not bitwise equal to the CPU result; first difference at element \
                     {first}: got {} want {}",
                    g[first], w[first]
                );
            }
        }
        Some(tol) => {
            for (i, (g, w)) in as_f64(dtype, got)
                .iter()
                .zip(as_f64(dtype, want))
                .enumerate()
            {
                let err = (g - w).abs() / w.abs().max(1.0);
                assert!(
                    err <= tol || (g.is_nan() && w.is_nan()),
                    "{what}: element {i}: got {g}, want {w} (relative error {err:e} > {tol:e})"
                );
            }
        }
    }
}

fn node(label: &str, dtype: DType, dims: &[usize]) -> TensorNode {
    TensorNode::new(label, dtype, dims.to_vec())
}

// ---------------------------------------------------------------------------------------
// Built-ins.

/// Runs `spec` on device 0 stream 0 of `e` with `inputs` for every parameter (zeros for
/// `Write` ones) and checks every written parameter against the CPU reference.
fn check_spec(e: &mut Engine, spec: RoutineSpec, mut inputs: Vec<Vec<u8>>) {
    let name = spec.name.clone();
    let (builtin, dtype) = match &spec.kernel {
        kernels::Kernel::Builtin(b) => (b.name(), spec.params[0].node.dtype()),
        _ => unreachable!(),
    };
    for (p, buf) in spec.params.iter().zip(inputs.iter_mut()) {
        if p.access == Access::Write {
            *buf = vec![0; p.node.size_in_bytes().unwrap() as usize];
        }
    }
    let mut want = inputs.clone();
    kernels::run_on_host(&spec, &mut want, None)
        .unwrap_or_else(|err| panic!("{name} on host: {err}"));
    let mut ctx = e.context(0, 0).unwrap();
    for (p, buf) in spec.params.iter().zip(&inputs) {
        if p.access.reads() {
            ctx = upload(e, &ctx, &p.node, buf);
        }
    }
    let params = spec.params.clone();
    let r = e
        .link(&ctx, spec)
        .unwrap_or_else(|err| panic!("link {name}: {err}"));
    e.schedule(&r).unwrap();
    for (i, p) in params.iter().enumerate() {
        if p.access.writes() {
            let got = download(e, r.context(), &p.node);
            check_output(
                &format!("{name} ({dtype}), argument {i}"),
                dtype,
                tolerance(builtin, dtype),
                &got,
                &want[i],
            );
        }
    }
    e.finalize(r.context()).unwrap();
}

fn builtins_match_cpu(kind: Kind) {
    let Some(mut e) = engine(kind, "builtins_match_cpu") else {
        return;
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let all = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U8,
    ];
    let floats = [DType::F32, DType::F64, DType::F16, DType::BF16];
    // Fresh nodes for every check (a node used on a device cannot become hosted).
    let v = |d: DType, n: usize| node("v", d, &[n]);
    // Odd element counts exercise the packed 16-bit tails and partial words of `u8`.
    for &n in &[1usize, 37, 1000] {
        for &d in &all {
            let r = &mut rng;
            check_spec(&mut e, kernels::fill(&v(d, n), 1.75).unwrap(), vec![vec![]]);
            check_spec(&mut e, kernels::fill(&v(d, n), -3.0).unwrap(), vec![vec![]]);
            let ins = vec![random(d, n, r), random(d, n, r)];
            check_spec(&mut e, kernels::copy(&v(d, n), &v(d, n)).unwrap(), ins);
            let ins = vec![random(d, n, r), random(d, n, r)];
            let spec = kernels::copy_range(&v(d, n), n / 3, &v(d, n), n / 2, n - n / 2);
            check_spec(&mut e, spec.unwrap(), ins);
        }
        for &d in &[DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32] {
            let ins = vec![random(d, n, &mut rng), random(d, n, &mut rng)];
            check_spec(&mut e, kernels::add_into(&v(d, n), &v(d, n)).unwrap(), ins);
        }
        for &d in &floats {
            let r = &mut rng;
            let two = |r: &mut Rng| vec![random(d, n, r), random(d, n, r)];
            let three = |r: &mut Rng| vec![random(d, n, r), random(d, n, r), random(d, n, r)];
            check_spec(
                &mut e,
                kernels::scale(&v(d, n), &v(d, n), -0.3).unwrap(),
                two(r),
            );
            let ins = vec![random(d, n, r)];
            check_spec(&mut e, kernels::scale_in_place(&v(d, n), 1.7).unwrap(), ins);
            check_spec(
                &mut e,
                kernels::axpy(&v(d, n), &v(d, n), 0.7).unwrap(),
                two(r),
            );
            check_spec(
                &mut e,
                kernels::sgd_step(&v(d, n), &v(d, n), 0.01).unwrap(),
                two(r),
            );
            check_spec(&mut e, kernels::relu(&v(d, n), &v(d, n)).unwrap(), two(r));
            let spec = kernels::relu_backward(&v(d, n), &v(d, n), &v(d, n)).unwrap();
            check_spec(&mut e, spec, three(r));
            check_spec(
                &mut e,
                kernels::mul(&v(d, n), &v(d, n), &v(d, n)).unwrap(),
                three(r),
            );
        }
    }
    for &d in &floats {
        for &(m, k, n) in &[(1usize, 1usize, 1usize), (5, 7, 3), (33, 17, 65)] {
            let r = &mut rng;
            let mat = |rows: usize, cols: usize| node("m", d, &[rows, cols]);
            let ins = |r: &mut Rng| vec![vec![], random(d, m * k, r), random(d, k * n, r)];
            let spec = kernels::matmul(&mat(m, n), &mat(m, k), &mat(k, n)).unwrap();
            check_spec(&mut e, spec, ins(r));
            let spec = kernels::matmul_tn(&mat(m, n), &mat(k, m), &mat(k, n)).unwrap();
            check_spec(&mut e, spec, ins(r));
            let spec = kernels::matmul_nt(&mat(m, n), &mat(m, k), &mat(n, k)).unwrap();
            check_spec(&mut e, spec, ins(r));
            // [m, k] matrices for the row ops.
            let ins = vec![random(d, m * k, r), random(d, k, r)];
            check_spec(
                &mut e,
                kernels::add_row_bias(&mat(m, k), &v(d, k)).unwrap(),
                ins,
            );
            let ins = vec![vec![], random(d, m * k, r)];
            check_spec(
                &mut e,
                kernels::sum_rows(&v(d, k), &mat(m, k)).unwrap(),
                ins,
            );
            let ins = vec![vec![], vec![], random(d, m * k, r), one_hot(d, m, k)];
            let spec =
                kernels::softmax_xent(&v(d, 1), &mat(m, k), &mat(m, k), &mat(m, k), 1.0 / m as f64);
            check_spec(&mut e, spec.unwrap(), ins);
        }
    }
    e.sync_all().unwrap();
}

// ---------------------------------------------------------------------------------------
// The CPU's fast kernel mode against its exact mode.

/// Runs `spec` on `(device, stream)` of `e` over `inputs` (zeros for `Write` parameters)
/// and returns what it wrote, per parameter (`None` for read-only ones).
fn run_spec(
    e: &mut Engine,
    (device, stream): (usize, usize),
    spec: &RoutineSpec,
    inputs: &[Vec<u8>],
) -> Vec<Option<Vec<u8>>> {
    let mut ctx = e.context(device, stream).unwrap();
    for (p, buf) in spec.params.iter().zip(inputs) {
        if p.access.reads() {
            ctx = upload(e, &ctx, &p.node, buf);
        }
    }
    let r = e.link(&ctx, spec.clone()).unwrap();
    e.schedule(&r).unwrap();
    let out = spec
        .params
        .iter()
        .map(|p| p.access.writes().then(|| download(e, r.context(), &p.node)))
        .collect();
    e.finalize(r.context()).unwrap();
    out
}

/// `Σ_p |a_ip| |b_pj|` for each output of a matmul spec over `inputs`: the scale of the
/// rounding error any summation order can make.
fn matmul_magnitudes(spec: &RoutineSpec, inputs: &[Vec<u8>]) -> Vec<f64> {
    let kernels::Kernel::Builtin(b) = &spec.kernel else {
        unreachable!("built-in matmuls only")
    };
    let d = spec.params[0].node.dtype();
    let (a, bm) = (as_f64(d, &inputs[1]), as_f64(d, &inputs[2]));
    // (m, k, n), and the index of a(i, p) and b(p, j) in their buffers.
    let ((m, k, n), at, bt): (_, fn(_, _, _) -> _, fn(_, _, _) -> _) = match *b {
        kernels::Builtin::Matmul { m, k, n } => (
            (m, k, n),
            |(_, k, _), i, p| i * k + p,
            |(_, _, n), p, j| p * n + j,
        ),
        kernels::Builtin::MatmulTn { m, k, n } => (
            (m, k, n),
            |(m, _, _), i, p| p * m + i,
            |(_, _, n), p, j| p * n + j,
        ),
        kernels::Builtin::MatmulNt { m, k, n } => (
            (m, k, n),
            |(_, k, _), i, p| i * k + p,
            |(_, k, _), p, j| j * k + p,
        ),
        _ => unreachable!("built-in matmuls only"),
    };
    let dims: (usize, usize, usize) = (m, k, n);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|p| (a[at(dims, i, p)] * bm[bt(dims, p, j)]).abs())
                .sum();
        }
    }
    out
}

/// The fast mode (the CPU's default) against the exact one (`kernels::run_on_host`): every
/// built-in but the matmuls bit for bit; the matmuls of every float dtype and layout within
/// the bound `KernelMode::Fast` documents, `2 k u Σ_p |a_ip| |b_pj|` (`u` the computation
/// type's unit roundoff), plus one unit in the last place of `f16`/`bf16` outputs (each
/// mode rounds once); the same bits on another device, another stream and a pool of one
/// worker; and, on a processor with fused multiply-adds, not the exact bits (the fast path
/// really runs).
#[test]
fn cpu_fast_mode_is_within_its_bound_of_the_exact_mode_and_deterministic() {
    use tributary::backend::cpu::{CpuBackend, CpuConfig};
    let fast_engine = |workers: usize| {
        let config = CpuConfig::default().with_workers(workers);
        assert_eq!(config.kernel_mode, kernels::KernelMode::Fast, "the default");
        let b = CpuBackend::with_config(tributary::DeviceId(0), 2, config).unwrap();
        Engine::with_backend(std::sync::Arc::new(b), 2, PoolConfig::default()).unwrap()
    };
    let (mut e, mut one_worker) = (fast_engine(0), fast_engine(1));
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut differs = false;
    for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (u, ulp) = match d {
            DType::F64 => (2f64.powi(-53), 0.0),
            DType::F32 => (2f64.powi(-24), 0.0),
            DType::F16 => (2f64.powi(-24), 2f64.powi(-10)),
            _ => (2f64.powi(-24), 2f64.powi(-7)),
        };
        for &(m, k, n) in &[
            (1usize, 1usize, 1usize),
            (5, 7, 3),
            (33, 17, 65),
            (70, 300, 45),
        ] {
            let mat = |rows: usize, cols: usize| node("m", d, &[rows, cols]);
            for spec in [
                kernels::matmul(&mat(m, n), &mat(m, k), &mat(k, n)),
                kernels::matmul_tn(&mat(m, n), &mat(k, m), &mat(k, n)),
                kernels::matmul_nt(&mat(m, n), &mat(m, k), &mat(n, k)),
            ] {
                let spec = spec.unwrap();
                let what = format!("{} {m}x{k}x{n} ({d})", spec.name);
                let inputs = vec![
                    vec![0; m * n * d.size_in_bytes()],
                    random(d, m * k, &mut rng),
                    random(d, k * n, &mut rng),
                ];
                let mut want = inputs.clone();
                kernels::run_on_host(&spec, &mut want, None).unwrap();
                let got = run_spec(&mut e, (0, 0), &spec, &inputs)[0].clone().unwrap();
                let scale = matmul_magnitudes(&spec, &inputs);
                let (g, w) = (as_f64(d, &got), as_f64(d, &want[0]));
                for (i, ((g, w), s)) in g.iter().zip(&w).zip(&scale).enumerate() {
                    let bound = 2.0 * k as f64 * u * s + ulp * w.abs().max(g.abs());
                    assert!(
                        (g - w).abs() <= bound,
                        "{what}: element {i}: fast {g}, exact {w}, bound {bound:e}"
                    );
                }
                differs |= got != want[0];
                for (engine, place) in [(&mut e, (1, 1)), (&mut one_worker, (0, 1))] {
                    let again = run_spec(engine, place, &spec, &inputs)[0].clone().unwrap();
                    assert_eq!(again, got, "{what}: the same bits on {place:?}");
                }
            }
        }
        // The other built-ins do not depend on the mode.
        let v = || node("v", d, &[1000]);
        for spec in [
            kernels::axpy(&v(), &v(), 0.7),
            kernels::sgd_step(&v(), &v(), 0.01),
            kernels::add_into(&v(), &v()),
            kernels::relu(&v(), &v()),
            kernels::sum_rows(&node("s", d, &[10]), &node("r", d, &[100, 10])),
        ] {
            let spec = spec.unwrap();
            let inputs: Vec<Vec<u8>> = spec
                .params
                .iter()
                .map(|p| random(d, p.node.numel(), &mut rng))
                .collect();
            let mut want = inputs.clone();
            kernels::run_on_host(&spec, &mut want, None).unwrap();
            let got = run_spec(&mut e, (0, 0), &spec, &inputs);
            assert_eq!(got[0].as_ref(), Some(&want[0]), "{} ({d})", spec.name);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        assert!(
            differs,
            "fast mode gave the exact bits everywhere: is it running?"
        );
    }
    let _ = differs;
    e.sync_all().unwrap();
}

/// More than `65535 * 64` elements: one dispatch cannot cover them without a grid-stride
/// loop (or a second dimension).
fn large_dispatches_stride_over_the_grid(kind: Kind) {
    if kind == Kind::VulkanStaging {
        return; // same kernels as `vulkan`
    }
    let Some(mut e) = engine(kind, "large_dispatches_stride_over_the_grid") else {
        return;
    };
    let n = 65_535 * 64 + 4_099;
    let mut rng = Rng(7);
    for d in [DType::F32, DType::F16] {
        let v = || node("v", d, &[n]);
        let ins = vec![random(d, n, &mut rng), random(d, n, &mut rng)];
        check_spec(&mut e, kernels::add_into(&v(), &v()).unwrap(), ins);
        check_spec(&mut e, kernels::fill(&v(), 0.5).unwrap(), vec![vec![]]);
    }
    e.sync_all().unwrap();
}

// ---------------------------------------------------------------------------------------
// Transfers.

fn host_transfers_and_memset(kind: Kind) {
    let Some(mut e) = engine(kind, "host_transfers_and_memset") else {
        return;
    };
    // Zeroed at link (memset), odd sizes included.
    for n in [1usize, 3, 37, 4097] {
        let z = node("z", DType::U8, &[n])
            .with_mode(MemoryMode::on_device())
            .unwrap();
        let ctx = e.context(0, 1).unwrap();
        let w = e.link(&ctx, kernels::fill(&z, 9.0).unwrap()).unwrap();
        let got = e.read::<u8>(w.context(), &z).unwrap();
        assert!(got.iter().all(|&b| b == 0), "a fresh buffer reads as zeros");
        e.schedule(&w).unwrap();
        assert_eq!(e.read::<u8>(w.context(), &z).unwrap(), vec![9u8; n]);
    }
    // Host round trips on both devices, lazy transfers of hosted nodes.
    let h = node("h", DType::F32, &[N])
        .with_mode(MemoryMode::Hosted(HostedKind::ChangedOnDevices(
            Sharing::Unset,
        )))
        .unwrap();
    let data: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let c0 = e.context(0, 0).unwrap();
    let c0 = e.init_from_host(&c0, &h, &data).unwrap();
    assert_eq!(e.read::<f32>(&c0, &h).unwrap(), data);
    let c1 = e.context(1, 1).unwrap();
    let c1 = e.init_from_host(&c1, &h, &data).unwrap();
    let double = e
        .link(&c1, kernels::scale_in_place(&h, 2.0).unwrap())
        .unwrap();
    e.schedule(&double).unwrap();
    e.to_host(double.context(), &h).unwrap();
    let back: Vec<f32> = e.host_read(&h).unwrap();
    assert_eq!(back, data.iter().map(|x| x * 2.0).collect::<Vec<_>>());
    // A host write, then an upload into device 0: the device sees the new value.
    let newer: Vec<f32> = (0..N).map(|i| -(i as f32)).collect();
    e.host_write(&h, &newer).unwrap();
    e.from_host(&c0, &h).unwrap();
    assert_eq!(e.read::<f32>(&c0, &h).unwrap(), newer);
    // Every dtype round-trips bitwise.
    let mut rng = Rng(3);
    for d in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U8,
    ] {
        let x = node("x", d, &[37]);
        let bytes = random(d, 37, &mut rng);
        let c = e.context(1, 0).unwrap();
        let c = upload(&mut e, &c, &x, &bytes);
        assert_eq!(download(&mut e, &c, &x), bytes, "{d} round trip");
    }
    e.sync_all().unwrap();
}

// ---------------------------------------------------------------------------------------
// Protocol rules on real queues.

fn f32_node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [N])
        .with_mode(mode)
        .unwrap()
}

fn raw_war_waw_across_streams(kind: Kind) {
    let Some(mut e) = engine(kind, "raw_war_waw_across_streams") else {
        return;
    };
    let shared = MemoryMode::OnDevice(Sharing::SharedCrossStreams);
    for dev in 0..2 {
        let x = f32_node("x", shared);
        let y = f32_node("y", MemoryMode::on_device());
        let a = e.context(dev, 0).unwrap();
        let b = e.context(dev, 1).unwrap();
        // RAW: slow writer on stream 0, reader on stream 1.
        let w = e.link(&a, slow_fill_on(kind, &x, 7.0)).unwrap();
        let r = e.link(&b, kernels::copy(&y, &x).unwrap()).unwrap();
        e.schedule(&w).unwrap();
        e.schedule(&r).unwrap();
        let got = e.read::<f32>(r.context(), &y).unwrap();
        assert!(all(&got, 7.0), "RAW on d{dev}: {:?}", &got[..4]);
        // WAR: slow reader on stream 1, then an overwrite on stream 0.
        let y2 = f32_node("y2", MemoryMode::on_device());
        let read = e.link(&b, slow_copy_on(kind, &y2, &x)).unwrap();
        let over = e
            .link(w.context(), kernels::fill(&x, 2.0).unwrap())
            .unwrap();
        e.schedule(&read).unwrap();
        e.schedule(&over).unwrap();
        assert!(
            all(&e.read::<f32>(read.context(), &y2).unwrap(), 7.0),
            "WAR on d{dev}"
        );
        assert!(all(&e.read::<f32>(over.context(), &x).unwrap(), 2.0));
        // WAW: a slow write on stream 0, then an upload into the same buffer on stream 1.
        let h = f32_node(
            "h",
            MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::SharedCrossStreams)),
        );
        let hw = e.link(&a, slow_fill_on(kind, &h, 5.0)).unwrap();
        let hb = e.init_from_host(&b, &h, &vec![9.0f32; N]).unwrap();
        e.sync_all().unwrap();
        e.schedule(&hw).unwrap();
        e.from_host(&hb, &h).unwrap();
        assert!(all(&e.read::<f32>(&hb, &h).unwrap(), 9.0), "WAW on d{dev}");
    }
    e.sync_all().unwrap();
}

fn cross_device_copies_in_all_merge_modes(kind: Kind) {
    let Some(mut e) = engine(kind, "cross_device_copies_in_all_merge_modes") else {
        return;
    };
    let backend_streams_across = kind.streams_across_devices();
    for (src_dev, src_stream) in [(1usize, 0usize), (0, 1)] {
        let g = f32_node("g", MemoryMode::on_device());
        let c0 = e.context(0, 0).unwrap();
        let c1 = e.context(src_dev, src_stream).unwrap();
        let src = e.link(&c1, kernels::fill(&g, 5.0).unwrap()).unwrap();
        let src_over = e
            .link(src.context(), kernels::fill(&g, 100.0).unwrap())
            .unwrap();
        let base = e.link(&c0, kernels::fill(&g, 1.0).unwrap()).unwrap();
        e.schedule(&src).unwrap();
        e.schedule(&base).unwrap();
        // No: into the node's own buffer; the source is overwritten right after.
        let dst_ctx = e.context(0, 1).unwrap();
        let zero = e.link(&dst_ctx, kernels::fill(&g, 0.0).unwrap()).unwrap();
        e.schedule(&zero).unwrap();
        let dst_ctx = zero.context().clone();
        e.device_to_device(&g, src.context(), &dst_ctx, MergeBufferUse::No)
            .unwrap();
        e.schedule(&src_over).unwrap();
        assert!(
            all(&e.read::<f32>(&dst_ctx, &g).unwrap(), 5.0),
            "No from d{src_dev}"
        );
        // Copy: into the merge buffer, then merged.
        let merge = e
            .link(base.context(), kernels::add_merge(&g).unwrap())
            .unwrap();
        e.device_to_device(
            &g,
            src_over.context(),
            merge.context(),
            MergeBufferUse::Copy,
        )
        .unwrap();
        e.schedule(&merge).unwrap();
        assert!(
            all(&e.read::<f32>(merge.context(), &g).unwrap(), 101.0),
            "Copy from d{src_dev}"
        );
        // StreamingFor: read in place where the backend can address the source.
        let merge2 = e
            .link(merge.context(), kernels::add_merge(&g).unwrap())
            .unwrap();
        let r = e.device_to_device(
            &g,
            src_over.context(),
            merge2.context(),
            MergeBufferUse::StreamingFor(merge2.clone()),
        );
        let same_device = src_dev == 0;
        if same_device || backend_streams_across {
            r.unwrap();
            // The source is overwritten after the streaming read, which must wait for it.
            let src_again = e
                .link(src_over.context(), kernels::fill(&g, -1.0).unwrap())
                .unwrap();
            e.schedule(&src_again).unwrap();
            assert!(
                all(&e.read::<f32>(merge2.context(), &g).unwrap(), 201.0),
                "StreamingFor from d{src_dev}"
            );
        } else {
            assert!(
                matches!(r, Err(Error::StreamingUnsupported { .. })),
                "streaming across devices the backend cannot address is refused: {r:?}"
            );
        }
    }
    e.sync_all().unwrap();
}

/// `copy_merge`: the merge buffer replaces the node, bit for bit, for every dtype, from
/// another device (a merge-buffer copy) and from another stream of the same device (a copy
/// and, where the backend reads in place, streaming); the CPU built-in agrees.
fn copy_merge_takes_the_other_replica_bitwise(kind: Kind) {
    let Some(mut e) = engine(kind, "copy_merge_takes_the_other_replica_bitwise") else {
        return;
    };
    let mut rng = Rng(0x0dd_c0de);
    let n = 37; // odd: partial words of the 16-bit and 8-bit types
    for d in DType::ALL {
        for (src_dev, src_stream, streaming) in
            [(1usize, 0usize, false), (0, 1, false), (0, 1, true)]
        {
            let bytes = random(d, n, &mut rng);
            let data = node("data", d, &[n]);
            let g = node("g", d, &[n])
                .with_mode(MemoryMode::on_device())
                .unwrap();
            let root = e.context(src_dev, src_stream).unwrap();
            let held = upload(&mut e, &root, &data, &bytes);
            let src = e.link(&held, kernels::copy(&g, &data).unwrap()).unwrap();
            e.schedule(&src).unwrap();
            let c0 = e.context(0, 0).unwrap();
            let base = e.link(&c0, kernels::fill(&g, 3.0).unwrap()).unwrap();
            e.schedule(&base).unwrap();
            let spec = kernels::copy_merge(&g).unwrap();
            // The CPU reference: the merge bytes, whatever the node held.
            let mut want = vec![random(d, n, &mut rng)];
            kernels::run_on_host(&spec, &mut want, Some(&bytes)).unwrap();
            assert_eq!(want[0], bytes, "run_on_host copy_merge of {d}");
            let take = e.link(base.context(), spec).unwrap();
            let mode = if streaming {
                MergeBufferUse::StreamingFor(take.clone())
            } else {
                MergeBufferUse::Copy
            };
            e.device_to_device(&g, src.context(), take.context(), mode)
                .unwrap();
            if !streaming {
                e.schedule(&take).unwrap();
            }
            let got = download(&mut e, take.context(), &g);
            assert_eq!(
                got, bytes,
                "copy_merge of {d} from d{src_dev}s{src_stream} (streaming: {streaming})"
            );
        }
    }
    e.sync_all().unwrap();
}

fn failure_propagates_with_its_root_cause(kind: Kind) {
    let Some(mut e) = engine(kind, "failure_propagates_with_its_root_cause") else {
        return;
    };
    let shared = MemoryMode::OnDevice(Sharing::SharedCrossStreams);
    let x = f32_node("x", shared);
    let y = f32_node("y", MemoryMode::on_device());
    let z = f32_node("z", MemoryMode::on_device());
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    let c = e.context(1, 0).unwrap();
    let bad = e.link(&a, failing(kind, "boom", &x, "boom")).unwrap();
    let dep_same_stream = e
        .link(bad.context(), kernels::scale_in_place(&x, 2.0).unwrap())
        .unwrap();
    let dep_other_stream = e.link(&b, kernels::copy(&y, &x).unwrap()).unwrap();
    let bad_ev = e.schedule(&bad).unwrap();
    let e1 = e.schedule(&dep_same_stream).unwrap();
    let e2 = e.schedule(&dep_other_stream).unwrap();
    // Across devices: the copy depends on the failed writer.
    let x1 = e.link(&c, kernels::fill(&x, 3.0).unwrap()).unwrap();
    e.schedule(&x1).unwrap();
    let e3 = e
        .device_to_device(
            &x,
            dep_same_stream.context(),
            x1.context(),
            MergeBufferUse::No,
        )
        .unwrap();
    let root = match bad_ev.wait() {
        Err(Error::Failed(f)) => f,
        other => panic!("the failing kernel's event: {other:?}"),
    };
    assert!(root.operation.contains("boom"), "{root}");
    for (what, ev) in [
        ("same stream", Some(e1)),
        ("other stream", Some(e2)),
        ("other device", e3),
    ] {
        let ev = ev.expect("an event");
        match ev.wait() {
            Err(Error::Failed(f)) => assert_eq!(f, root, "{what}: same root cause"),
            other => panic!("{what}: {other:?}"),
        }
    }
    // The streams keep serving.
    let ok = e.link(&b, kernels::fill(&y, 4.0).unwrap()).unwrap();
    e.schedule(&ok).unwrap();
    assert!(all(&e.read::<f32>(ok.context(), &y).unwrap(), 4.0));
    let ok2 = e.link(&a, kernels::fill(&z, 6.0).unwrap()).unwrap();
    e.schedule(&ok2).unwrap();
    assert!(all(&e.read::<f32>(ok2.context(), &z).unwrap(), 6.0));
    let first = e.sync_all();
    assert!(matches!(first, Err(Error::Failed(_))) || first.is_ok());
}

/// A CUDA C kernel writing 1.0 to `n` floats (for the CUDA backend; refused elsewhere).
const CUDA_FILL_ONES: &str = r#"
extern "C" __global__ void fill_ones(float* x, unsigned long long n) {
  for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) x[i] = 1.0f;
}
"#;

fn foreign_kernels_are_refused_at_link(kind: Kind) {
    let Some(mut e) = engine(kind, "foreign_kernels_are_refused_at_link") else {
        return;
    };
    let x = f32_node("x", MemoryMode::on_device());
    let ctx = e.context(0, 0).unwrap();
    let write_x = || vec![(x.clone(), Access::Write)];
    let shader = RoutineSpec::shader(
        "shader",
        write_x(),
        None,
        ShaderKernel::wgsl(slow_fill_wgsl(), [1, 1, 1]),
    );
    let closure = RoutineSpec::custom("closure", write_x(), None, |_| Ok(()));
    let cuda = RoutineSpec::cuda(
        "cuda",
        write_x(),
        None,
        CudaKernel::cuda_c(CUDA_FILL_ONES, "fill_ones", [1, 1, 1], [32, 1, 1])
            .with_scalars([CudaScalar::U64(N as u64)]),
    );
    // The kernels of the other backends.
    let foreign = match kind {
        Kind::Cpu => [shader, cuda],
        Kind::Vulkan | Kind::VulkanStaging => [closure, cuda],
        Kind::Cuda => [closure, shader],
    };
    for spec in foreign {
        let spec = spec.unwrap();
        let name = spec.name.clone();
        match e.link(&ctx, spec) {
            Err(Error::InvalidRoutine { reason, routine }) => {
                assert_eq!(routine, name);
                assert!(reason.contains("cannot run it"), "{name}: {reason}")
            }
            other => panic!(
                "{name}: expected InvalidRoutine, got {:?}",
                other.map(|r| r.name().to_string())
            ),
        }
    }
    // The context is still usable.
    let ok = e.link(&ctx, kernels::fill(&x, 1.0).unwrap()).unwrap();
    e.schedule(&ok).unwrap();
    assert!(all(&e.read::<f32>(ok.context(), &x).unwrap(), 1.0));
}

fn pools_are_reused_under_endless_work(kind: Kind) {
    let Some(mut e) = engine(kind, "pools_are_reused_under_endless_work") else {
        return;
    };
    let root = e.context(1, 1).unwrap();
    for round in 0..40 {
        let t = f32_node("t", MemoryMode::on_device());
        let s = f32_node("s", MemoryMode::on_device());
        let f = e
            .link(&root, kernels::fill(&t, round as f64).unwrap())
            .unwrap();
        let c = e
            .link(f.context(), kernels::scale(&s, &t, 2.0).unwrap())
            .unwrap();
        e.schedule(&f).unwrap();
        e.schedule(&c).unwrap();
        assert!(all(
            &e.read::<f32>(c.context(), &s).unwrap(),
            round as f32 * 2.0
        ));
        e.finalize(c.context()).unwrap();
        e.finalize(f.context()).unwrap();
    }
    e.sync_all().unwrap();
    let stats = e.memory_stats();
    assert!(stats[1].pools <= 2, "pools stay bounded: {stats:?}");
}

/// A column sum over 70 000 rows: exact, or (on lavapipe, whose llvmpipe stops an
/// invocation after 65 535 loop iterations) a failed event that says why, never a silently
/// truncated result.
fn long_reductions_are_exact_or_refused(kind: Kind) {
    let Some(mut e) = engine(kind, "long_reductions_are_exact_or_refused") else {
        return;
    };
    let (m, n) = (70_000usize, 2usize);
    let src = node("src", DType::F32, &[m, n]);
    let dst = node("dst", DType::F32, &[n]);
    let ctx = e.context(0, 0).unwrap();
    let ctx = e.init_from_host(&ctx, &src, &vec![1.0f32; m * n]).unwrap();
    let r = e
        .link(&ctx, kernels::sum_rows(&dst, &src).unwrap())
        .unwrap();
    let ev = e.schedule(&r).unwrap();
    match ev.wait() {
        Ok(()) => assert_eq!(e.read::<f32>(r.context(), &dst).unwrap(), vec![m as f32; n]),
        Err(Error::Failed(f)) => {
            assert!(kind.is_vulkan(), "{f}");
            assert!(f.message.contains("loop iterations"), "{f}");
            support::log(&format!(
                "vulkan: long reduction refused as expected: {}",
                f.message
            ));
        }
        Err(other) => panic!("{other}"),
    }
}

// ---------------------------------------------------------------------------------------
// What a queue checks (issue 12, items 1 and 5), with plans made by the `unsafe`
// constructor: a plan of another timeline is refused, and a host transfer whose host array
// is not exactly its size fails, naming both sizes, instead of copying the smaller one.

fn queues_check_plans_and_never_truncate(kind: Kind) {
    use std::{sync::Arc, time::Duration};
    use tributary::{
        protocol::{Dep, DepKind, GlobalLoc, Plan, Work},
        BufferLoc, DeviceError, DeviceId, Event, PoolId, StreamId, Timeline,
    };
    let test = "queues_check_plans_and_never_truncate";
    let Some(b) = backend(kind, 1, test) else {
        return;
    };
    let (device, pool) = (DeviceId(0), PoolId(0));
    b.create_pool(device, pool, 64, 64).unwrap();
    // A pool has one owner: creating it again is refused.
    match b.create_pool(device, pool, 64, 64) {
        Err(DeviceError::Unexpected(m)) => assert!(m.contains("already exists"), "{m}"),
        other => panic!("a second pool 0 was accepted: {other:?}"),
    }
    let s0 = StreamId { device, index: 0 };
    let s1 = StreamId { device, index: 1 };
    let (t0, t1) = (Timeline::new(s0), Timeline::new(s1));
    // SAFETY: fresh timelines, completed only by these queues; every plan below is made
    // under `Plan::from_parts`'s contract.
    let q0 = unsafe { b.start_stream(s0, t0.clone()) }.unwrap();
    let at = GlobalLoc {
        device,
        loc: BufferLoc { pool, offset: 0 },
    };
    let host = |bytes: usize| Arc::new(tributary::memory::AlignedBuffer::new(bytes, 64).unwrap());
    // SAFETY (every plan below): each sequence number is issued once, to its plan; the
    // plans on `t0` run in order on `q0` and each one also depends on the one before, so
    // none overlaps another's use of the pool or of a host array; the host arrays are read
    // only after their plan's event completed.
    let plan = |t: &Arc<Timeline>, seq: u64, deps: Vec<Dep>, work: Work| unsafe {
        Plan::from_parts(t.stream(), Event::new(t.clone(), seq), deps, work)
    };
    let bound = Duration::from_secs(20);
    let after =
        |t: &Arc<Timeline>, seq: u64| vec![Dep::new(Event::new(t.clone(), seq), DepKind::Order)];

    // Another stream's plan, and the same stream's plan of another engine, are refused and
    // their events left alone.
    let foreign = Timeline::new(s0);
    for (t, stream) in [(&t1, s1), (&foreign, s0)] {
        match q0.submit(plan(t, 1, Vec::new(), Work::memset(at, 16))) {
            Err(Error::WrongStream { plan, queue, .. }) => assert_eq!((plan, queue), (stream, s0)),
            other => panic!("a plan of another timeline was accepted: {other:?}"),
        }
        assert!(!t.is_done(1), "a refused plan's event was completed");
    }

    // Host arrays of 32 and 8 bytes for transfers of 16: both fail, naming both sizes.
    let (long, short) = (host(32), host(8));
    q0.submit(plan(&t0, 1, Vec::new(), Work::from_host(long, at, 16)))
        .unwrap();
    q0.submit(plan(&t0, 2, after(&t0, 1), Work::to_host(at, short, 16)))
        .unwrap();
    for (seq, sizes) in [(1, ["32 bytes", "16 bytes"]), (2, ["8 bytes", "16 bytes"])] {
        match t0.wait_timeout(seq, bound) {
            Err(Error::Failed(f)) => {
                assert!(f.message.contains("size mismatch"), "{f}");
                assert!(sizes.iter().all(|s| f.message.contains(s)), "{f}");
            }
            other => panic!("transfer {seq} of a mismatched size: {other:?}"),
        }
    }

    // Exact sizes still go through, both ways, on the same queue.
    let (up, down) = (host(16), host(16));
    let data: Vec<u8> = (1..=16).collect();
    // SAFETY: `up` is not used by any plan yet.
    unsafe { up.bytes_mut(0, 16) }
        .unwrap()
        .copy_from_slice(&data);
    q0.submit(plan(&t0, 3, after(&t0, 2), Work::from_host(up, at, 16)))
        .unwrap();
    q0.submit(plan(
        &t0,
        4,
        after(&t0, 3),
        Work::to_host(at, down.clone(), 16),
    ))
    .unwrap();
    t0.wait_timeout(4, bound).unwrap();
    // SAFETY: the transfer into `down` completed; nothing else uses it.
    assert_eq!(unsafe { down.bytes(0, 16) }.unwrap(), &data[..]);

    // A plan whose pool is gone (released after the plans that used it completed, as the
    // protocol releases) fails its own event naming the pool, and the queue serves the
    // next plan: a pool is looked up when its plan runs (the CPU queue) or is submitted,
    // never trusted from before its release.
    b.release_pool(device, pool);
    q0.submit(plan(&t0, 5, after(&t0, 4), Work::memset(at, 16)))
        .unwrap();
    match t0.wait_timeout(5, bound) {
        Err(Error::Failed(f)) => {
            assert!(f.message.contains("pool p0 does not exist"), "{f}");
            assert_eq!(f.seq, 5, "{f}");
        }
        other => panic!("a plan on a released pool: {other:?}"),
    }
    b.create_pool(device, PoolId(1), 64, 64).unwrap();
    let fresh = GlobalLoc {
        device,
        loc: BufferLoc {
            pool: PoolId(1),
            offset: 0,
        },
    };
    q0.submit(plan(&t0, 6, after(&t0, 5), Work::memset(fresh, 16)))
        .unwrap();
    t0.wait_timeout(6, bound).unwrap();
    q0.shutdown();
}

// ---------------------------------------------------------------------------------------
// A replayed stream's program (DESIGN.md §4, "Compiled replays"), made from plans with the
// `unsafe` constructor: each operation runs after its dependencies (here one on a plan of
// another stream submitted after the program), a failed data dependency fails its
// operation with the root cause without running it and the program goes on, a program of
// another timeline is refused, and one a shut-down queue refuses fails every event. The
// CPU queue runs programs in place; the others run them as their plans.

fn programs_run_like_their_plans(kind: Kind) {
    use std::{sync::Arc, time::Duration};
    use tributary::{
        protocol::{Dep, DepKind, GlobalLoc, Plan, StreamProgram, Work},
        BufferLoc, DeviceId, Event, Failure, PoolId, StreamId, Timeline,
    };
    let test = "programs_run_like_their_plans";
    let Some(b) = backend(kind, 1, test) else {
        return;
    };
    let (device, pool) = (DeviceId(0), PoolId(0));
    b.create_pool(device, pool, 64, 64).unwrap();
    let s0 = StreamId { device, index: 0 };
    let s1 = StreamId { device, index: 1 };
    let (t0, t1) = (Timeline::new(s0), Timeline::new(s1));
    // SAFETY: fresh timelines, completed only by these queues; every plan below is made
    // under `Plan::from_parts`'s contract.
    let q0 = unsafe { b.start_stream(s0, t0.clone()) }.unwrap();
    // SAFETY: as above.
    let q1 = unsafe { b.start_stream(s1, t1.clone()) }.unwrap();
    let at = |offset: u64| GlobalLoc {
        device,
        loc: BufferLoc { pool, offset },
    };
    let host = |bytes: usize| Arc::new(tributary::memory::AlignedBuffer::new(bytes, 64).unwrap());
    // SAFETY (every plan below): each sequence number is issued once, to its plan; a plan
    // reading bytes another plan writes depends on it (data), and the plans of `t0` run in
    // order after one another; the host arrays are read only after their plan completed.
    let plan = |t: &Arc<Timeline>, seq: u64, deps: Vec<Dep>, work: Work| unsafe {
        Plan::from_parts(t.stream(), Event::new(t.clone(), seq), deps, work)
    };
    let data = |t: &Arc<Timeline>, seq: u64| Dep::new(Event::new(t.clone(), seq), DepKind::Data);
    let bound = Duration::from_secs(20);
    let fill = |bytes: &[u8]| {
        let h = host(16);
        // SAFETY: `h` is not used by any plan yet.
        unsafe { h.bytes_mut(0, 16) }
            .unwrap()
            .copy_from_slice(bytes);
        h
    };
    let (first, second): (Vec<u8>, Vec<u8>) = ((1..=16).collect(), (101..=116).collect());
    let (down1, down2, down3) = (host(16), host(16), host(16));
    // A producer of another "stream" that fails.
    let broken = Timeline::new(StreamId { device, index: 7 });
    let root = Arc::new(Failure {
        stream: broken.stream(),
        seq: 1,
        operation: "producer".into(),
        message: "broken".into(),
    });
    let program = StreamProgram::from_plans([
        plan(&t0, 1, Vec::new(), Work::from_host(fill(&first), at(0), 16)),
        plan(
            &t0,
            2,
            vec![data(&t0, 1)],
            Work::to_host(at(0), down1.clone(), 16),
        ),
        plan(
            &t0,
            3,
            vec![data(&broken, 1)],
            Work::to_host(at(0), down2.clone(), 16),
        ),
        plan(
            &t0,
            4,
            vec![data(&t1, 1)],
            Work::to_host(at(16), down3.clone(), 16),
        ),
    ])
    .unwrap();
    q0.submit_program(program).unwrap();
    // Submitted after the program that waits for it.
    q1.submit(plan(
        &t1,
        1,
        Vec::new(),
        Work::from_host(fill(&second), at(16), 16),
    ))
    .unwrap();
    broken.fail(1, root.clone());
    t0.wait_timeout(2, bound).unwrap();
    match t0.wait_timeout(3, bound) {
        Err(Error::Failed(f)) => assert!(Arc::ptr_eq(&f, &root), "{f}"),
        other => panic!("an operation whose input failed: {other:?}"),
    }
    let fourth = Event::new(t0.clone(), 4);
    let deadline = std::time::Instant::now() + bound;
    while !fourth.is_done() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(fourth.status(), tributary::event::EventStatus::Done);
    // SAFETY: every transfer into these arrays is decided; nothing else uses them.
    let got =
        |h: &Arc<tributary::memory::AlignedBuffer>| unsafe { h.bytes(0, 16) }.unwrap().to_vec();
    assert_eq!(
        got(&down1),
        first,
        "the program's second operation read before the first wrote"
    );
    assert_eq!(
        got(&down2),
        vec![0; 16],
        "an operation whose input failed ran"
    );
    assert_eq!(
        got(&down3),
        second,
        "an operation ran before another stream's input"
    );

    // A program of another timeline is refused, its events left alone.
    let foreign = Timeline::new(s0);
    let program =
        StreamProgram::from_plans([plan(&foreign, 1, Vec::new(), Work::memset(at(0), 16))])
            .unwrap();
    match q0.submit_program(program) {
        Err(Error::WrongStream { plan, queue, .. }) => assert_eq!((plan, queue), (s0, s0)),
        other => panic!("a program of another timeline was accepted: {other:?}"),
    }
    assert!(
        !foreign.is_done(1),
        "a refused program's event was completed"
    );

    // A shut-down queue refuses a program and fails its events.
    q1.shutdown();
    let program = StreamProgram::from_plans([
        plan(&t1, 2, Vec::new(), Work::memset(at(16), 16)),
        plan(&t1, 3, Vec::new(), Work::memset(at(16), 16)),
    ])
    .unwrap();
    assert!(matches!(
        q1.submit_program(program),
        Err(Error::ShutDown(_))
    ));
    for seq in [2, 3] {
        assert!(
            matches!(t1.wait_timeout(seq, bound), Err(Error::Failed(_))),
            "operation {seq} of a refused program"
        );
    }
    q0.shutdown();
}
