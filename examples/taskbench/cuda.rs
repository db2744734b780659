//! Task Bench on one CUDA GPU (feature `cuda`): the same graphs, Task Bench's
//! `compute_bound` kernel as a CUDA kernel (one block of 64 threads, a lane each), run by
//! hand-written cudarc streams and by `System` with one CUDA device and one stream per
//! column, issuing and replaying a captured period.
//!
//! The hand-written side is what a careful CUDA engineer writes: the module compiled and
//! every stream, event and buffer made once, outside the timed region; one stream per
//! column; one event per column and timestep parity (recorded after each task); each task
//! waits only on the events of the tasks it reads and of the tasks that read the buffer it
//! overwrites (the write-after-read a runtime infers), and launches with no per-launch
//! allocation (cudarc's event tracking is off).
//!
//! Every task checks its inputs on the GPU (input `k` must be `(t - 1, j_k)`) and writes
//! `(-1, -1)` instead of `(t, i)` when one is wrong, so a wrong input poisons every task
//! that depends on it; each run reads the last timestep back and fails on any poison.
//! Granularity is `wall × width ÷ tasks` (a column's stream is a "core").

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use cudarc::{
    driver::{
        CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig,
        PushKernelArg,
    },
    nvrtc::{compile_ptx_with_opts, CompileOptions},
};
use tributary::{
    backend::{cuda::CudaConfig, BackendKind},
    kernels::{Access, Bindings, CudaKernel, CudaScalar, RoutineSpec},
    DType, MemoryMode, Sharing, TensorNode,
};
use tributary_actors::{RoutineHandle, StreamConfig, System};

use super::{graph::Graph, runners::Calls};

/// Threads of a task's block: Task Bench's 64 lanes, one each.
const LANES: u32 = 64;

/// The index carrying a routine's timestep.
const T: &str = "t";

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The kernels: `task{k}` reads `k` inputs. Parameters (the order `CudaKernel` passes):
/// the output, the `k` inputs, then the scalars `iterations`, `i`, `j_0 .. j_{k-1}`, then
/// the timestep `t` (the routine's index).
fn source(max_inputs: usize) -> String {
    let mut src = String::from(
        r#"
__device__ double compute_bound(unsigned long long iterations) {
    double a = 1.2345 + 0.0 * threadIdx.x;
    for (unsigned long long n = 0; n < iterations; ++n) a = a * a + a;
    return a;
}
__device__ bool expected(const double* in, unsigned int t, unsigned int j) {
    return in[0] == (double)(t - 1) && in[1] == (double)j;
}
"#,
    );
    for k in 0..=max_inputs {
        let inputs: String = (0..k).map(|n| format!(", const double* in{n}")).collect();
        let columns: String = (0..k).map(|n| format!(", unsigned int j{n}")).collect();
        let checks: String = (0..k)
            .map(|n| format!(" && expected(in{n}, t, j{n})"))
            .collect();
        src.push_str(&format!(
            r#"
extern "C" __global__ void task{k}(double* out{inputs}, unsigned long long iterations,
                                   unsigned int i{columns}, unsigned int t) {{
    bool good = true{checks};
    double a = compute_bound(iterations);
    if (a == 0.5) good = false;  /* never: keeps the loop */
    __syncthreads();
    if (threadIdx.x == 0) {{
        out[0] = good ? (double)t : -1.0;
        out[1] = good ? (double)i : -1.0;
    }}
}}
"#
        ));
    }
    src
}

/// The most inputs any task of `graph` reads.
fn max_inputs(graph: &Graph) -> usize {
    (1..=graph.dependence_sets() + 1)
        .flat_map(|t| (0..graph.width).map(move |i| graph.deps(t, i).len()))
        .max()
        .unwrap_or(0)
}

/// Checks the last timestep's outputs (`values[i]` of column `i`).
fn check_last(graph: &Graph, values: &[Vec<f64>]) -> Result<(), String> {
    let t = graph.steps - 1;
    for (i, v) in values.iter().enumerate() {
        if v.as_slice() != [t as f64, i as f64] {
            return Err(format!(
                "column {i} ended with {v:?}, expected [{t}, {i}] (a task read a wrong input)"
            ));
        }
    }
    Ok(())
}

/// The hand-written side's state, made once: the context, the compiled kernels, and
/// streams, events and buffers for up to `max_width` columns.
pub struct RawGpu {
    ctx: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    tasks: Vec<CudaFunction>,
    streams: Vec<Arc<CudaStream>>,
    /// `events[p][i]`: column `i`'s last task of a timestep of parity `p`.
    events: [Vec<CudaEvent>; 2],
    /// `out[p][i]`: column `i`'s output of timesteps of parity `p`.
    out: [Vec<CudaSlice<f64>>; 2],
}

impl RawGpu {
    pub fn new(max_width: usize, max_inputs: usize) -> Result<RawGpu, String> {
        let ctx = CudaContext::new(0).map_err(s)?;
        // SAFETY: the runner orders every use of every buffer across streams with events
        // (the waits described in the module doc), allocates and frees only outside the
        // timed runs after a context-wide synchronize.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(s)?;
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let ptx = compile_ptx_with_opts(
            source(max_inputs),
            CompileOptions {
                arch: Some(arch),
                ..Default::default()
            },
        )
        .map_err(s)?;
        let module = ctx.load_module(ptx).map_err(s)?;
        let tasks = (0..=max_inputs)
            .map(|k| module.load_function(&format!("task{k}")).map_err(s))
            .collect::<Result<Vec<_>, _>>()?;
        let streams = (0..max_width)
            .map(|_| ctx.new_stream().map_err(s))
            .collect::<Result<Vec<_>, _>>()?;
        let events = |_| {
            (0..max_width)
                .map(|_| ctx.new_event(None).map_err(s))
                .collect::<Result<Vec<_>, _>>()
        };
        let out = |_| {
            (0..max_width)
                .map(|i| streams[i].alloc_zeros::<f64>(2).map_err(s))
                .collect::<Result<Vec<_>, _>>()
        };
        let events = [events(0)?, events(1)?];
        let out = [out(0)?, out(1)?];
        ctx.synchronize().map_err(s)?;
        Ok(RawGpu {
            ctx,
            _module: module,
            tasks,
            streams,
            events,
            out,
        })
    }

    /// Runs `graph`; returns the wall time from the first launch to the last task done.
    pub fn run(&self, graph: Graph, iterations: u64) -> Result<Duration, String> {
        let w = graph.width;
        if w > self.streams.len() {
            return Err(format!("width {w} > {} streams made", self.streams.len()));
        }
        // The waits of each task, per phase: the events (of timestep t - 1) of the tasks it
        // reads and of the tasks that read what it overwrites (t - 2's output, read at
        // t - 1), precomputed like the dependence lists of the CPU threads.
        let phases = graph.phases();
        let waits: Vec<Vec<Vec<usize>>> = (0..phases + 2)
            .map(|t| {
                (0..w)
                    .map(|i| {
                        let mut v = graph.deps(t, i);
                        if t >= 2 {
                            v.extend(graph.consumers(t - 2, i));
                        }
                        v.retain(|&j| j != i);
                        v.sort_unstable();
                        v.dedup();
                        v
                    })
                    .collect()
            })
            .collect();
        let deps: Vec<Vec<Vec<u32>>> = (0..phases + 2)
            .map(|t| {
                (0..w)
                    .map(|i| graph.deps(t, i).iter().map(|&j| j as u32).collect())
                    .collect()
            })
            .collect();
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (LANES, 1, 1),
            shared_mem_bytes: 0,
        };
        self.ctx.synchronize().map_err(s)?;
        let start = Instant::now();
        for t in 0..graph.steps {
            // Timestep t uses the lists of a timestep of the same phase (t itself below 2).
            let tp = if t < 2 { t } else { 2 + (t - 2) % phases };
            let (p, q) = (t % 2, (t + 1) % 2);
            let t32 = t as u32;
            for i in 0..w {
                let stream = &self.streams[i];
                for &j in &waits[tp][i] {
                    stream.wait(&self.events[q][j]).map_err(s)?;
                }
                let js = &deps[tp][i];
                let i32_ = i as u32;
                let mut launch = stream.launch_builder(&self.tasks[js.len()]);
                launch.arg(&self.out[p][i]);
                for &j in js {
                    launch.arg(&self.out[q][j as usize]);
                }
                launch.arg(&iterations).arg(&i32_);
                for j in js {
                    launch.arg(j);
                }
                launch.arg(&t32);
                // SAFETY: `task{k}` takes an output, `k` inputs (live device buffers of 2
                // doubles), a u64, `k + 2` u32s, as pushed; the waits above order this
                // task after the writers of its inputs and the readers of its output.
                unsafe { launch.launch(cfg) }.map_err(s)?;
                self.events[p][i].record(stream).map_err(s)?;
            }
        }
        for stream in &self.streams[..w] {
            stream.synchronize().map_err(s)?;
        }
        let wall = start.elapsed();
        let last = (graph.steps - 1) % 2;
        let values = (0..w)
            .map(|i| self.streams[i].clone_dtoh(&self.out[last][i]).map_err(s))
            .collect::<Result<Vec<_>, _>>()?;
        check_last(&graph, &values)?;
        Ok(wall)
    }
}

/// One task's kernel time at `iterations`, measured on the hand-written side (one task,
/// launch to completion, minus the same for 1 iteration).
pub fn kernel_seconds(raw: &RawGpu, iterations: u64) -> Result<f64, String> {
    let graph = |steps| Graph {
        pattern: super::graph::Pattern::NoComm,
        width: 1,
        steps,
        radix: 1,
        period: 1,
    };
    let time = |iters| -> Result<f64, String> {
        raw.run(graph(64), iters)?;
        let mut v = (0..5)
            .map(|_| raw.run(graph(64), iters).map(|d| d.as_secs_f64() / 64.0))
            .collect::<Result<Vec<_>, _>>()?;
        v.sort_by(f64::total_cmp);
        Ok(v[2])
    };
    Ok((time(iterations)? - time(1)?).max(1e-9))
}

/// `System` on one CUDA device, one stream per column, issuing or (with `replay`)
/// replaying a captured period as the CPU runners do. Every System is spawned anew; its
/// kernels are compiled (NVRTC) and loaded by a warm-up timestep 0 before the clock starts.
pub fn system(graph: Graph, iterations: u64, replay: bool) -> Result<Duration, String> {
    let sys = System::builder()
        .backend(BackendKind::Cuda(CudaConfig::with_devices(1)))
        .streams(StreamConfig::MostParallelStreams(graph.width))
        .spawn()
        .map_err(s)?;
    let result = system_on(&sys, graph, iterations, replay);
    sys.shutdown_within(Duration::from_secs(30)).map_err(s)?;
    result
}

struct Task {
    routine: RoutineHandle,
    bindings: Bindings,
}

fn system_on(
    sys: &System,
    graph: Graph,
    iterations: u64,
    replay: bool,
) -> Result<Duration, String> {
    let w = graph.width;
    let src: Arc<str> = source(max_inputs(&graph)).into();
    let mode = MemoryMode::OnDevice(Sharing::SharedCrossStreams);
    let make = |p: usize| {
        (0..w)
            .map(|i| TensorNode::new(format!("out{p}_{i}"), DType::F64, [2]).with_mode(mode))
            .collect::<tributary::Result<Vec<_>>>()
            .map_err(s)
    };
    let out = [make(0)?, make(1)?];
    let phases = graph.phases();
    // Column i's routines: timestep 0, then one per phase (timesteps 1..=phases).
    let mut columns: Vec<Vec<Task>> = Vec::with_capacity(w);
    for i in 0..w {
        let ctx = sys.device(0).stream(i).context().map_err(s)?;
        let mut column = Vec::new();
        for t0 in 0..=phases {
            let js = graph.deps(t0, i);
            let mut params = vec![(out[t0 % 2][i].clone(), Access::Write)];
            params.extend(
                js.iter()
                    .map(|&j| (out[(t0 + 1) % 2][j].clone(), Access::Read)),
            );
            let mut scalars = vec![CudaScalar::U64(iterations), CudaScalar::U32(i as u32)];
            scalars.extend(js.iter().map(|&j| CudaScalar::U32(j as u32)));
            let kernel = CudaKernel::cuda_c(
                src.clone(),
                format!("task{}", js.len()),
                [1, 1, 1],
                [LANES, 1, 1],
            )
            .with_scalars(scalars);
            let spec = RoutineSpec::cuda(format!("task{i}.{t0}"), params, None, kernel)
                .and_then(|spec| spec.with_index(T))
                .map_err(s)?;
            let routine = ctx.link(spec).map_err(s)?;
            let bindings = routine.routine().bindings();
            column.push(Task { routine, bindings });
        }
        columns.push(column);
    }
    let slot = |t: usize| if t == 0 { 0 } else { 1 + (t - 1) % phases };
    let mut timestep = |t: usize, calls: &mut dyn Calls| -> tributary::Result<()> {
        for column in columns.iter_mut() {
            let task = &mut column[slot(t)];
            task.bindings.set(T, t as i64)?;
            calls.schedule(task.routine.routine(), &task.bindings)?;
        }
        Ok(())
    };
    // Warm-up: compiles and loads the kernels.
    timestep(0, &mut &*sys).map_err(s)?;
    sys.sync().map_err(s)?;
    let start = Instant::now();
    let mut t = 0;
    let period = graph.capture_period();
    if replay && graph.steps > 2 * period {
        timestep(0, &mut &*sys).map_err(s)?;
        let step = sys
            .capture(|c| {
                for t in 1..=period {
                    timestep(t, c)?;
                }
                Ok(())
            })
            .map_err(s)?;
        t = 1 + period;
        let mut values = step.bindings();
        while t + period <= graph.steps {
            values.shift(T, period as i64).map_err(s)?;
            sys.replay_with(&step, &values).map_err(s)?;
            t += period;
        }
    }
    while t < graph.steps {
        timestep(t, &mut &*sys).map_err(s)?;
        t += 1;
    }
    sys.sync().map_err(s)?;
    let wall = start.elapsed();
    let last = graph.steps - 1;
    let values = columns
        .iter()
        .enumerate()
        .map(|(i, column)| {
            column[slot(last)]
                .routine
                .context()
                .read::<f64>(&out[last % 2][i])
                .map_err(s)
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_last(&graph, &values)?;
    Ok(wall)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated source declares one kernel per input count with the parameters the
    /// CUDA backend passes (compiled by NVRTC only on a machine with CUDA).
    #[test]
    fn the_source_has_a_kernel_per_input_count() {
        let src = source(3);
        for k in 0..=3 {
            assert!(src.contains(&format!("void task{k}(")), "{src}");
        }
        assert!(src.contains("const double* in2, unsigned long long iterations"));
        assert!(src.contains("unsigned int j2, unsigned int t)"));
        assert!(!src.contains("task4"));
    }

    /// The kernels compile with NVRTC for `compute_90` (where NVRTC is installed; CI
    /// requires it with `TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1`), so a broken source is
    /// caught without a GPU.
    #[test]
    fn the_kernels_compile_with_nvrtc() {
        use tributary::backend::cuda::kernels::nvrtc;
        if let Err(why) = nvrtc::nvrtc_available() {
            assert!(
                std::env::var("TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK").as_deref() != Ok("1"),
                "NVRTC is required here: {why}"
            );
            println!("skipping CUDA kernel check (taskbench): {why}");
            return;
        }
        let ptx = nvrtc::compile_to_ptx(&source(8), "taskbench.cu", "compute_90", &[])
            .unwrap_or_else(|e| panic!("{e}"));
        for k in 0..=8 {
            assert!(ptx.contains(&format!(".entry task{k}(")), "task{k} missing");
        }
    }
}
