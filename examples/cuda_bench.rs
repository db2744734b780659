//! The CUDA backend beside raw cudarc calls, in the same run on the same GPU: launch
//! overhead, the cost of a cross-stream event wait, host-to-device, device-to-host and
//! device-to-device bandwidth, and all-reduce bus bandwidth. Each row prints tributary's
//! figure, the raw one, and their ratio.
//!
//! ```sh
//! cargo run --release --features cuda --example cuda_bench            # 1, 16, 64 MiB
//! cargo run --release --features cuda --example cuda_bench -- --quick # 1 MiB, fewer reps
//! ```
//!
//! `scripts/gpu-check.sh` runs it after the test suites (and first with `--probe`, which
//! only prints what the driver reports). Without a GPU it prints why and exits with
//! status 2. Tributary uses two logical devices on GPU 0 (its primary context
//! and a second context, as the test suites do); the raw side uses the same two contexts'
//! worth of calls: `cuLaunchKernel` + `cuStreamSynchronize`, `cuEventRecord` +
//! `cuStreamWaitEvent`, `cuMemcpy*Async` from pinned memory, `cuMemcpyPeerAsync`.
//! Bandwidths are GB/s = 10^9 bytes per second; times are medians.

use std::{
    process::ExitCode,
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Parser;
use cudarc::{
    driver::{result, CudaContext, CudaSlice, LaunchConfig, PushKernelArg},
    nvrtc::compile_ptx,
};
use tributary::{
    backend::{
        cuda::{probe, CudaBackend, CudaConfig},
        BackendKind,
    },
    collective::{ReduceOp, Strategy, Transfer},
    kernels,
    memory::PoolConfig,
    DType, DeviceId, Engine, HostedKind, MemoryMode, MergeBufferUse, Sharing, TensorNode,
};
use tributary_actors::{AllReducePlan, StreamConfig, System};

#[derive(Parser, Debug)]
#[command(about = "CUDA backend beside raw cudarc: launch, event wait, transfers, all-reduce")]
struct Args {
    /// One size (1 MiB) and fewer repetitions.
    #[arg(long)]
    quick: bool,
    /// Only print what the CUDA driver reports (exit status 2 when CUDA is unavailable).
    #[arg(long)]
    probe: bool,
}

type Measured = Result<f64, String>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Median seconds of `reps` calls of `f` after one warm-up call.
fn time(reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Measured {
    f()?;
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed().as_secs_f64());
    }
    Ok(median(ts))
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

const TINY: &str =
    r#"extern "C" __global__ void tiny(float* p) { if (threadIdx.x == 0) p[0] += 1.0f; }"#;

/// The raw side: two contexts on GPU 0 (like the backend's two logical devices), a stream
/// each plus a second stream on the first, the tiny kernel loaded in the first.
struct Raw {
    ctx: Arc<CudaContext>,
    other: Arc<CudaContext>,
    a: Arc<cudarc::driver::CudaStream>,
    b: Arc<cudarc::driver::CudaStream>,
    c: Arc<cudarc::driver::CudaStream>,
    tiny: cudarc::driver::CudaFunction,
}

impl Raw {
    fn new() -> Result<Raw, String> {
        let ctx = CudaContext::new(0).map_err(s)?;
        let other = CudaContext::new_non_primary(0, 0).map_err(s)?;
        let module = ctx.load_module(compile_ptx(TINY).map_err(s)?).map_err(s)?;
        Ok(Raw {
            a: ctx.new_stream().map_err(s)?,
            b: ctx.new_stream().map_err(s)?,
            c: other.new_stream().map_err(s)?,
            tiny: module.load_function("tiny").map_err(s)?,
            ctx,
            other,
        })
    }

    fn launch_tiny(
        &self,
        stream: &cudarc::driver::CudaStream,
        p: &mut CudaSlice<f32>,
    ) -> Result<(), String> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `tiny` takes one `float*`, given a live device buffer of 1 element.
        unsafe { stream.launch_builder(&self.tiny).arg(p).launch(cfg) }
            .map(|_| ())
            .map_err(s)
    }

    /// A tiny kernel, then a stream sync.
    fn launch_overhead(&self, reps: usize) -> Measured {
        let mut p = self.a.alloc_zeros::<f32>(1).map_err(s)?;
        time(reps, || {
            self.launch_tiny(&self.a, &mut p)?;
            self.a.synchronize().map_err(s)
        })
    }

    /// A tiny kernel on stream A, an event, stream B waits for it and copies 4 bytes.
    fn event_wait(&self, reps: usize) -> Measured {
        let mut p = self.a.alloc_zeros::<f32>(1).map_err(s)?;
        let mut q = self.b.alloc_zeros::<f32>(1).map_err(s)?;
        let ev = self.ctx.new_event(None).map_err(s)?;
        time(reps, || {
            self.launch_tiny(&self.a, &mut p)?;
            ev.record(&self.a).map_err(s)?;
            self.b.wait(&ev).map_err(s)?;
            self.b.memcpy_dtod(&p, &mut q).map_err(s)?;
            self.b.synchronize().map_err(s)
        })
    }

    /// Host to device from pinned memory, device to host into it, device to device (one
    /// context), and between the two contexts (`cuMemcpyPeerAsync`): seconds each.
    fn transfers(&self, bytes: usize, reps: usize) -> Result<[f64; 4], String> {
        // SAFETY: written before it is read (the uploads below copy whatever it holds).
        let mut pinned = unsafe { self.ctx.alloc_pinned::<u8>(bytes) }.map_err(s)?;
        let mut d0 = self.a.alloc_zeros::<u8>(bytes).map_err(s)?;
        let mut d1 = self.a.alloc_zeros::<u8>(bytes).map_err(s)?;
        let h2d = time(reps, || {
            self.a.memcpy_htod(&pinned, &mut d0).map_err(s)?;
            self.a.synchronize().map_err(s)
        })?;
        let d2h = time(reps, || {
            self.a.memcpy_dtoh(&d0, &mut pinned).map_err(s)?;
            self.a.synchronize().map_err(s)
        })?;
        let d2d = time(reps, || {
            self.a.memcpy_dtod(&d0, &mut d1).map_err(s)?;
            self.a.synchronize().map_err(s)
        })?;
        self.other.bind_to_thread().map_err(s)?;
        // SAFETY: freed below, after the last copy into it completed.
        let remote = unsafe { result::malloc_sync(bytes) }.map_err(s)?;
        let peer = time(reps, || {
            use cudarc::driver::DevicePtr;
            let (src, _guard) = d0.device_ptr(&self.a);
            // SAFETY: both allocations are live and `bytes` long; the stream belongs to the
            // destination's context and is synchronised before the next copy.
            unsafe {
                result::memcpy_peer_async(
                    self.other.cu_ctx(),
                    remote,
                    self.ctx.cu_ctx(),
                    src,
                    bytes,
                    self.c.cu_stream(),
                )
            }
            .map_err(s)?;
            self.c.synchronize().map_err(s)
        });
        self.other.bind_to_thread().map_err(s)?;
        // SAFETY: the copies into it completed (each synchronised).
        unsafe { result::free_sync(remote) }.map_err(s)?;
        Ok([h2d, d2h, d2d, peer?])
    }
}

/// The tributary side: an engine on two logical devices x 2 streams.
fn engine() -> Result<Engine, String> {
    let backend = CudaBackend::new(DeviceId(0), CudaConfig::with_devices(2)).map_err(s)?;
    let pools = PoolConfig {
        pool_bytes: 256 << 20,
        ..PoolConfig::default()
    };
    Engine::with_backend(Arc::new(backend), 2, pools).map_err(s)
}

/// A 1-element fill, scheduled and waited for.
fn tributary_launch(e: &mut Engine, reps: usize) -> Measured {
    let t = TensorNode::new("tiny", DType::F32, [1])
        .with_mode(MemoryMode::on_device())
        .map_err(s)?;
    let c = e.context(0, 0).map_err(s)?;
    let r = e.link(&c, kernels::fill(&t, 1.0).map_err(s)?).map_err(s)?;
    let secs = time(reps, || e.schedule(&r).and_then(|ev| ev.wait()).map_err(s));
    e.finalize(r.context()).map_err(s)?;
    secs
}

/// A 1-element fill on stream 0, then a dependent copy on stream 1 of the same device.
fn tributary_event_wait(e: &mut Engine, reps: usize) -> Measured {
    let g = TensorNode::new("g", DType::F32, [1])
        .with_mode(MemoryMode::on_device())
        .map_err(s)?;
    let c0 = e.context(0, 0).map_err(s)?;
    let src = e.link(&c0, kernels::fill(&g, 2.0).map_err(s)?).map_err(s)?;
    let c1 = e.context(0, 1).map_err(s)?;
    let dst = e.link(&c1, kernels::fill(&g, 0.0).map_err(s)?).map_err(s)?;
    e.schedule(&dst).map_err(s)?;
    let secs = time(reps, || {
        e.schedule(&src).map_err(s)?;
        match e
            .device_to_device(&g, src.context(), dst.context(), MergeBufferUse::No)
            .map_err(s)?
        {
            Some(ev) => ev.wait().map_err(s),
            None => Err("a copy that moved nothing".into()),
        }
    });
    e.finalize(dst.context()).map_err(s)?;
    e.finalize(src.context()).map_err(s)?;
    secs
}

/// Upload, download, same-device and cross-device copy of `bytes`: seconds each.
fn tributary_transfers(e: &mut Engine, bytes: usize, reps: usize) -> Result<[Measured; 4], String> {
    let n = bytes / 4;
    let h = TensorNode::new("h", DType::F32, [n])
        .with_mode(MemoryMode::Hosted(HostedKind::ChangedOnDevices(
            Sharing::Unset,
        )))
        .map_err(s)?;
    let c00 = e.context(0, 0).map_err(s)?;
    let c00 = e.init_from_host(&c00, &h, &vec![1.5f32; n]).map_err(s)?;
    e.sync_all().map_err(s)?;
    let up = time(reps, || {
        e.from_host(&c00, &h).and_then(|ev| ev.wait()).map_err(s)
    });
    let down = time(reps, || {
        e.to_host(&c00, &h).and_then(|ev| ev.wait()).map_err(s)
    });
    // Copies from stream 0 of device 0 to stream 1 of device 0, and to device 1; their
    // destinations are written first (by a fill, a built-in), so they hold a buffer.
    let g = TensorNode::new("g", DType::F32, [n])
        .with_mode(MemoryMode::on_device())
        .map_err(s)?;
    let mut copies = [Err("not run".to_string()), Err("not run".to_string())];
    let setup = (|| -> Result<_, String> {
        let src = e
            .link(&c00, kernels::fill(&g, 2.0).map_err(s)?)
            .map_err(s)?;
        e.schedule(&src).map_err(s)?;
        let c01 = e.context(0, 1).map_err(s)?;
        let same = e
            .link(&c01, kernels::fill(&g, 0.0).map_err(s)?)
            .map_err(s)?;
        e.schedule(&same).map_err(s)?;
        let c10 = e.context(1, 0).map_err(s)?;
        let other = e
            .link(&c10, kernels::fill(&g, 0.0).map_err(s)?)
            .map_err(s)?;
        e.schedule(&other).map_err(s)?;
        e.sync_all().map_err(s)?;
        Ok((src, same, other))
    })();
    match setup {
        Ok((src, same, other)) => {
            for (slot, dst) in copies.iter_mut().zip([&same, &other]) {
                *slot = time(reps, || {
                    match e
                        .device_to_device(&g, src.context(), dst.context(), MergeBufferUse::No)
                        .map_err(s)?
                    {
                        Some(ev) => ev.wait().map_err(s),
                        None => Err("a copy that moved nothing".into()),
                    }
                });
            }
            for ctx in [other.context(), same.context(), src.context()] {
                e.finalize(ctx).map_err(s)?;
            }
        }
        Err(why) => copies = [Err(why.clone()), Err(why)],
    }
    e.finalize(&c00).map_err(s)?;
    e.sync_all().map_err(s)?;
    let [same, cross] = copies;
    Ok([up, down, same, cross])
}

/// All-reduce (ring) of `bytes` over the two logical devices: bus bandwidth in GB/s.
fn tributary_allreduce(bytes: usize, reps: usize) -> Measured {
    let sys = System::builder()
        .backend(BackendKind::Cuda(CudaConfig::with_devices(2)))
        .streams(StreamConfig::OnlyDevicesParallel)
        .spawn()
        .map_err(s)?;
    let n = 2;
    let chunk = (bytes / 4).div_ceil(n);
    let result = (|| -> Measured {
        let nodes: Vec<TensorNode> = (0..n)
            .map(|c| {
                TensorNode::new(format!("chunk{c}"), DType::F32, [chunk])
                    .with_mode(MemoryMode::on_device())
            })
            .collect::<tributary::Result<_>>()
            .map_err(s)?;
        let mut contexts = Vec::new();
        for i in 0..n {
            let mut ctx = sys.context(i, 0).map_err(s)?;
            for node in &nodes {
                let r = ctx.link(kernels::fill(node, 1.0).map_err(s)?).map_err(s)?;
                r.schedule().map_err(s)?;
                ctx = r.context();
            }
            contexts.push(ctx.protocol_context().clone());
        }
        let plan = AllReducePlan::new(
            &sys,
            &nodes,
            &contexts,
            ReduceOp::Sum,
            Strategy::Ring,
            Transfer::Auto,
        )
        .map_err(s)?;
        let secs = time(reps, || {
            for ev in plan.run().map_err(s)? {
                ev.wait().map_err(s)?;
            }
            Ok(())
        })?;
        plan.finalize().map_err(s)?;
        Ok((chunk * 4 * n) as f64 / secs * 2.0 * (n as f64 - 1.0) / n as f64 / 1e9)
    })();
    sys.shutdown_within(Duration::from_secs(30)).map_err(s)?;
    result
}

fn cell(m: &Measured, f: impl Fn(f64) -> String) -> String {
    match m {
        Ok(x) => f(*x),
        Err(why) => format!("n/a ({why})"),
    }
}

fn row(
    what: &str,
    ours: &Measured,
    raw: &Measured,
    unit: impl Fn(f64) -> String,
    lower_is_better: bool,
) {
    let ratio = match (ours, raw) {
        (Ok(a), Ok(b)) if lower_is_better => format!("{:.2}x", a / b),
        (Ok(a), Ok(b)) => format!("{:.2}", a / b),
        _ => "n/a".into(),
    };
    println!(
        "| {what} | {} | {} | {ratio} |",
        cell(ours, &unit),
        cell(raw, &unit)
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    let quick = args.quick;
    let info = match probe() {
        Ok(info) => info,
        Err(e) => {
            eprintln!("cuda_bench: CUDA is unavailable here: {e}");
            return ExitCode::from(2);
        }
    };
    if args.probe {
        println!(
            "CUDA {} on {} (NVRTC {})",
            info.driver_version,
            info.devices.join(", "),
            if info.nvrtc { "found" } else { "not found" }
        );
        return ExitCode::SUCCESS;
    }
    let (reps, sizes): (usize, Vec<usize>) = if quick {
        (5, vec![1 << 20])
    } else {
        (21, vec![1 << 20, 16 << 20, 64 << 20])
    };
    println!(
        "CUDA {} on {}; tributary: 2 logical devices on GPU 0 x 2 streams; median of {reps}\n",
        info.driver_version,
        info.devices.join(", ")
    );
    let raw = match Raw::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cuda_bench: the raw cudarc side cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    let mut e = match engine() {
        Ok(e) => e,
        Err(why) => {
            eprintln!("cuda_bench: the CUDA engine cannot start: {why}");
            return ExitCode::from(1);
        }
    };
    let us = |x: f64| format!("{:.1} µs", x * 1e6);
    println!("| measurement | tributary | raw cudarc | tributary / raw |");
    println!("|---|---:|---:|---:|");
    let launch_reps = reps * 20;
    row(
        "launch overhead: tiny kernel, launch to completion",
        &tributary_launch(&mut e, launch_reps),
        &raw.launch_overhead(launch_reps),
        us,
        true,
    );
    row(
        "event wait: tiny kernel on stream A, dependent 4-byte copy on stream B",
        &tributary_event_wait(&mut e, launch_reps),
        &raw.event_wait(launch_reps),
        us,
        true,
    );
    for &bytes in &sizes {
        let mib = bytes >> 20;
        let ours = tributary_transfers(&mut e, bytes, reps);
        let theirs = raw.transfers(bytes, reps);
        let names = [
            "H2D (tributary: pageable via the staging ring; raw: pinned)",
            "D2H (tributary: via the staging ring; raw: pinned)",
            "D2D same device (cuMemcpyDtoDAsync)",
            "D2D across contexts (peer or staged; raw: cuMemcpyPeerAsync)",
        ];
        for (i, name) in names.iter().enumerate() {
            let a = match &ours {
                Ok(all) => all[i].clone(),
                Err(why) => Err(why.clone()),
            };
            let b = match &theirs {
                Ok(all) => Ok(all[i]),
                Err(why) => Err(why.clone()),
            };
            // Ratios of bandwidths: tributary's share of the raw figure.
            let bw = |m: Measured| m.map(|secs| bytes as f64 / secs / 1e9);
            row(
                &format!("{name}, {mib} MiB"),
                &bw(a),
                &bw(b),
                |x| format!("{x:.2} GB/s"),
                false,
            );
        }
        let peer = theirs
            .as_ref()
            .map(|all| bytes as f64 / all[3] / 1e9)
            .map_err(|e| e.clone());
        row(
            &format!("all-reduce bus bandwidth (ring, 2 devices; raw: peer copy), {mib} MiB"),
            &tributary_allreduce(bytes, reps.min(7)),
            &peer,
            |x| format!("{x:.2} GB/s"),
            false,
        );
    }
    ExitCode::SUCCESS
}
