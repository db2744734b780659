//! The task graph on tributary: `Engine`, `System`, and `System` over two devices.
//!
//! Column `i` is a stream; its output of timestep `t` is node `out[t % 2][i]` (16 bytes,
//! Task Bench's default), shared across the streams of its device. Each column links one
//! routine per phase (`t % Graph::phases()`, plus one for `t = 0`), so a routine always
//! reads and writes the same nodes; the timestep is the routine's index `t`, given by each
//! schedule (`schedule_with`, a `Bindings` per routine refilled every step) and snapshotted
//! into its plan. Every routine checks every input against its timestep.
//!
//! On two devices, columns are split in halves; an input produced on the other device is
//! copied (`device_to_device`, `MergeBufferUse::No`) once per timestep into a receiving
//! context on the consumer's device, where every consumer column reads it.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use tributary::{
    backend::cpu::CpuConfig,
    kernels::{Access, Bindings, RoutineSpec},
    protocol::{Context, Routine},
    Capture, DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, Result, Sharing, TensorNode,
};
use tributary_actors::{RoutineHandle, StreamConfig, System, SystemCapture};

use super::{
    graph::Graph,
    kernel::{check_input, compute_bound, output, Checks},
};

/// The two output buffers of every column.
struct Outputs {
    out: [Vec<TensorNode>; 2],
}

impl Outputs {
    fn new(width: usize) -> Result<Outputs> {
        let mode = MemoryMode::OnDevice(Sharing::SharedCrossStreams);
        let make = |p: usize| -> Result<Vec<TensorNode>> {
            (0..width)
                .map(|i| TensorNode::new(format!("out{p}_{i}"), DType::F64, [2]).with_mode(mode))
                .collect()
        };
        Ok(Outputs {
            out: [make(0)?, make(1)?],
        })
    }

    fn of(&self, t: usize, i: usize) -> &TensorNode {
        &self.out[t % 2][i]
    }
}

/// The first timestep of the routine of `phase` (`None`: `t = 0`): its inputs and output
/// are those of every timestep of the phase.
fn first_timestep(phase: Option<usize>, phases: usize) -> usize {
    match phase {
        None => 0,
        Some(0) => phases,
        Some(r) => r,
    }
}

/// The name of the routines' timestep index.
const T: &str = "t";

/// The routine of column `i` for `phase` (`None`: timestep 0), with its timestep as the
/// index `t`.
fn task_spec(
    graph: Graph,
    outputs: &Outputs,
    i: usize,
    phase: Option<usize>,
    iterations: u64,
    checks: &Arc<Checks>,
) -> Result<RoutineSpec> {
    let t0 = first_timestep(phase, graph.phases());
    let deps = graph.deps(t0, i);
    let mut params = vec![(outputs.of(t0, i).clone(), Access::Write)];
    if t0 > 0 {
        params.extend(
            deps.iter()
                .map(|&j| (outputs.of(t0 - 1, j).clone(), Access::Read)),
        );
    }
    let checks = checks.clone();
    RoutineSpec::custom(
        format!("task{i}.{}", phase.map_or(-1, |p| p as i64)),
        params,
        None,
        move |args| {
            let t = args.index(T)? as usize;
            for (k, &j) in deps.iter().enumerate() {
                check_input(
                    t,
                    i,
                    j,
                    args.input::<f64>(1 + k).map_err(|e| e.to_string())?,
                )?;
            }
            let value = compute_bound(iterations);
            args.output::<f64>(0)
                .map_err(|e| e.to_string())?
                .copy_from_slice(&output(t, i));
            checks.record(deps.len(), value);
            Ok(())
        },
    )?
    .with_index(T)
}

/// A routine with the bindings it is scheduled with, refilled every timestep.
struct Task<R> {
    routine: R,
    bindings: Bindings,
}

impl<R> Task<R> {
    fn new(routine: R, of: &Routine) -> Task<R> {
        Task {
            bindings: of.bindings(),
            routine,
        }
    }

    /// Sets the timestep to `t`.
    fn at(&mut self, t: usize) -> Result<()> {
        self.bindings.set(T, t as i64)?;
        Ok(())
    }
}

/// The phase of timestep `t`.
fn phase_of(graph: &Graph, t: usize) -> Option<usize> {
    (t > 0).then(|| t % graph.phases())
}

/// Index of a phase in a column's routine list (timestep 0 first).
fn slot(phase: Option<usize>) -> usize {
    phase.map_or(0, |p| p + 1)
}

fn phases_with_first(graph: &Graph) -> impl Iterator<Item = Option<usize>> {
    std::iter::once(None).chain((0..graph.phases()).map(Some))
}

/// An engine on one CPU device with one stream per column, and every column's routines
/// (one per phase, timestep 0 first).
fn engine_columns(
    graph: Graph,
    iterations: u64,
    cpu: &CpuConfig,
    checks: &Arc<Checks>,
) -> Result<(Engine, Vec<Vec<Task<Routine>>>)> {
    let mut e = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: graph.width,
        cpu: cpu.clone(),
        ..EngineConfig::default()
    })?;
    let outputs = Outputs::new(graph.width)?;
    let mut routines = Vec::new();
    for i in 0..graph.width {
        let ctx = e.context(0, i)?;
        let mut column = Vec::new();
        for phase in phases_with_first(&graph) {
            let spec = task_spec(graph, &outputs, i, phase, iterations, checks)?;
            let routine = e.link(&ctx, spec)?;
            column.push(Task::new(routine.clone(), &routine));
        }
        routines.push(column);
    }
    Ok((e, routines))
}

/// `Engine` on one CPU device, one stream per column. Returns the wall time of the run.
pub fn engine(
    graph: Graph,
    iterations: u64,
    cpu: &CpuConfig,
    checks: &Arc<Checks>,
) -> Result<Duration> {
    let (mut e, mut routines) = engine_columns(graph, iterations, cpu, checks)?;
    let start = Instant::now();
    for t in 0..graph.steps {
        engine_timestep(&graph, &mut e, &mut routines, t)?;
    }
    e.sync_all()?;
    Ok(start.elapsed())
}

/// Issues timestep `t`'s tasks of the `Engine`'s columns into `calls` (the engine, or a
/// step being captured on it).
fn engine_timestep(
    graph: &Graph,
    calls: &mut dyn Calls,
    routines: &mut [Vec<Task<Routine>>],
    t: usize,
) -> Result<()> {
    let s = slot(phase_of(graph, t));
    for column in routines {
        let task = &mut column[s];
        task.at(t)?;
        calls.schedule(&task.routine, &task.bindings)?;
    }
    Ok(())
}

/// `Engine` as [`engine`], but every period of timesteps after the first is a replay of a
/// captured step (issue 18, step capture and replay): timestep 0 is issued, timesteps
/// `1..=phases` are captured (issued for real while recorded), and each later full period
/// replays the step with every schedule's `t` shifted by the period; the timesteps left
/// over are issued. Every task still checks its inputs against its timestep.
pub fn engine_replay(
    graph: Graph,
    iterations: u64,
    cpu: &CpuConfig,
    checks: &Arc<Checks>,
) -> Result<Duration> {
    let (mut e, mut routines) = engine_columns(graph, iterations, cpu, checks)?;
    let period = graph.capture_period();
    let start = Instant::now();
    let mut t = 0;
    if graph.steps > 0 {
        engine_timestep(&graph, &mut e, &mut routines, 0)?;
        t = 1;
    }
    if graph.steps > 2 * period {
        let step = e.capture(|c| {
            for t in 1..=period {
                engine_timestep(&graph, c, &mut routines, t)?;
            }
            Ok(())
        })?;
        t = 1 + period;
        let mut values = step.bindings();
        while t + period <= graph.steps {
            values.shift(T, period as i64)?;
            e.replay_with(&step, &values)?;
            t += period;
        }
    }
    while t < graph.steps {
        engine_timestep(&graph, &mut e, &mut routines, t)?;
        t += 1;
    }
    e.sync_all()?;
    Ok(start.elapsed())
}

/// How the `System` runner issues its timesteps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Issue {
    /// Every call, as a plain call.
    Calls,
    /// Periods after the first replayed from a captured step (`System::replay_with`).
    Replay,
    /// Every call, as a plain call, to a system with its automatic replay on.
    Auto,
}

/// `System` on `devices` CPU devices (columns split evenly), one stream per column; with
/// `Issue::Replay`, every period of timesteps after the first is a replay of a captured step
/// (`System::replay_with`), its cross-device copies included, as [`engine_replay`] does;
/// with `Issue::Auto`, plain calls the system recognises and replays by itself.
pub fn system(
    graph: Graph,
    devices: usize,
    iterations: u64,
    cpu: &CpuConfig,
    checks: &Arc<Checks>,
    issue: Issue,
) -> Result<Duration> {
    let per_device = graph.width.div_ceil(devices);
    let device_of = |i: usize| i / per_device;
    let sys = System::builder()
        .cpu_devices(devices)
        .streams(StreamConfig::MostParallelStreams(per_device))
        .cpu(cpu.clone())
        .auto_replay(issue == Issue::Auto)
        .spawn()?;
    let outputs = Outputs::new(graph.width)?;
    let mut routines: Vec<Vec<Task<RoutineHandle>>> = Vec::new();
    for i in 0..graph.width {
        let ctx = sys.device(device_of(i)).stream(i % per_device).context()?;
        let mut column = Vec::new();
        for phase in phases_with_first(&graph) {
            let handle = ctx.link(task_spec(graph, &outputs, i, phase, iterations, checks)?)?;
            let routine = handle.routine().clone();
            column.push(Task::new(handle, &routine));
        }
        routines.push(column);
    }
    // On every device, a receiving context (on the device's first stream) for each column
    // of another device: copies land there, every consumer on the device reads them.
    let mut receivers = BTreeMap::new();
    if devices > 1 {
        for d in 0..devices {
            let ctx = sys.device(d).stream(0).context()?;
            for j in (0..graph.width).filter(|&j| device_of(j) != d) {
                let params = vec![
                    (outputs.out[0][j].clone(), Access::Read),
                    (outputs.out[1][j].clone(), Access::Read),
                ];
                let holder = RoutineSpec::custom(format!("halo{j}@{d}"), params, None, |_| Ok(()))?;
                receivers.insert((d, j), ctx.link(holder)?.context());
            }
        }
    }
    // Timestep `t`'s calls: the copies of its remote inputs, then its tasks.
    let mut timestep = |t: usize, calls: &mut dyn Calls| -> Result<()> {
        let s = slot(phase_of(&graph, t));
        if t > 0 && devices > 1 {
            let prev = slot(phase_of(&graph, t - 1));
            for d in 0..devices {
                let mut remote: Vec<usize> = (0..graph.width)
                    .filter(|&i| device_of(i) == d)
                    .flat_map(|i| graph.deps(t, i))
                    .filter(|&j| device_of(j) != d)
                    .collect();
                remote.sort_unstable();
                remote.dedup();
                for j in remote {
                    let src = routines[j][prev].routine.context();
                    calls.copy(outputs.of(t - 1, j), &src, &receivers[&(d, j)])?;
                }
            }
        }
        for column in &mut routines {
            let task = &mut column[s];
            task.at(t)?;
            calls.schedule(task.routine.routine(), &task.bindings)?;
        }
        Ok(())
    };
    let period = graph.capture_period();
    let start = Instant::now();
    let mut t = 0;
    if issue == Issue::Replay && graph.steps > 2 * period {
        timestep(0, &mut &sys)?;
        let step = sys.capture(|c| {
            for t in 1..=period {
                timestep(t, c)?;
            }
            Ok(())
        })?;
        t = 1 + period;
        let mut values = step.bindings();
        while t + period <= graph.steps {
            values.shift(T, period as i64)?;
            sys.replay_with(&step, &values)?;
            t += period;
        }
    }
    while t < graph.steps {
        timestep(t, &mut &sys)?;
        t += 1;
    }
    sys.sync()?;
    let took = start.elapsed();
    sys.shutdown()?;
    Ok(took)
}

/// Where a timestep's calls go: the `Engine` or the `System`, or a step being captured on
/// either.
pub(super) trait Calls {
    fn copy(&mut self, node: &TensorNode, src: &Context, dst: &Context) -> Result<()>;
    fn schedule(&mut self, routine: &Routine, bindings: &Bindings) -> Result<()>;
}

/// `Calls` for types whose `device_to_device` and `schedule_with` take the same arguments
/// (what they return is dropped).
macro_rules! calls {
    ($($t:ty),*) => {$(
        impl Calls for $t {
            fn copy(&mut self, node: &TensorNode, src: &Context, dst: &Context) -> Result<()> {
                self.device_to_device(node, src, dst, MergeBufferUse::No)?;
                Ok(())
            }

            fn schedule(&mut self, routine: &Routine, bindings: &Bindings) -> Result<()> {
                self.schedule_with(routine, bindings)?;
                Ok(())
            }
        }
    )*};
}

calls!(Engine, Capture<'_>, &System, SystemCapture<'_>);
