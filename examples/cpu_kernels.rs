//! The CPU built-ins beside what a user would call instead, in the same process.
//!
//! Each built-in runs as a user runs it: linked on one CPU device with one stream,
//! scheduled `reps` times back to back, then `sync_all`. Its baseline runs on the calling
//! thread: `matrixmultiply` called directly for the matmuls (the crate the fast mode uses,
//! single-threaded, the same strides), a plain Rust loop over slices for the element-wise
//! built-ins. Every figure is the median of `--runs` runs; the ratio is the built-in's
//! throughput over its baseline's (1.0: as fast). Results in `BENCHMARKS.md`.
//!
//! `cargo run --release --example cpu_kernels` (add `--sizes 128,256` or `--mib 1` for a
//! shorter run).

use std::{hint::black_box, time::Instant};

use clap::Parser;
use tributary::{
    backend::cpu::CpuConfig,
    kernels::{self, KernelMode, RoutineSpec},
    protocol::Routine,
    DType, Element, Engine, EngineConfig, MergeBufferUse, Result, TensorNode,
};

/// Options.
#[derive(Parser, Debug)]
#[command(about = "CPU built-in kernels against matrixmultiply and plain slice loops")]
struct Args {
    /// Square matmul sizes (n x n times n x n).
    #[arg(long, value_delimiter = ',', default_value = "128,256,512,1024")]
    sizes: Vec<usize>,
    /// Element-wise buffer sizes in MiB (of `f32`).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    mib: Vec<usize>,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Skip the exact mode's matmuls (slow at large sizes).
    #[arg(long)]
    no_exact: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds per call of `f`, the median of `runs` timings of `reps` calls.
fn timed(runs: usize, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    f(reps.min(2)); // warm-up: page faults, caches, a worker woken
    median(
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                f(reps);
                start.elapsed().as_secs_f64() / reps as f64
            })
            .collect(),
    )
}

fn engine(mode: KernelMode) -> Result<Engine> {
    Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        cpu: CpuConfig::default().with_kernel_mode(mode),
        ..Default::default()
    })
}

/// Seconds per run of `spec` on one device, one stream, its inputs from `data`.
fn builtin_time<T: Element>(
    mode: KernelMode,
    spec: RoutineSpec,
    data: &[Vec<T>],
    runs: usize,
    reps: usize,
) -> Result<f64> {
    let mut e = engine(mode)?;
    let mut ctx = e.context(0, 0)?;
    for (p, d) in spec.params.iter().zip(data) {
        if p.access.reads() {
            ctx = e.init_from_host(&ctx, &p.node, d)?;
        }
    }
    let r = e.link(&ctx, spec)?;
    schedule_time(&mut e, &r, runs, reps)
}

/// Seconds per run of `r`: `reps` schedules back to back, then `sync_all`.
fn schedule_time(e: &mut Engine, r: &Routine, runs: usize, reps: usize) -> Result<f64> {
    let mut failed = None;
    let t = timed(runs, reps, |n| {
        for _ in 0..n {
            if let Err(err) = e.schedule(r) {
                failed = Some(err);
            }
        }
        if let Err(err) = e.sync_all() {
            failed = Some(err);
        }
    });
    failed.map_or(Ok(t), Err)
}

/// Seconds per `add_merge` of `n` elements on device 0, its merge buffer filled once by a
/// copy from device 1 (`MergeBufferUse::Copy`).
fn add_merge_time(n: usize, runs: usize, reps: usize) -> Result<f64> {
    let mut e = Engine::cpu(EngineConfig {
        devices: 2,
        streams_per_device: 1,
        ..Default::default()
    })?;
    let g = TensorNode::new("g", DType::F32, [n]);
    let c1 = e.context(1, 0)?;
    let c1 = e.init_from_host(&c1, &g, &values(n, 1))?;
    let c0 = e.context(0, 0)?;
    let c0 = e.init_from_host(&c0, &g, &values(n, 0))?;
    let merge = e.link(&c0, kernels::add_merge(&g)?)?;
    e.device_to_device(&g, &c1, merge.context(), MergeBufferUse::Copy)?;
    e.sync_all()?;
    schedule_time(&mut e, &merge, runs, reps)
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001)
        .map(|x| x as f32 / 1000.0 - 1.0)
        .collect()
}

fn matmuls(args: &Args) -> Result<()> {
    println!("matmul, square n x n, f32 and f64: GFLOP/s (ratio to matrixmultiply)");
    println!(
        "{:>5} {:>4} {:>15} {:>16} {:>16}",
        "n", "type", "matrixmultiply", "fast", "exact"
    );
    for &n in &args.sizes {
        let flop = 2.0 * (n as f64).powi(3);
        let reps = ((2e9 / flop) as usize).clamp(2, 200);
        let (a, b) = (values(n * n, 1), values(n * n, 2));
        let node = |l: &str, d: DType| TensorNode::new(l, d, [n, n]);
        for dtype in [DType::F32, DType::F64] {
            let spec = kernels::matmul(&node("c", dtype), &node("a", dtype), &node("b", dtype))?;
            let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            let base = match dtype {
                DType::F32 => {
                    let mut c = vec![0f32; n * n];
                    timed(args.runs, reps, |r| {
                        for _ in 0..r {
                            gemm(matrixmultiply::sgemm, (1.0, 0.0), n, &a, &b, &mut c);
                            black_box(&mut c);
                        }
                    })
                }
                _ => {
                    let (a, b) = (wide(&a), wide(&b));
                    let mut c = vec![0f64; n * n];
                    timed(args.runs, reps, |r| {
                        for _ in 0..r {
                            gemm(matrixmultiply::dgemm, (1.0, 0.0), n, &a, &b, &mut c);
                            black_box(&mut c);
                        }
                    })
                }
            };
            let run = |mode| match dtype {
                DType::F32 => builtin_time(
                    mode,
                    spec.clone(),
                    &[vec![], a.clone(), b.clone()],
                    args.runs,
                    reps,
                ),
                _ => builtin_time(
                    mode,
                    spec.clone(),
                    &[vec![], wide(&a), wide(&b)],
                    args.runs,
                    reps,
                ),
            };
            let fast = run(KernelMode::Fast)?;
            let gf = |t: f64| flop / t / 1e9;
            let exact = if args.no_exact {
                "-".to_string()
            } else {
                let t = run(KernelMode::Exact)?;
                format!("{:.1} ({:.2}x)", gf(t), base / t)
            };
            println!(
                "{n:>5} {:>4} {:>15.1} {:>16} {:>16}",
                dtype.name(),
                gf(base),
                format!("{:.1} ({:.2}x)", gf(fast), base / fast),
                exact
            );
        }
    }
    Ok(())
}

/// `matrixmultiply::sgemm` or `dgemm`.
type GemmFn<T> = unsafe fn(
    usize,
    usize,
    usize,
    T,
    *const T,
    isize,
    isize,
    *const T,
    isize,
    isize,
    T,
    *mut T,
    isize,
    isize,
);

/// `c = a b` for `n x n` row-major matrices through `f`.
fn gemm<T: Copy>(f: GemmFn<T>, (one, zero): (T, T), n: usize, a: &[T], b: &[T], c: &mut [T]) {
    assert!(a.len() == n * n && b.len() == n * n && c.len() == n * n);
    let s = n as isize;
    let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    // SAFETY: three distinct n x n row-major buffers (checked above), strides (n, 1).
    unsafe { f(n, n, n, one, a, s, 1, b, s, 1, zero, c, s, 1) }
}

/// An element-wise built-in and the loop a user would write instead.
struct Elementwise {
    name: &'static str,
    spec: fn(&[TensorNode]) -> Result<RoutineSpec>,
    /// Parameters (`dst` first).
    params: usize,
    plain: fn(&mut [f32], &[f32], &[f32]),
}

const ELEMENTWISE: &[Elementwise] = &[
    Elementwise {
        name: "add_into",
        spec: |v| kernels::add_into(&v[0], &v[1]),
        params: 2,
        plain: |d, s, _| d.iter_mut().zip(s).for_each(|(d, s)| *d += s),
    },
    Elementwise {
        name: "add_merge",
        // Measured by `add_merge_time` (two devices, the merge buffer filled by a copy);
        // the spec here only counts the bytes.
        spec: |v| kernels::add_into(&v[0], &v[1]),
        params: 2,
        plain: |d, s, _| d.iter_mut().zip(s).for_each(|(d, s)| *d += s),
    },
    Elementwise {
        name: "scale",
        spec: |v| kernels::scale(&v[0], &v[1], 0.5),
        params: 2,
        plain: |d, s, _| d.iter_mut().zip(s).for_each(|(d, s)| *d = 0.5 * s),
    },
    Elementwise {
        name: "axpy",
        spec: |v| kernels::axpy(&v[0], &v[1], 0.5),
        params: 2,
        plain: |d, s, _| d.iter_mut().zip(s).for_each(|(d, s)| *d += 0.5 * s),
    },
    Elementwise {
        name: "sgd_step",
        spec: |v| kernels::sgd_step(&v[0], &v[1], 0.01),
        params: 2,
        plain: |d, s, _| d.iter_mut().zip(s).for_each(|(d, s)| *d -= 0.01 * s),
    },
    Elementwise {
        name: "relu",
        spec: |v| kernels::relu(&v[0], &v[1]),
        params: 2,
        plain: |d, s, _| {
            d.iter_mut()
                .zip(s)
                .for_each(|(d, &s)| *d = if s > 0.0 || s.is_nan() { s } else { 0.0 })
        },
    },
    Elementwise {
        name: "mul",
        spec: |v| kernels::mul(&v[0], &v[1], &v[2]),
        params: 3,
        plain: |d, a, b| {
            d.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(d, (a, b))| *d = a * b)
        },
    },
    Elementwise {
        name: "scale_in_place",
        spec: |v| kernels::scale_in_place(&v[0], 0.5),
        params: 1,
        plain: |d, _, _| d.iter_mut().for_each(|d| *d *= 0.5),
    },
];

fn elementwise(args: &Args) -> Result<()> {
    println!("\nelement-wise, f32: GB/s of the buffers touched (ratio to a plain slice loop)");
    println!(
        "{:>4} {:>15} {:>10} {:>16}",
        "MiB", "built-in", "loop", "built-in"
    );
    for &mib in &args.mib {
        let n = mib * (1 << 20) / 4;
        let reps = (256 / mib).clamp(4, 256);
        for k in ELEMENTWISE {
            let nodes: Vec<TensorNode> = ["d", "x", "y"][..k.params]
                .iter()
                .map(|l| TensorNode::new(*l, DType::F32, [n]))
                .collect();
            let spec = (k.spec)(&nodes)?;
            let bytes = spec
                .params
                .iter()
                .map(|p| (p.access.reads() as usize + p.access.writes() as usize) * n * 4)
                .sum::<usize>() as f64;
            let data: Vec<Vec<f32>> = (0..k.params).map(|i| values(n, i as u32)).collect();
            let (mut d, x, y) = (
                data[0].clone(),
                data.get(1).cloned().unwrap_or_default(),
                data.get(2).cloned().unwrap_or_default(),
            );
            let base = timed(args.runs, reps, |r| {
                for _ in 0..r {
                    (k.plain)(black_box(&mut d), black_box(&x), black_box(&y));
                }
            });
            let t = if k.name == "add_merge" {
                add_merge_time(n, args.runs, reps)?
            } else {
                builtin_time(KernelMode::Fast, spec, &data, args.runs, reps)?
            };
            let gbs = |t: f64| bytes / t / 1e9;
            println!(
                "{mib:>4} {:>15} {:>10.1} {:>16}",
                k.name,
                gbs(base),
                format!("{:.1} ({:.2}x)", gbs(t), base / t)
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.runs == 0 {
        eprintln!("--runs must be at least 1");
        std::process::exit(2);
    }
    matmuls(&args)?;
    elementwise(&args)
}
