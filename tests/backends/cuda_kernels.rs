//! The CUDA kernels checked without a GPU, two ways:
//!
//! - every built-in program (one per dtype) and a user CUDA C kernel are compiled to PTX by
//!   NVRTC for `compute_80` and `compute_90`, and each PTX is assembled by `ptxas -v` for
//!   `sm_80` and `sm_90`; any compile or assembly error, any spill, or an entry point of the
//!   source that `ptxas` did not assemble fails the test. Needs `libnvrtc` on the library
//!   path (`LD_LIBRARY_PATH`) and `ptxas` (`TRIBUTARY_PTXAS`, else `PATH`); `.ci/run`
//!   installs both from NVIDIA's PyPI wheels.
//! - the built-ins' CUDA C is built for the host by `c++` (`CXX`), with the CUDA intrinsics
//!   shimmed as IEEE operations and each block's threads run concurrently, and every
//!   built-in's launches run over random inputs must equal the CPU backend bit for bit
//!   (`softmax_xent` within the conformance tolerance; any NaN equals any NaN).
//!
//! Without the tools a test prints `skipping CUDA kernel check: <reason>` and passes, unless
//! `TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1`, which makes a missing tool a failure (CI).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
};

use tributary::{
    backend::cuda::kernels::{kernel_launches, nvrtc, Launch, LaunchLimits, LaunchParam, Program},
    ids::{BufferLoc, DeviceId, PoolId},
    kernels::{self, Access, RoutineSpec},
    protocol::{ArgBinding, GlobalLoc},
    Bf16, DType, TensorNode, F16,
};

/// `(NVRTC virtual architecture, ptxas real architecture)`.
const TARGETS: [(&str, &str); 2] = [("compute_80", "sm_80"), ("compute_90", "sm_90")];

/// A user kernel as a user would write it: pointers in argument order, then scalars.
const USER_KERNEL: &str = r#"
extern "C" __global__ void saxpy(float* y, const float* x, unsigned long long n, float a) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
       i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
    y[i] = y[i] + a * x[i];
  }
}
"#;

/// A user kernel with declared indices: they come after its scalars, in declaration order
/// (`t: u32`, then `shift: i64`), as the routine in
/// [`user_kernel_index_values_are_its_last_parameters`] declares them.
const USER_INDEXED_KERNEL: &str = r#"
extern "C" __global__ void fill_step(float* y, unsigned long long n, float scale, unsigned int t, long long shift) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
       i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
    y[i] = scale * (float)((long long)t + shift);
  }
}
"#;

/// User programs in the check: [`USER_KERNEL`] and [`USER_INDEXED_KERNEL`].
const USER_PROGRAMS: usize = 2;

fn required() -> bool {
    std::env::var("TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK").is_ok_and(|v| v == "1")
}

/// The `ptxas` to run: `TRIBUTARY_PTXAS`, else the one on `PATH`, if it runs.
fn find_ptxas() -> Result<PathBuf, String> {
    let path = std::env::var_os("TRIBUTARY_PTXAS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("ptxas"));
    match Command::new(&path).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(path),
        Ok(out) => Err(format!(
            "{} --version failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) => Err(format!(
            "ptxas not found ({}: {e}; set TRIBUTARY_PTXAS or PATH)",
            path.display()
        )),
    }
}

/// The names of the `extern "C" __global__` functions of a CUDA C source.
fn entry_points(source: &str) -> BTreeSet<String> {
    source
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|name| name.trim().to_string())
        .collect()
}

/// What `ptxas -v` reported for one PTX file.
struct Assembled {
    /// The entry functions it compiled.
    entries: BTreeSet<String>,
    /// Lines reporting a nonzero spill.
    spills: Vec<String>,
}

/// Assembles `ptx` for `sm` with `ptxas -v`; an error carries its output.
fn assemble(
    ptxas: &Path,
    dir: &Path,
    label: &str,
    sm: &str,
    ptx: &str,
) -> Result<Assembled, String> {
    let input = dir.join(format!("{label}.{sm}.ptx"));
    let output = dir.join(format!("{label}.{sm}.cubin"));
    std::fs::write(&input, ptx).map_err(|e| format!("writing {}: {e}", input.display()))?;
    let out = Command::new(ptxas)
        .arg(format!("-arch={sm}"))
        .arg("-v")
        .arg("--warn-on-spills")
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("ptxas -arch={sm} failed on {label}:\n{log}"));
    }
    let mut entries = BTreeSet::new();
    let mut spills = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(name) = rest.split('\'').next() {
                entries.insert(name.to_string());
            }
        }
        let spilled = line.contains("spill")
            && line
                .split(',')
                .filter(|part| part.contains("spill"))
                .any(|part| part.split_whitespace().next() != Some("0"));
        if spilled || line.to_lowercase().contains("warning") {
            spills.push(format!("{label} {sm}: {}", line.trim()));
        }
    }
    Ok(Assembled { entries, spills })
}

#[test]
fn every_cuda_kernel_compiles_and_assembles_without_spills() {
    let tools = nvrtc::nvrtc_version().and_then(|v| find_ptxas().map(|p| (v, p)));
    let ((major, minor), ptxas) = match tools {
        Ok(t) => t,
        Err(reason) => {
            assert!(
                !required(),
                "TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1 but the check cannot run: {reason}"
            );
            println!("skipping CUDA kernel check: {reason}");
            return;
        }
    };
    println!("NVRTC {major}.{minor}, {}", ptxas.display());
    // The architecture chosen for a device: its own, else the newest below it.
    assert_eq!(nvrtc::virtual_arch_for(8, 0).unwrap(), "compute_80");
    assert_eq!(nvrtc::virtual_arch_for(9, 0).unwrap(), "compute_90");
    let newest = *nvrtc::supported_archs().unwrap().last().unwrap();
    assert_eq!(
        nvrtc::virtual_arch_for(99, 9).unwrap(),
        format!("compute_{newest}")
    );
    assert!(nvrtc::virtual_arch_for(1, 0).is_err());
    let dir = std::env::temp_dir().join(format!("tributary-cuda-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");

    let mut programs: Vec<(String, Program)> = Program::builtins().map(|p| (p.name(), p)).collect();
    programs.push(("user".to_string(), Program::UserCudaC(USER_KERNEL.into())));
    programs.push((
        "user_indexed".to_string(),
        Program::UserCudaC(USER_INDEXED_KERNEL.into()),
    ));
    let jobs: Vec<(&str, &Program, (&str, &str))> = programs
        .iter()
        .flat_map(|(label, p)| TARGETS.iter().map(move |&t| (label.as_str(), p, t)))
        .collect();

    // Two workers: the machines this runs on have few cores.
    let next = Mutex::new(jobs.into_iter());
    let results = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let Some((label, program, (arch, sm))) = next.lock().expect("queue").next() else {
                    break;
                };
                let source = program.cuda_c().expect("CUDA C programs only").into_owned();
                let result =
                    nvrtc::compile_to_ptx(&source, &program.name(), arch, program.nvrtc_options())
                        .and_then(|ptx| assemble(&ptxas, &dir, label, sm, &ptx))
                        .map(|a| (entry_points(&source), a));
                results.lock().expect("results").push((label, sm, result));
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);

    let mut failures = Vec::new();
    let mut kernels = 0;
    let mut programs_checked = 0;
    let results = results.into_inner().expect("results");
    for (label, sm, result) in &results {
        match result {
            Err(e) => failures.push(e.clone()),
            Ok((expected, assembled)) => {
                programs_checked += 1;
                kernels += assembled.entries.len();
                failures.extend(assembled.spills.iter().cloned());
                if expected.is_empty() || &assembled.entries != expected {
                    failures.push(format!(
                        "{label} {sm}: ptxas assembled {:?}, the source defines {expected:?}",
                        assembled.entries
                    ));
                }
            }
        }
    }
    assert_eq!(
        results.len(),
        programs.len() * TARGETS.len(),
        "every job ran"
    );
    assert!(
        failures.is_empty(),
        "CUDA kernel check failed:\n{}",
        failures.join("\n")
    );
    println!(
        "checked {programs_checked} programs ({} built-in, {USER_PROGRAMS} user, each for {} \
         targets): {kernels} kernels compiled by NVRTC and assembled by ptxas without spills",
        programs.len() - USER_PROGRAMS,
        TARGETS.len()
    );
}

// ---------------------------------------------------------------------------------------
// The built-ins' CUDA C run on the host.

/// What the generated CUDA C needs from CUDA, for a host C++ compiler: the intrinsics as
/// plain IEEE operations (no contraction: `-ffp-contract=off`), the bit casts, and the
/// thread indices as globals that the driver sets.
const HOST_SHIM: &str = r#"#include <barrier>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct HostDim { unsigned int x, y, z; };
static HostDim blockIdx, blockDim, gridDim;
static thread_local HostDim threadIdx;
static std::barrier<>* host_barrier;
static inline void __syncthreads() { host_barrier->arrive_and_wait(); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline double host_f64(unsigned long long u) { double d; memcpy(&d, &u, 8); return d; }
/* Blocks one after the other (so `__shared__` statics are per block); the threads of a
   block as OS threads meeting at a real barrier. */
static void host_launch(unsigned gx, unsigned bx, unsigned by, void (*kernel)()) {
  gridDim = {gx, 1, 1};
  blockDim = {bx, by, 1};
  for (unsigned b = 0; b < gx; ++b) {
    blockIdx = {b, 0, 0};
    std::barrier<> barrier(bx * by);
    host_barrier = &barrier;
    std::vector<std::thread> threads;
    for (unsigned y = 0; y < by; ++y)
      for (unsigned x = 0; x < bx; ++x)
        threads.emplace_back([=] { threadIdx = {x, y, 0}; kernel(); });
    for (auto& t : threads) t.join();
  }
}
"#;

/// One built-in call: its spec, input bytes per parameter, merge bytes, and its launches.
struct HostCase {
    spec: RoutineSpec,
    inputs: Vec<Vec<u8>>,
    merge: Option<Vec<u8>>,
    launches: Vec<Launch>,
}

/// A deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Mostly values in [-3, 3), some small integers, zeros, and now and then a special
    /// value (NaN, infinities, -0, a subnormal).
    fn value(&mut self) -> f64 {
        let r = self.next_u64();
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        match r % 23 {
            0 => 0.0,
            1 => -0.0,
            2 => f64::NAN,
            3 => f64::INFINITY * if r & 64 == 0 { 1.0 } else { -1.0 },
            4 => 1e-40,
            5 | 6 => ((r >> 20) % 7) as f64 - 3.0,
            _ => u * 6.0 - 3.0,
        }
    }
}

/// `n` elements of `dtype` as bytes: half-precision types get random bit patterns (every
/// class of value), the others [`Rng::value`]s (`i32` scaled to overflow when added).
fn host_input(dtype: DType, n: usize, rng: &mut Rng) -> Vec<u8> {
    use tributary::kernels::to_bytes;
    match dtype {
        DType::F16 | DType::BF16 => (0..n)
            .flat_map(|_| (rng.next_u64() as u16).to_ne_bytes())
            .collect(),
        DType::F32 => to_bytes(&(0..n).map(|_| rng.value() as f32).collect::<Vec<_>>()),
        DType::F64 => to_bytes(&(0..n).map(|_| rng.value()).collect::<Vec<_>>()),
        DType::I32 => to_bytes(&(0..n).map(|_| rng.next_u64() as i32).collect::<Vec<_>>()),
        DType::U8 => (0..n).map(|_| rng.next_u64() as u8).collect(),
    }
}

/// Probabilities-like labels: one-hot rows with every seventh row uniform.
fn labels(dtype: DType, m: usize, c: usize) -> Vec<u8> {
    use tributary::kernels::to_bytes;
    let v: Vec<f32> = (0..m * c)
        .map(|i| match (i / c % 7 == 6, i % c == (i / c * 5) % c) {
            (true, _) => 1.0 / c as f32,
            (false, true) => 1.0,
            (false, false) => 0.0,
        })
        .collect();
    match dtype {
        DType::F32 => to_bytes(&v),
        DType::F64 => to_bytes(&v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()),
        DType::F16 => to_bytes(&v.iter().map(|&x| F16::from_f32(x)).collect::<Vec<_>>()),
        DType::BF16 => to_bytes(&v.iter().map(|&x| Bf16::from_f32(x)).collect::<Vec<_>>()),
        DType::I32 | DType::U8 => Vec::new(),
    }
}

/// Small limits, so that grid-stride loops and block sizes other than 1 are exercised.
const HOST_LIMITS: LaunchLimits = LaunchLimits {
    max_threads_per_block: 4,
    max_block: [4, 1, 1],
    max_grid: [3, 1, 1],
    max_shared_mem_per_block: 48 * 1024,
    multiprocessor_count: 1,
};

/// Blocks that hold a matmul tile (2-D blocks, `__syncthreads`), at most 2 per grid.
const HOST_TILED_LIMITS: LaunchLimits = LaunchLimits {
    max_threads_per_block: 256,
    max_block: [16, 16, 1],
    max_grid: [2, 1, 1],
    max_shared_mem_per_block: 48 * 1024,
    multiprocessor_count: 1,
};

/// Every built-in for `dtype` over random inputs, each launched with [`HOST_LIMITS`] and
/// [`HOST_TILED_LIMITS`], plus every half-precision bit pattern through `scale` (both
/// conversions, all rounding cases).
fn host_cases(dtype: DType, rng: &mut Rng) -> Vec<HostCase> {
    let t = |dims: &[usize]| TensorNode::new("t", dtype, dims.to_vec());
    let mut specs = Vec::new();
    for (m, k, n) in [(5, 3, 7), (9, 4, 2)] {
        let mn = m * n;
        specs.extend([
            kernels::fill(&t(&[m, n]), -1.3),
            kernels::copy(&t(&[m, n]), &t(&[mn])),
            kernels::copy_range(&t(&[m, n]), 2, &t(&[mn]), 1, mn - 3),
            kernels::add_into(&t(&[m, n]), &t(&[m, n])),
            kernels::add_merge(&t(&[m, n])),
            kernels::copy_merge(&t(&[m, n])),
            kernels::scale(&t(&[m, n]), &t(&[m, n]), 0.3),
            kernels::scale_in_place(&t(&[m, n]), -1.7),
            kernels::axpy(&t(&[m, n]), &t(&[m, n]), 0.7),
            kernels::sgd_step(&t(&[m, n]), &t(&[m, n]), 0.01),
            kernels::relu(&t(&[m, n]), &t(&[m, n])),
            kernels::relu_backward(&t(&[m, n]), &t(&[m, n]), &t(&[m, n])),
            kernels::mul(&t(&[m, n]), &t(&[m, n]), &t(&[m, n])),
            kernels::add_row_bias(&t(&[m, n]), &t(&[n])),
            kernels::sum_rows(&t(&[n]), &t(&[m, n])),
            kernels::softmax_xent(&t(&[1]), &t(&[m, n]), &t(&[m, n]), &t(&[m, n]), 0.125),
            kernels::matmul(&t(&[m, n]), &t(&[m, k]), &t(&[k, n])),
            kernels::matmul_tn(&t(&[m, n]), &t(&[k, m]), &t(&[k, n])),
            kernels::matmul_nt(&t(&[m, n]), &t(&[m, k]), &t(&[n, k])),
        ]);
    }
    // Several tiles, striding blocks, and a last partial slice of `k`.
    let (m, k, n) = (37, 35, 20);
    specs.extend([
        kernels::matmul(&t(&[m, n]), &t(&[m, k]), &t(&[k, n])),
        kernels::matmul_tn(&t(&[m, n]), &t(&[k, m]), &t(&[k, n])),
        kernels::matmul_nt(&t(&[m, n]), &t(&[m, k]), &t(&[n, k])),
    ]);
    if matches!(dtype, DType::F16 | DType::BF16) {
        specs.push(kernels::scale(&t(&[65536]), &t(&[65536]), 1.0));
        specs.push(kernels::scale(&t(&[65536]), &t(&[65536]), 0.3));
    }
    let mut cases = Vec::new();
    for (spec, limits) in specs
        .into_iter()
        .flat_map(|s| [(s.clone(), HOST_LIMITS), (s, HOST_TILED_LIMITS)])
    {
        let spec = match spec {
            Ok(spec) => spec,
            Err(tributary::Error::DTypeMismatch { .. }) => continue, // not for this dtype
            Err(e) => panic!("{dtype}: {e}"),
        };
        let softmax = spec.name.starts_with("softmax_xent");
        let inputs: Vec<Vec<u8>> = spec
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n = p.node.numel();
                match (p.access, softmax && i == 3, spec.name.contains("65536")) {
                    (Access::Write, _, _) => vec![0; n * dtype.size_in_bytes()],
                    (_, true, _) => {
                        labels(dtype, p.node.shape().dims()[0], p.node.shape().dims()[1])
                    }
                    _ if spec.params.len() == 2 && n == 65536 => {
                        (0..=u16::MAX).flat_map(u16::to_ne_bytes).collect()
                    }
                    _ => host_input(dtype, n, rng),
                }
            })
            .collect();
        let merge = spec
            .merge
            .as_ref()
            .map(|m| host_input(dtype, m.numel(), rng));
        let binding = |i: usize, node: &TensorNode, access: Access| {
            ArgBinding::new(
                GlobalLoc {
                    device: DeviceId(0),
                    loc: BufferLoc {
                        pool: PoolId(0),
                        offset: i as u64 * 1024,
                    },
                },
                node.size_in_bytes().expect("size"),
                dtype,
                node.shape().clone(),
                access,
            )
        };
        let args: Vec<ArgBinding> = spec
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| binding(i, &p.node, p.access))
            .collect();
        let merge_binding = spec.merge.as_ref().map(|m| binding(99, m, Access::Read));
        let launches = kernel_launches(
            &spec.kernel,
            &args,
            merge_binding.as_ref(),
            &tributary::kernels::Bindings::none(),
            &limits,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        cases.push(HostCase {
            spec,
            inputs,
            merge,
            launches,
        });
    }
    cases
}

/// The indexed user kernel's launch passes the buffer, the scalars, then the index values
/// in declaration order, with the C types its source declares (no toolkit needed).
#[test]
fn user_kernel_index_values_are_its_last_parameters() {
    use tributary::kernels::{CudaKernel, CudaScalar, IndexType};
    let y = TensorNode::new("y", DType::F32, [1000]);
    let spec = RoutineSpec::cuda(
        "fill_step",
        vec![(y.clone(), Access::Write)],
        None,
        CudaKernel::cuda_c(USER_INDEXED_KERNEL, "fill_step", [4, 1, 1], [128, 1, 1])
            .with_scalars([CudaScalar::U64(1000), CudaScalar::F32(0.5)]),
    )
    .unwrap()
    .with_index("t")
    .unwrap()
    .with_index_typed("shift", IndexType::I64)
    .unwrap();
    let bindings = spec
        .bindings()
        .with("t", 7)
        .unwrap()
        .with("shift", -9)
        .unwrap();
    let arg = ArgBinding::new(
        GlobalLoc {
            device: DeviceId(0),
            loc: BufferLoc {
                pool: PoolId(0),
                offset: 0,
            },
        },
        4000,
        DType::F32,
        y.shape().clone(),
        Access::Write,
    );
    let launches = kernel_launches(
        &spec.kernel,
        &[arg],
        None,
        &bindings,
        &LaunchLimits::MINIMUM,
    )
    .unwrap();
    assert_eq!(launches.len(), 1);
    let params = &launches[0].params;
    assert_eq!(
        params,
        &vec![
            LaunchParam::Buffer(0),
            LaunchParam::U64(1000),
            LaunchParam::F32(0.5),
            LaunchParam::U32(7),
            LaunchParam::I64(-9),
        ]
    );
    // Each parameter's C type is the one the source declares at that position.
    let declared = declarations(USER_INDEXED_KERNEL, "fill_step");
    assert_eq!(declared.len(), params.len(), "{declared:?}");
    for (p, d) in params.iter().zip(&declared) {
        let want = match p {
            LaunchParam::Buffer(_) | LaunchParam::Merge => "float*",
            LaunchParam::U32(_) => "unsigned int",
            LaunchParam::U64(_) => "unsigned long long",
            LaunchParam::I32(_) => "int",
            LaunchParam::I64(_) => "long long",
            LaunchParam::F32(_) => "float",
            LaunchParam::F64(_) => "double",
        };
        assert!(
            d.starts_with(want) && !d[want.len()..].trim_start().contains(' '),
            "parameter {d:?} is not a {want}"
        );
    }
}

/// The parameter declarations of `entry` in `source` (`const float* src`, `u64 n`, ...).
fn declarations<'s>(source: &'s str, entry: &str) -> Vec<&'s str> {
    let head = format!("extern \"C\" __global__ void {entry}(");
    let start = source.find(&head).expect("entry point") + head.len();
    let end = start + source[start..].find(')').expect("closing parenthesis");
    source[start..end].split(',').map(str::trim).collect()
}

/// A C++ program running `cases` of `source` and writing every written buffer, in order,
/// to the file named by its second argument; inputs come from the file named first.
/// Blocks run one after the other, the threads of a block concurrently (`host_launch`).
fn host_driver(source: &str, cases: &[HostCase]) -> (String, Vec<u8>) {
    let mut inputs = Vec::new();
    let mut c = String::from(HOST_SHIM);
    c.push_str(source);
    // Buffers are globals, each launch a function of its own (`launch_<n>`), and `main`
    // loads the inputs, runs the launches in order and writes the outputs.
    let mut main = String::from(
        "int main(int argc, char** argv) {\n\
         \x20 if (argc != 3) return 2;\n\
         \x20 FILE* in = fopen(argv[1], \"rb\");\n\
         \x20 if (!in) return 3;\n\
         \x20 fseek(in, 0, SEEK_END);\n  long size = ftell(in);\n  fseek(in, 0, SEEK_SET);\n\
         \x20 unsigned char* all = (unsigned char*)malloc(size + 1);\n\
         \x20 if (fread(all, 1, size, in) != (size_t)size) return 4;\n\
         \x20 FILE* out = fopen(argv[2], \"wb\");\n\
         \x20 if (!out) return 5;\n",
    );
    c.push_str(
        "\nstatic unsigned char* input_at(const unsigned char* all, size_t off, size_t len) {\n\
         \x20 unsigned char* p = (unsigned char*)aligned_alloc(64, len + 64);\n\
         \x20 memcpy(p, all + off, len);\n  return p;\n}\n",
    );
    let mut launch_count = 0;
    for (ci, case) in cases.iter().enumerate() {
        let mut buffers: Vec<String> = Vec::new();
        for (i, bytes) in case.inputs.iter().chain(&case.merge).enumerate() {
            c.push_str(&format!("static unsigned char* b{ci}_{i};\n"));
            main.push_str(&format!(
                "  b{ci}_{i} = input_at(all, {}, {});\n",
                inputs.len(),
                bytes.len()
            ));
            inputs.extend_from_slice(bytes);
            buffers.push(format!("b{ci}_{i}"));
        }
        for l in &case.launches {
            let decls = declarations(source, &l.entry_point);
            assert_eq!(decls.len(), l.params.len(), "{}", l.entry_point);
            let args: Vec<String> = l
                .params
                .iter()
                .zip(&decls)
                .map(|(p, decl)| {
                    let ty = decl.rsplit_once(' ').map_or(*decl, |(ty, _)| ty);
                    match *p {
                        LaunchParam::Buffer(i) => format!("({ty}){}", buffers[i]),
                        LaunchParam::Merge => format!("({ty}){}", buffers[case.inputs.len()]),
                        LaunchParam::U32(x) => format!("({ty}){x}u"),
                        LaunchParam::U64(x) => format!("({ty}){x}ull"),
                        LaunchParam::I32(x) => format!("({ty})({x})"),
                        LaunchParam::I64(x) => format!("({ty})({x}ll)"),
                        LaunchParam::F32(x) => format!("__uint_as_float({}u)", x.to_bits()),
                        LaunchParam::F64(x) => format!("host_f64({}ull)", x.to_bits()),
                    }
                })
                .collect();
            assert_eq!(l.grid[1..], [1, 1], "{}: 1-D grids", l.entry_point);
            assert_eq!(l.block[2], 1, "{}: 1-D or 2-D blocks", l.entry_point);
            c.push_str(&format!(
                "static void launch_{launch_count}() {{ {}({}); }}\n",
                l.entry_point,
                args.join(", ")
            ));
            main.push_str(&format!(
                "  host_launch({}, {}, {}, launch_{launch_count});\n",
                l.grid[0], l.block[0], l.block[1],
            ));
            launch_count += 1;
        }
        for (i, (p, bytes)) in case.spec.params.iter().zip(&case.inputs).enumerate() {
            if p.access.writes() {
                main.push_str(&format!("  fwrite(b{ci}_{i}, 1, {}, out);\n", bytes.len()));
            }
        }
    }
    main.push_str("  fclose(out);\n  return 0;\n}\n");
    c.push_str(&main);
    (c, inputs)
}

/// Relative tolerance (of the magnitude, at least 1) of the softmax outputs, as in the
/// backend conformance suite; everything else must be bitwise equal.
fn softmax_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F64 => 1e-12,
        DType::F16 => 1e-3,
        _ => 8e-3,
    }
}

fn dtype_is_float(dtype: DType) -> bool {
    !matches!(dtype, DType::I32 | DType::U8)
}

fn as_f64(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    use tributary::kernels::from_bytes;
    match dtype {
        DType::F32 => from_bytes::<f32>(bytes)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F64 => from_bytes::<f64>(bytes).unwrap(),
        DType::F16 => from_bytes::<F16>(bytes)
            .unwrap()
            .iter()
            .map(|h| f64::from(h.to_f32()))
            .collect(),
        DType::BF16 => from_bytes::<Bf16>(bytes)
            .unwrap()
            .iter()
            .map(|h| f64::from(h.to_f32()))
            .collect(),
        DType::I32 | DType::U8 => bytes.iter().map(|&b| f64::from(b)).collect(),
    }
}

/// The CUDA C of every built-in, compiled for the host with `c++` (shimmed CUDA
/// intrinsics, the launches' grids run sequentially) and run over random inputs, equals the
/// CPU backend: bitwise, except `softmax_xent` within the conformance suite's tolerance.
/// This checks the kernels' arithmetic, operation order, `f16`/`bf16` conversions and
/// launch parameters without a GPU; skipped (with a message) without a C++ compiler.
#[test]
fn builtin_cuda_c_run_on_the_host_matches_the_cpu_backend() {
    let cxx = std::env::var_os("CXX").map_or_else(|| PathBuf::from("c++"), PathBuf::from);
    if let Err(e) = Command::new(&cxx).arg("--version").output() {
        assert!(
            !required(),
            "TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1 but {} does not run: {e}",
            cxx.display()
        );
        println!(
            "skipping CUDA kernel check on the host: {} does not run: {e}",
            cxx.display()
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("tributary-cuda-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut checked = 0;
    for dtype in DType::ALL {
        let cases = host_cases(dtype, &mut rng);
        let tiled = cases
            .iter()
            .flat_map(|c| &c.launches)
            .filter(|l| l.entry_point.contains("_tiled_"))
            .count();
        assert_eq!(
            tiled > 0,
            !matches!(dtype, DType::I32 | DType::U8),
            "{dtype}: tiled"
        );
        let source = Program::Builtins(dtype)
            .cuda_c()
            .expect("CUDA C")
            .into_owned();
        let (driver, inputs) = host_driver(&source, &cases);
        let (cpp, exe) = (dir.join(format!("{dtype}.cpp")), dir.join(dtype.name()));
        let (input_file, output_file) = (
            dir.join(format!("{dtype}.in")),
            dir.join(format!("{dtype}.out")),
        );
        std::fs::write(&cpp, driver).unwrap();
        std::fs::write(&input_file, inputs).unwrap();
        let build = Command::new(&cxx)
            .args([
                "-std=c++20",
                "-pthread",
                "-O0",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-o",
            ])
            .arg(&exe)
            .arg(&cpp)
            .arg("-lm")
            .output()
            .unwrap();
        assert!(
            build.status.success(),
            "{dtype}: the host build of the CUDA C fails:\n{}",
            String::from_utf8_lossy(&build.stderr)
        );
        let run = Command::new(&exe)
            .arg(&input_file)
            .arg(&output_file)
            .status()
            .unwrap();
        assert!(run.success(), "{dtype}: the host run fails: {run}");
        let outputs = std::fs::read(&output_file).unwrap();
        let mut at = 0;
        for case in cases {
            let mut want = case.inputs.clone();
            kernels::run_on_host(&case.spec, &mut want, case.merge.as_deref())
                .unwrap_or_else(|e| panic!("{} on the CPU: {e}", case.spec.name));
            for (i, p) in case.spec.params.iter().enumerate() {
                if !p.access.writes() {
                    continue;
                }
                let got = &outputs[at..at + want[i].len()];
                at += want[i].len();
                let what = format!("{} ({dtype}), argument {i}", case.spec.name);
                if case.spec.name.starts_with("softmax_xent") {
                    let tol = softmax_tolerance(dtype);
                    for (j, (g, w)) in as_f64(dtype, got)
                        .iter()
                        .zip(as_f64(dtype, &want[i]))
                        .enumerate()
                    {
                        let err = (g - w).abs() / w.abs().max(1.0);
                        assert!(
                            err <= tol || (g.is_nan() && w.is_nan()),
                            "{what}: element {j}: got {g}, want {w}"
                        );
                    }
                } else if got != want[i].as_slice() {
                    // Bitwise, except that any NaN equals any NaN: which operand's sign
                    // and payload a NaN result carries depends on the compiler's operand
                    // order on the host, and GPUs return the canonical NaN anyway.
                    let size = dtype.size_in_bytes();
                    let (g, w) = (as_f64(dtype, got), as_f64(dtype, &want[i]));
                    let differs = |j: usize| {
                        got[j * size..(j + 1) * size] != want[i][j * size..(j + 1) * size]
                            && !(g[j].is_nan() && w[j].is_nan() && dtype_is_float(dtype))
                    };
                    if let Some(j) = (0..got.len() / size).find(|&j| differs(j)) {
                        panic!(
                            "{what}: not bitwise equal to the CPU backend; element {j}: got \
                             {:02x?}, want {:02x?}",
                            &got[j * size..(j + 1) * size],
                            &want[i][j * size..(j + 1) * size]
                        );
                    }
                }
            }
            checked += 1;
        }
        assert_eq!(at, outputs.len(), "{dtype}: every output was read");
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{checked} built-in calls of the CUDA C, run on the host, match the CPU backend");
}
