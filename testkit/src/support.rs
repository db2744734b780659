//! Helpers shared by the end-to-end tests: the backend kinds and how to get a backend (or
//! why not), nodes, and kernels that behave alike on every backend (slow ones that make the
//! wrong interleaving likely when a synchronisation rule is missing, failing ones).
//!
//! "Write the tests once, run them on every backend present": a test body is a function of
//! a [`Kind`]; [`for_each_backend!`] turns a list of such functions into one `#[test]` per
//! backend kind (`cpu::name`, `vulkan::name`, `cuda::name`, and `vulkan_staging::name` where
//! asked). When Vulkan is not available, its tests print `skipping Vulkan (<test>):
//! <reason>` and pass, unless `TRIBUTARY_REQUIRE_VULKAN=1` (set by `.ci/run` once lavapipe
//! is installed): then they fail. CUDA likewise: `skipping CUDA (<test>): <reason>` where
//! there is no GPU, a failure under `TRIBUTARY_REQUIRE_CUDA=1` (set by
//! `scripts/gpu-check.sh`). Every GPU test that runs prints one line saying so; all these
//! lines go straight to the process's stderr, past the test harness's output capture, so
//! the run log shows what ran where.

use std::{
    io::Write,
    sync::{Arc, OnceLock},
    thread::sleep,
    time::Duration,
};

use tributary::{
    backend::{
        cpu::{CpuBackend, CpuConfig},
        cuda::{CudaBackend, CudaConfig},
        vulkan::{VulkanBackend, VulkanConfig},
        Backend, BackendKind,
    },
    kernels::{Access, CudaKernel, CudaScalar, KernelMode, RoutineSpec, ShaderKernel},
    DType, DeviceId, MemoryMode, Sharing, TensorNode,
};

/// Elements of the test nodes.
pub const N: usize = 256;

/// An `N`-element f32 node with a memory mode.
pub fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

/// [`node`], declared zero-initialised: an accumulator whose fresh buffers may be read.
pub fn zeroed_node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new_zeroed(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

/// On-device, one buffer shared by all streams of a device.
pub fn shared() -> MemoryMode {
    MemoryMode::OnDevice(Sharing::SharedCrossStreams)
}

/// Whether every element equals `x`.
pub fn all(v: &[f32], x: f32) -> bool {
    v.iter().all(|&y| y == x)
}

/// `x *= 2` in place, through a custom kernel (CPU only).
pub fn double(x: &TensorNode) -> RoutineSpec {
    RoutineSpec::custom("double", vec![(x.clone(), Access::ReadWrite)], None, |a| {
        a.output::<f32>(0)?.iter_mut().for_each(|v| *v *= 2.0);
        Ok(())
    })
    .expect("spec")
}

/// `x += t` with index `t` (i32), through a custom kernel (CPU only).
pub fn add_index(x: &TensorNode) -> RoutineSpec {
    RoutineSpec::custom(
        "add_index",
        vec![(x.clone(), Access::ReadWrite)],
        None,
        |a| {
            let t = a.index("t")? as f32;
            for v in a.output::<f32>(0)?.iter_mut() {
                *v += t;
            }
            Ok(())
        },
    )
    .and_then(|s| s.with_index_typed("t", tributary::kernels::IndexType::I32))
    .expect("spec")
}

/// `dst[i] = t` (`t` the `i32` index named `index`, converted to `dst`'s dtype, `f32` or `i32`): a Rust
/// closure on the CPU, WGSL (the value a push constant after the element count) on
/// Vulkan, CUDA C (the value the argument after the element count) on CUDA.
pub fn fill_index(dst: &TensorNode, backend: &str, index: &str) -> tributary::Result<RoutineSpec> {
    use tributary::kernels::IndexType;
    let params = vec![(dst.clone(), Access::Write)];
    let n = dst.numel();
    let (f32s, ty) = match dst.dtype() {
        DType::F32 => (true, "f32"),
        _ => (false, "i32"),
    };
    let index_name = index.to_string();
    let spec = match backend {
        "vulkan" => RoutineSpec::shader(
            "fill_index",
            params,
            None,
            ShaderKernel::wgsl(
                format!(
                    "struct P {{ n: u32, t: i32 }}
var<immediate> p: P;
@group(0) @binding(0) var<storage, read_write> d: array<{ty}>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    if (id.x < p.n) {{ d[id.x] = {ty}(p.t); }}
}}"
                ),
                [(n as u32).div_ceil(64), 1, 1],
            )
            .with_immediates((n as u32).to_le_bytes().to_vec()),
        ),
        "cuda" => {
            let c = if f32s { "float" } else { "int" };
            RoutineSpec::cuda(
                "fill_index",
                params,
                None,
                CudaKernel::cuda_c(
                    format!(
                        r#"extern "C" __global__ void fill_index({c}* d, unsigned long long n, int t) {{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {{ d[i] = ({c})t; }}
}}"#
                    ),
                    "fill_index",
                    [(n as u32).div_ceil(256), 1, 1],
                    [256, 1, 1],
                )
                .with_scalars([CudaScalar::U64(n as u64)]),
            )
        }
        _ => RoutineSpec::custom("fill_index", params, None, move |a| {
            let t = a.index(&index_name)?;
            if f32s {
                a.output::<f32>(0)?.fill(t as f32);
            } else {
                a.output::<i32>(0)?.fill(t as i32);
            }
            Ok(())
        }),
    }?;
    spec.with_index_typed(index, IndexType::I32)
}

/// Which backend a test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The CPU backend.
    Cpu,
    /// Vulkan, host access to mapped pool memory where the driver allows it.
    Vulkan,
    /// Vulkan with every host transfer staged (as on a discrete GPU).
    VulkanStaging,
    /// CUDA, on as many logical devices as the test asks for (round-robin over the GPUs).
    Cuda,
}

impl Kind {
    /// The backend's name, as [`fill_index`] and the other per-backend kernels take it.
    pub fn backend_name(self) -> &'static str {
        match self {
            Kind::Cpu => "cpu",
            Kind::Cuda => "cuda",
            Kind::Vulkan | Kind::VulkanStaging => "vulkan",
        }
    }

    pub fn is_vulkan(self) -> bool {
        matches!(self, Kind::Vulkan | Kind::VulkanStaging)
    }

    /// Whether a kernel on one device can read another device's memory in place
    /// (`StreamingFor` across devices): always on the CPU, never across `VkDevice`s; for
    /// CUDA, asked once of a backend of two devices configured as the tests' are
    /// ([`cuda_configured`]): yes where peer access is on or the two share a context
    /// (`TRIBUTARY_CUDA_SHARE_CONTEXT=1` on one GPU).
    pub fn streams_across_devices(self) -> bool {
        match self {
            Kind::Cpu => true,
            Kind::Vulkan | Kind::VulkanStaging => false,
            Kind::Cuda => {
                static ANSWER: OnceLock<bool> = OnceLock::new();
                *ANSWER.get_or_init(|| {
                    CudaBackend::new(DeviceId(0), cuda_configured(2))
                        .is_ok_and(|b| b.can_stream(DeviceId(0), DeviceId(1)))
                })
            }
        }
    }
}

/// Writes a line to the process's stderr, past the test harness's capture (on a line of
/// its own: the harness may be in the middle of one).
pub fn log(line: &str) {
    let _ = write!(std::io::stderr(), "\n{line}\n");
}

/// `Ok(description)` when Vulkan is usable here, `Err(reason)` otherwise (probed once).
pub fn vulkan_available() -> Result<String, String> {
    static PROBE: OnceLock<Result<String, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            tributary::backend::vulkan::probe()
                .map(|info| format!("Vulkan {} on {}", info.api_version, info.devices.join(", ")))
                .map_err(|e| e.to_string())
        })
        .clone()
}

fn require_vulkan() -> bool {
    std::env::var("TRIBUTARY_REQUIRE_VULKAN").is_ok_and(|v| v == "1")
}

/// The Vulkan configuration of `kind` with `devices` logical devices, or `None` after
/// logging why the test is skipped (a failure instead under `TRIBUTARY_REQUIRE_VULKAN=1`).
pub fn vulkan_config(kind: Kind, devices: usize, test: &str) -> Option<VulkanConfig> {
    if let Err(reason) = vulkan_available() {
        assert!(
            !require_vulkan(),
            "TRIBUTARY_REQUIRE_VULKAN=1 but Vulkan is unavailable: {reason}"
        );
        log(&format!("skipping Vulkan ({test}): {reason}"));
        return None;
    }
    let staging = kind == Kind::VulkanStaging;
    log(&format!(
        "vulkan{}: running {test} on {devices} logical devices ({})",
        if staging { " (staging)" } else { "" },
        vulkan_available().unwrap_or_default()
    ));
    Some(VulkanConfig {
        devices: Some(devices),
        force_staging: staging,
        ..VulkanConfig::default()
    })
}

/// `Ok(description)` when CUDA is usable here, `Err(reason)` otherwise (probed once).
pub fn cuda_available() -> Result<String, String> {
    static PROBE: OnceLock<Result<String, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            tributary::backend::cuda::probe()
                .map(|info| {
                    format!(
                        "CUDA {} on {}",
                        info.driver_version,
                        info.devices.join(", ")
                    )
                })
                .map_err(|e| e.to_string())
        })
        .clone()
}

fn require_cuda() -> bool {
    std::env::var("TRIBUTARY_REQUIRE_CUDA").is_ok_and(|v| v == "1")
}

/// The CUDA configuration the tests run with, `devices` logical devices: the default, with
/// every logical device of a GPU in its primary context under
/// `TRIBUTARY_CUDA_SHARE_CONTEXT=1` (`CudaConfig::share_context`).
pub fn cuda_configured(devices: usize) -> CudaConfig {
    CudaConfig {
        share_context: std::env::var("TRIBUTARY_CUDA_SHARE_CONTEXT").is_ok_and(|v| v == "1"),
        ..CudaConfig::with_devices(devices)
    }
}

/// The CUDA configuration with `devices` logical devices ([`cuda_configured`]), or `None`
/// after logging why the test is skipped (a failure instead under
/// `TRIBUTARY_REQUIRE_CUDA=1`).
pub fn cuda_config(devices: usize, test: &str) -> Option<CudaConfig> {
    if let Err(reason) = cuda_available() {
        assert!(
            !require_cuda(),
            "TRIBUTARY_REQUIRE_CUDA=1 but CUDA is unavailable: {reason}"
        );
        log(&format!("skipping CUDA ({test}): {reason}"));
        return None;
    }
    let config = cuda_configured(devices);
    log(&format!(
        "cuda: running {test} on {devices} logical devices{} ({})",
        if config.share_context {
            " sharing a context per GPU"
        } else {
            ""
        },
        cuda_available().unwrap_or_default()
    ));
    Some(config)
}

/// The backend of `kind` with `devices` devices, or `None` when it is not available.
pub fn backend(kind: Kind, devices: usize, test: &str) -> Option<Arc<dyn Backend>> {
    match kind {
        // The exact kernel mode: the order every GPU backend reproduces bit for bit.
        Kind::Cpu => Some(Arc::new(
            CpuBackend::with_config(DeviceId(0), devices, exact_cpu()).expect("cpu backend"),
        )),
        Kind::Vulkan | Kind::VulkanStaging => {
            let config = vulkan_config(kind, devices, test)?;
            Some(Arc::new(
                VulkanBackend::new(DeviceId(0), config).expect("vulkan backend"),
            ))
        }
        Kind::Cuda => {
            let config = cuda_config(devices, test)?;
            Some(Arc::new(
                CudaBackend::new(DeviceId(0), config).expect("cuda backend"),
            ))
        }
    }
}

/// The CPU configuration of the suites that compare with other backends or with
/// `kernels::run_on_host`: the exact kernel mode (DESIGN.md §5).
pub fn exact_cpu() -> CpuConfig {
    CpuConfig::default().with_kernel_mode(KernelMode::Exact)
}

/// The [`BackendKind`] of `kind` (for `System`), or `None` when it is not available.
pub fn backend_kind(kind: Kind, devices: usize, test: &str) -> Option<BackendKind> {
    match kind {
        Kind::Cpu => Some(BackendKind::Cpu),
        Kind::Cuda => cuda_config(devices, test).map(BackendKind::Cuda),
        _ => vulkan_config(kind, devices, test).map(BackendKind::Vulkan),
    }
}

/// One `#[test]` per backend kind for every listed test body `fn name(kind: Kind)`:
/// `for_each_backend!(a, b)` makes `cpu::a`, `vulkan::a`, `cuda::a`; `for_each_backend!(staging:
/// a)` also makes `vulkan_staging::a`.
#[macro_export]
macro_rules! for_each_backend {
    (staging: $($name:ident),* $(,)?) => {
        $crate::for_each_backend!($($name),*);
        mod vulkan_staging {
            $( #[test] fn $name() { super::$name($crate::support::Kind::VulkanStaging) } )*
        }
    };
    ($($name:ident),* $(,)?) => {
        mod cpu {
            $( #[test] fn $name() { super::$name($crate::support::Kind::Cpu) } )*
        }
        mod vulkan {
            $( #[test] fn $name() { super::$name($crate::support::Kind::Vulkan) } )*
        }
        mod cuda {
            $( #[test] fn $name() { super::$name($crate::support::Kind::Cuda) } )*
        }
    };
}

// ---------------------------------------------------------------------------------------
// Kernels that behave alike on every backend: Rust closures on the CPU, WGSL on Vulkan,
// CUDA C on CUDA.

/// How long a slow CPU kernel sleeps.
pub const DELAY: Duration = Duration::from_millis(60);
/// Iterations of the spinning shader's loop, each of [`UNROLL`] dependent xorshift steps:
/// about 60 ms per workgroup on lavapipe. (llvmpipe stops an invocation after 65535 loop
/// iterations in all, so the work is in the unrolled body, not in the iteration count.)
const SPIN: u32 = 60_000;
const UNROLL: usize = 200;

/// A shader that spins, then stores `expr` (of `s`, `v`, `z`) into `d[i]` for every `i`.
fn spin_wgsl(bindings: &str, expr: &str) -> String {
    let step = "x ^= x << 13u; x ^= x >> 17u; x ^= x << 5u; ".repeat(UNROLL);
    format!(
        "struct P {{ n: u32, iters: u32, value: f32, zero: f32 }}
var<immediate> p: P;
{bindings}
@compute @workgroup_size(1)
fn main() {{
    var x = 1u;
    for (var i = 0u; i < p.iters; i++) {{ {step} }}
    let z = f32(x >> 31u) * p.zero;
    let v = p.value + z;
    for (var i = 0u; i < p.n; i++) {{ d[i] = {expr}; }}
}}"
    )
}

fn spin_immediates(n: usize, value: f32) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(n as u32).to_le_bytes());
    b.extend_from_slice(&SPIN.to_le_bytes());
    b.extend_from_slice(&value.to_le_bytes());
    b.extend_from_slice(&0f32.to_le_bytes());
    b
}

/// Iterations of the spinning CUDA kernels' xorshift loop per unit of work: tens of
/// milliseconds on a current GPU (one thread; the loop's steps depend on each other).
const SPIN_CUDA: u64 = 5_000_000;

/// A CUDA kernel of one thread that spins `iters` xorshift steps, then stores `expr` (of
/// `s`, `v`, `z`) into `d[i]` for every `i < n`; `zero` (0.0 at run time) keeps the spin
/// from being optimised away.
fn spin_cuda(name: &str, params: &str, expr: &str) -> String {
    format!(
        r#"extern "C" __global__ void {name}({params}unsigned long long n, unsigned long long iters, float v, float zero) {{
    unsigned int x = 1u;
    for (unsigned long long i = 0; i < iters; ++i) {{ x ^= x << 13; x ^= x >> 17; x ^= x << 5; }}
    float z = (float)(x >> 31) * zero;
    for (unsigned long long i = 0; i < n; ++i) {{ d[i] = {expr}; }}
}}"#
    )
}

/// The scalars of a spinning CUDA kernel.
fn spin_cuda_scalars(n: usize, times: u32, value: f32) -> [CudaScalar; 4] {
    [
        CudaScalar::U64(n as u64),
        CudaScalar::U64(SPIN_CUDA * u64::from(times.max(1))),
        CudaScalar::F32(value),
        CudaScalar::F32(0.0),
    ]
}

/// The WGSL of [`slow_fill`] (also a shader the CPU backend refuses).
pub fn slow_fill_wgsl() -> String {
    spin_wgsl(
        "@group(0) @binding(0) var<storage, read_write> d: array<f32>;",
        "v",
    )
}

/// `dst = value` (f32), slowly: about `DELAY * times` on the CPU, `times` spinning
/// workgroups on Vulkan (all storing the same values).
pub fn slow_fill_times(kind: Kind, dst: &TensorNode, value: f32, times: u32) -> RoutineSpec {
    let params = vec![(dst.clone(), Access::Write)];
    match kind {
        Kind::Cpu => RoutineSpec::custom("slow_fill", params, None, move |a| {
            sleep(DELAY * times);
            a.output::<f32>(0)?.fill(value);
            Ok(())
        }),
        Kind::Cuda => RoutineSpec::cuda(
            "slow_fill",
            params,
            None,
            CudaKernel::cuda_c(
                spin_cuda("slow_fill", "float* d, ", "v + z"),
                "slow_fill",
                [1, 1, 1],
                [1, 1, 1],
            )
            .with_scalars(spin_cuda_scalars(dst.numel(), times, value)),
        ),
        _ => RoutineSpec::shader(
            "slow_fill",
            params,
            None,
            ShaderKernel::wgsl(slow_fill_wgsl(), [times.max(1), 1, 1])
                .with_immediates(spin_immediates(dst.numel(), value)),
        ),
    }
    .expect("spec")
}

/// `dst = value` (f32), slowly (tens of milliseconds).
pub fn slow_fill_on(kind: Kind, dst: &TensorNode, value: f32) -> RoutineSpec {
    slow_fill_times(kind, dst, value, 1)
}

/// `dst = value` (f32), after sleeping (a slow writer of `dst`; CPU only).
pub fn slow_fill(dst: &TensorNode, value: f32) -> RoutineSpec {
    slow_fill_on(Kind::Cpu, dst, value)
}

/// `dst = src` (f32), slowly.
pub fn slow_copy_on(kind: Kind, dst: &TensorNode, src: &TensorNode) -> RoutineSpec {
    let params = vec![(dst.clone(), Access::Write), (src.clone(), Access::Read)];
    match kind {
        Kind::Cpu => RoutineSpec::custom("slow_copy", params, None, |a| {
            sleep(DELAY);
            let s = a.input::<f32>(1)?.to_vec();
            a.output::<f32>(0)?.copy_from_slice(&s);
            Ok(())
        }),
        Kind::Cuda => RoutineSpec::cuda(
            "slow_copy",
            params,
            None,
            CudaKernel::cuda_c(
                spin_cuda("slow_copy", "float* d, const float* s, ", "s[i] + z"),
                "slow_copy",
                [1, 1, 1],
                [1, 1, 1],
            )
            .with_scalars(spin_cuda_scalars(dst.numel(), 1, 0.0)),
        ),
        _ => RoutineSpec::shader(
            "slow_copy",
            params,
            None,
            ShaderKernel::wgsl(
                spin_wgsl(
                    "@group(0) @binding(0) var<storage, read_write> d: array<f32>;
@group(0) @binding(1) var<storage, read> s: array<f32>;",
                    "s[i] + z",
                ),
                [1, 1, 1],
            )
            .with_immediates(spin_immediates(dst.numel(), 0.0)),
        ),
    }
    .expect("spec")
}

/// A kernel named `name` that fails when it runs, with `message` in its failure: a
/// panicking closure on the CPU, a shader that does not compile on Vulkan (the message is
/// in the WGSL, which the compile error quotes), CUDA C stopped by an `#error` directive
/// carrying the message on CUDA (NVRTC's log quotes it).
pub fn failing(kind: Kind, name: &str, dst: &TensorNode, message: &'static str) -> RoutineSpec {
    let params = vec![(dst.clone(), Access::Write)];
    match kind {
        Kind::Cpu => RoutineSpec::custom(name, params, None, move |_| panic!("{message}")),
        Kind::Cuda => RoutineSpec::cuda(
            name,
            params,
            None,
            CudaKernel::cuda_c(
                format!("#error {message}\nextern \"C\" __global__ void boom(float* d) {{}}"),
                "boom",
                [1, 1, 1],
                [1, 1, 1],
            ),
        ),
        _ => RoutineSpec::shader(
            name,
            params,
            None,
            ShaderKernel::wgsl(format!("{message} is not WGSL"), [1, 1, 1]),
        ),
    }
    .expect("spec")
}

/// `dst = src` (f32), after sleeping (a slow reader of `src`; CPU only).
pub fn slow_copy(dst: &TensorNode, src: &TensorNode) -> RoutineSpec {
    slow_copy_on(Kind::Cpu, dst, src)
}
