//! Programs: sequences of public operations, run on a real system and on the reference.
//!
//! A [`Program`] names its nodes, contexts and routines by handles ([`N`], [`C`], [`R`])
//! instead of live objects, so that the same program runs on any [`ProgramRunner`] (the
//! engine now, the actor `System` later) and on the sequential reference, and prints
//! readably when a run disagrees with the reference.
//!
//! Handles are numbered in creation order: every successful `Root`, `Link` and
//! `InitFromHost` creates the next context `c0, c1, ...`; every successful `Link` creates
//! the next routine `r0, r1, ...` (whose context is the context the link created).

use std::fmt;

/// Element type of a node (the reliability programs use exact-comparison dtypes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dt {
    /// `f32`, compared bitwise.
    F32,
    /// `i32`.
    I32,
}

/// Sharing among the streams of a device, as declared by a node's memory mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Share {
    /// Decided by the first link on each device (read first: shared; written first: not).
    Unset,
    /// One buffer per stream (context chain).
    PerStream,
    /// One buffer per device.
    Shared,
}

/// Memory mode of a node (the final modes a program can declare).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `MemoryMode::OnDevice(sharing)`.
    OnDevice(Share),
    /// `MemoryMode::Hosted(HostedKind::ChangedOnDevices(sharing))`.
    Hosted(Share),
    /// `MemoryMode::Hosted(HostedKind::Constant)`: only written by the host, when
    /// initialising.
    Constant,
    /// `MemoryMode::Hosted(HostedKind::Volatile)`: only written by the host.
    Volatile,
}

impl Mode {
    /// Whether the node has a host array.
    pub fn is_hosted(self) -> bool {
        !matches!(self, Mode::OnDevice(_))
    }

    /// Whether programs may write the node on devices (routines, copies).
    pub fn device_writable(self) -> bool {
        matches!(self, Mode::OnDevice(_) | Mode::Hosted(_))
    }

    /// Whether programs may write the host array (`host_write`).
    pub fn host_writable(self) -> bool {
        matches!(self, Mode::Hosted(_) | Mode::Volatile)
    }

    /// The sharing the mode itself fixes (constants and volatiles are always shared).
    pub fn declared_sharing(self) -> Share {
        match self {
            Mode::OnDevice(s) | Mode::Hosted(s) => s,
            Mode::Constant | Mode::Volatile => Share::Shared,
        }
    }

    /// The engine's memory mode.
    pub fn memory_mode(self) -> tributary::MemoryMode {
        use tributary::{HostedKind, MemoryMode, Sharing};
        let sharing = |s| match s {
            Share::Unset => Sharing::Unset,
            Share::PerStream => Sharing::PerStream,
            Share::Shared => Sharing::SharedCrossStreams,
        };
        match self {
            Mode::OnDevice(s) => MemoryMode::OnDevice(sharing(s)),
            Mode::Hosted(s) => MemoryMode::Hosted(HostedKind::ChangedOnDevices(sharing(s))),
            Mode::Constant => MemoryMode::Hosted(HostedKind::Constant),
            Mode::Volatile => MemoryMode::Hosted(HostedKind::Volatile),
        }
    }
}

/// A node of a program.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeDecl {
    /// Element type.
    pub dtype: Dt,
    /// Shape.
    pub dims: Vec<usize>,
    /// Memory mode.
    pub mode: Mode,
    /// Declared zero-initialised (`TensorNode::new_zeroed`): fresh buffers may be read.
    /// Otherwise reading a buffer nothing wrote is `UninitialisedRead`.
    pub zeroed: bool,
}

impl NodeDecl {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.numel() as u64 * 4
    }
}

/// What a program runs on: devices, streams per device, and its nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct Setup {
    /// Number of devices.
    pub devices: usize,
    /// Streams per device.
    pub streams: usize,
    /// The nodes, by handle `n0, n1, ...`.
    pub nodes: Vec<NodeDecl>,
    /// Size of a general memory pool, for runners that have pools (the reference has no
    /// pools). Small pools make programs spread over several pools and dedicated ones.
    pub pool_bytes: u64,
}

/// A node handle (index into [`Setup::nodes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct N(pub usize);

/// A context handle (creation order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct C(pub usize);

/// A routine handle (creation order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct R(pub usize);

/// How a kernel uses a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acc {
    /// Read only.
    Read,
    /// Written only (every element).
    Write,
    /// Read, then written.
    ReadWrite,
}

/// The built-in kernels programs use (their documented formulas are exact per element).
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// `dst[i] = value` (rounded to the dtype).
    Fill { dst: N, value: f64 },
    /// `dst = src`, bitwise.
    Copy { dst: N, src: N },
    /// `dst[i] = dst[i] + src[i]`.
    AddInto { dst: N, src: N },
    /// `dst[i] = dst[i] + merge[i]`, the merge buffer holding `dst` from another context.
    AddMerge { dst: N },
    /// `dst[i] = alpha * src[i]` (f32).
    Scale { dst: N, src: N, alpha: f64 },
    /// `y[i] = y[i] + alpha * x[i]`, two roundings (f32).
    Axpy { y: N, x: N, alpha: f64 },
    /// `c = a b`, summed in increasing inner index from 0 (f32).
    Matmul { c: N, a: N, b: N },
    /// `dst[j] = Σ_i src[i, j]`, summed in increasing `i` from 0 (f32).
    SumRows { dst: N, src: N },
    /// `dst[i] = t` (converted to the dtype), where `t` is the routine's index
    /// [`Kernel::INDEX`] of type `i32`, given by each schedule ([`Op::ScheduleWith`]): a
    /// user kernel (a closure, WGSL or CUDA C), the only one whose effect depends on a
    /// per-schedule binding.
    FillIndex { dst: N },
}

impl Kernel {
    /// Parameters in argument order, with their access.
    pub fn params(&self) -> Vec<(N, Acc)> {
        use Acc::*;
        match *self {
            Kernel::Fill { dst, .. } => vec![(dst, Write)],
            Kernel::Copy { dst, src } => vec![(dst, Write), (src, Read)],
            Kernel::AddInto { dst, src } => vec![(dst, ReadWrite), (src, Read)],
            Kernel::AddMerge { dst } => vec![(dst, ReadWrite)],
            Kernel::Scale { dst, src, .. } => vec![(dst, Write), (src, Read)],
            Kernel::Axpy { y, x, .. } => vec![(y, ReadWrite), (x, Read)],
            Kernel::Matmul { c, a, b } => vec![(c, Write), (a, Read), (b, Read)],
            Kernel::SumRows { dst, src } => vec![(dst, Write), (src, Read)],
            Kernel::FillIndex { dst } => vec![(dst, Write)],
        }
    }

    /// The name of [`Kernel::FillIndex`]'s index.
    pub const INDEX: &'static str = "t";

    /// The index the kernel declares, if any (of type `i32`).
    pub fn index(&self) -> Option<&'static str> {
        matches!(self, Kernel::FillIndex { .. }).then_some(Kernel::INDEX)
    }

    /// The node expected in the merge buffer.
    pub fn merge(&self) -> Option<N> {
        match *self {
            Kernel::AddMerge { dst } => Some(dst),
            _ => None,
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kernel::Fill { dst, value } => write!(f, "fill(n{}, {value})", dst.0),
            Kernel::Copy { dst, src } => write!(f, "copy(n{}, n{})", dst.0, src.0),
            Kernel::AddInto { dst, src } => write!(f, "add_into(n{}, n{})", dst.0, src.0),
            Kernel::AddMerge { dst } => write!(f, "add_merge(n{})", dst.0),
            Kernel::Scale { dst, src, alpha } => {
                write!(f, "scale(n{}, n{}, {alpha})", dst.0, src.0)
            }
            Kernel::Axpy { y, x, alpha } => write!(f, "axpy(n{}, n{}, {alpha})", y.0, x.0),
            Kernel::Matmul { c, a, b } => write!(f, "matmul(n{}, n{}, n{})", c.0, a.0, b.0),
            Kernel::SumRows { dst, src } => write!(f, "sum_rows(n{}, n{})", dst.0, src.0),
            Kernel::FillIndex { dst } => write!(f, "fill_index(n{})", dst.0),
        }
    }
}

/// Host data written by a program: element `i` of pattern `seed` (see [`Data::value`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Data {
    /// Small integers in `-8..=8`, exact in `f32`.
    Ints(u32),
    /// Fractions `k / 1024 - 1/2`-ish that make float sums depend on their order.
    Fractions(u32),
}

impl Data {
    /// Element `i`, as an `f64` to be converted to the node's dtype.
    pub fn value(self, i: usize) -> f64 {
        match self {
            Data::Ints(seed) => ((seed as u64 + 7 * i as u64) % 17) as f64 - 8.0,
            Data::Fractions(seed) => {
                let k = (seed as u64).wrapping_mul(2_654_435_761) ^ (i as u64 * 40_503);
                (k % 2053) as f64 / 1021.0 - 1.0
            }
        }
    }

    /// The `f32` values for `n` elements.
    pub fn f32s(self, n: usize) -> Vec<f32> {
        (0..n).map(|i| self.value(i) as f32).collect()
    }

    /// The `i32` values for `n` elements.
    pub fn i32s(self, n: usize) -> Vec<i32> {
        (0..n).map(|i| self.value(i) as i32).collect()
    }
}

impl fmt::Display for Data {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Data::Ints(s) => write!(f, "ints#{s}"),
            Data::Fractions(s) => write!(f, "fractions#{s}"),
        }
    }
}

/// How `DeviceToDevice` delivers the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum D2d {
    /// Into the node's own buffer in the destination context.
    No,
    /// Into the destination stream's merge buffer.
    Copy,
    /// Scheduling the routine (linked on the destination stream) reading the source in place.
    StreamingFor(R),
}

/// One operation of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A new root context on a stream (creates a context).
    Root { device: usize, stream: usize },
    /// Links a kernel into a context (creates a routine and its context).
    Link { ctx: C, kernel: Kernel },
    /// Schedules a routine.
    Schedule { routine: R },
    /// Schedules a routine with the value `t` for its index [`Kernel::INDEX`].
    ScheduleWith { routine: R, t: i64 },
    /// Writes the host array, then adds the node to a child of `ctx` (creates a context).
    InitFromHost { ctx: C, node: N, data: Data },
    /// Uploads the host array into the node's buffer in `ctx`.
    FromHost { ctx: C, node: N },
    /// Downloads the node's buffer in `ctx` into the host array.
    ToHost { ctx: C, node: N },
    /// Moves a node between contexts.
    DeviceToDevice { node: N, src: C, dst: C, mode: D2d },
    /// Reads the host value of a hosted node (observed).
    HostRead { node: N },
    /// Writes the host array of a hosted node.
    HostWrite { node: N, data: Data },
    /// Reads the node's buffer in `ctx` (observed).
    Read { ctx: C, node: N },
    /// Finalizes a context.
    Finalize { ctx: C },
    /// Waits (with a timeout) for all work; a failure is an error.
    Sync,
    /// Observes everything: every node of every live context (creation order, node order),
    /// then the host value of every hosted node (node order).
    Checkpoint,
    /// A captured step: `ops` (schedules and device-to-device copies only) issued once
    /// while captured, then the captured step replayed `replays` times. Means the same as
    /// issuing `ops` `1 + replays` times, stopping at the first refused operation.
    Step { ops: Vec<Op>, replays: u32 },
    /// Finalizes every live context (newest first), waits for all work and observes
    /// memory and table sizes.
    Teardown,
}

/// A program: a setup and its operations.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    /// Devices, streams and nodes.
    pub setup: Setup,
    /// The operations, in program order.
    pub ops: Vec<Op>,
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_marked(f, None)
    }
}

impl Program {
    /// Writes the program, one operation a line, marking operation `mark` with `>>`.
    pub fn write_marked(&self, f: &mut dyn fmt::Write, mark: Option<usize>) -> fmt::Result {
        let s = &self.setup;
        writeln!(
            f,
            "program on {} device(s) x {} stream(s), pools of {} bytes, {} ops",
            s.devices,
            s.streams,
            s.pool_bytes,
            self.ops.len()
        )?;
        for (i, n) in s.nodes.iter().enumerate() {
            writeln!(f, "  n{i}: {:?} {:?} {:?}", n.dtype, n.dims, n.mode)?;
        }
        let (mut ctxs, mut routines) = (0usize, 0usize);
        for (i, op) in self.ops.iter().enumerate() {
            let m = if mark == Some(i) { ">>" } else { "  " };
            write!(f, "{m}{i:4}: ")?;
            write_op(f, op, &mut ctxs, &mut routines)?;
        }
        Ok(())
    }

    /// The program as text with operation `mark` marked.
    pub fn marked(&self, mark: Option<usize>) -> String {
        let mut s = String::new();
        let _ = self.write_marked(&mut s, mark);
        s
    }
}

/// Writes one operation and its newline (`ctxs`, `routines`: handles created so far).
fn write_op(
    f: &mut dyn fmt::Write,
    op: &Op,
    ctxs: &mut usize,
    routines: &mut usize,
) -> fmt::Result {
    {
        {
            match op {
                Op::Root { device, stream } => {
                    writeln!(f, "c{ctxs} = root(d{device}, s{stream})")?;
                    *ctxs += 1;
                }
                Op::Link { ctx, kernel } => {
                    writeln!(f, "r{routines}, c{ctxs} = link(c{}, {kernel})", ctx.0)?;
                    *ctxs += 1;
                    *routines += 1;
                }
                Op::Schedule { routine } => writeln!(f, "schedule(r{})", routine.0)?,
                Op::ScheduleWith { routine, t } => {
                    writeln!(f, "schedule_with(r{}, t = {t})", routine.0)?
                }
                Op::InitFromHost { ctx, node, data } => {
                    writeln!(
                        f,
                        "c{ctxs} = init_from_host(c{}, n{}, {data})",
                        ctx.0, node.0
                    )?;
                    *ctxs += 1;
                }
                Op::FromHost { ctx, node } => writeln!(f, "from_host(c{}, n{})", ctx.0, node.0)?,
                Op::ToHost { ctx, node } => writeln!(f, "to_host(c{}, n{})", ctx.0, node.0)?,
                Op::DeviceToDevice {
                    node,
                    src,
                    dst,
                    mode,
                } => {
                    let mode = match mode {
                        D2d::No => "No".to_string(),
                        D2d::Copy => "Copy".to_string(),
                        D2d::StreamingFor(r) => format!("StreamingFor(r{})", r.0),
                    };
                    writeln!(
                        f,
                        "device_to_device(n{}, c{} -> c{}, {mode})",
                        node.0, src.0, dst.0
                    )?
                }
                Op::HostRead { node } => writeln!(f, "host_read(n{})", node.0)?,
                Op::HostWrite { node, data } => writeln!(f, "host_write(n{}, {data})", node.0)?,
                Op::Read { ctx, node } => writeln!(f, "read(c{}, n{})", ctx.0, node.0)?,
                Op::Finalize { ctx } => writeln!(f, "finalize(c{})", ctx.0)?,
                Op::Sync => writeln!(f, "sync")?,
                Op::Checkpoint => writeln!(f, "checkpoint")?,
                Op::Teardown => writeln!(f, "teardown")?,
                Op::Step { ops, replays } => {
                    let mut inner = Vec::with_capacity(ops.len());
                    for op in ops {
                        let mut line = String::new();
                        write_op(&mut line, op, ctxs, routines)?;
                        inner.push(line.trim_end().to_string());
                    }
                    writeln!(
                        f,
                        "step {{ {} }} captured, replayed {replays}x",
                        inner.join("; ")
                    )?
                }
            }
        }
    }
    Ok(())
}

/// Values of a buffer or host array, compared bitwise.
#[derive(Clone, PartialEq, Eq)]
pub enum Values {
    /// `f32` bit patterns.
    F32(Vec<u32>),
    /// `i32` values.
    I32(Vec<i32>),
}

impl Values {
    /// From `f32` values.
    pub fn f32s(v: &[f32]) -> Values {
        Values::F32(v.iter().map(|x| x.to_bits()).collect())
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::I32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as text.
    pub fn show(&self, i: usize) -> String {
        match self {
            Values::F32(v) => v
                .get(i)
                .map_or("-".into(), |b| format!("{}", f32::from_bits(*b))),
            Values::I32(v) => v.get(i).map_or("-".into(), |x| x.to_string()),
        }
    }

    /// Where `self` and `other` first differ, as text, or `None`.
    pub fn first_difference(&self, other: &Values) -> Option<String> {
        if std::mem::discriminant(self) != std::mem::discriminant(other) {
            return Some("different dtypes".into());
        }
        if self.len() != other.len() {
            return Some(format!("{} vs {} elements", self.len(), other.len()));
        }
        let differs = |i: usize| match (self, other) {
            (Values::F32(a), Values::F32(b)) => a[i] != b[i],
            (Values::I32(a), Values::I32(b)) => a[i] != b[i],
            _ => true,
        };
        let i = (0..self.len()).find(|&i| differs(i))?;
        let count = (0..self.len()).filter(|&i| differs(i)).count();
        Some(format!(
            "element {i}: {} vs {} ({count} of {} elements differ)",
            self.show(i),
            other.show(i),
            self.len()
        ))
    }
}

impl fmt::Debug for Values {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.len();
        let shown: Vec<String> = (0..n.min(6)).map(|i| self.show(i)).collect();
        let more = if n > 6 { ", .." } else { "" };
        let t = match self {
            Values::F32(_) => "f32",
            Values::I32(_) => "i32",
        };
        write!(f, "{t}[{}{more}] ({n})", shown.join(", "))
    }
}

/// Memory and tables of one device after a teardown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Live general allocations (device-wide shared buffers live as long as the device).
    pub allocations: usize,
    /// Bytes of those allocations.
    pub live_bytes: u64,
    /// Live contexts.
    pub contexts: usize,
}

/// What one operation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Obs {
    /// Done, nothing to observe.
    Done,
    /// A device-to-device operation with nothing to do (both contexts share the buffer).
    NoOp,
    /// Values read.
    Values(Values),
    /// A checkpoint: `(context, node, values)` of every live context, then hosted nodes.
    Checkpoint {
        /// Buffers of live contexts.
        buffers: Vec<(C, N, Values)>,
        /// Host values.
        host: Vec<(N, Values)>,
    },
    /// After a teardown, per device.
    Memory(Vec<DeviceMemory>),
}

/// The result of one operation: an observation, or the name of the error variant (plus
/// details after a colon, which comparisons ignore).
pub type OpResult = Result<Obs, String>;

/// The results of a whole program, one per operation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Per operation, in program order.
    pub results: Vec<OpResult>,
}

/// The error variant's name (the part of an error result compared between runs).
pub fn error_kind(e: &str) -> &str {
    e.split(':').next().unwrap_or(e)
}

/// The name of a tributary error's variant, then `: ` and its message.
pub fn describe(e: &tributary::Error) -> String {
    format!("{}: {e}", e.kind())
}

/// Compares an outcome with the expected one; on a difference, a report with the program
/// (the differing operation marked) and what differs.
pub fn compare(program: &Program, expected: &Outcome, got: &Outcome) -> Result<(), String> {
    let n = expected.results.len().max(got.results.len());
    for i in 0..n {
        let (e, g) = (expected.results.get(i), got.results.get(i));
        let diff = match (e, g) {
            (Some(Ok(a)), Some(Ok(b))) => obs_difference(a, b),
            (Some(Err(a)), Some(Err(b))) if error_kind(a) == error_kind(b) => None,
            (a, b) => Some(format!("expected {a:?}\n     got {b:?}")),
        };
        if let Some(diff) = diff {
            return Err(format!(
                "operation {i} differs from the reference: {diff}\n\n{}",
                program.marked(Some(i))
            ));
        }
    }
    Ok(())
}

fn obs_difference(expected: &Obs, got: &Obs) -> Option<String> {
    match (expected, got) {
        (Obs::Values(a), Obs::Values(b)) => a.first_difference(b),
        (
            Obs::Checkpoint {
                buffers: ab,
                host: ah,
            },
            Obs::Checkpoint {
                buffers: bb,
                host: bh,
            },
        ) => {
            let keys =
                |v: &[(C, N, Values)]| v.iter().map(|(c, n, _)| (*c, *n)).collect::<Vec<_>>();
            if keys(ab) != keys(bb) {
                return Some(format!(
                    "checkpoint covers different buffers: expected {:?}, got {:?}",
                    keys(ab),
                    keys(bb)
                ));
            }
            for ((c, n, a), (_, _, b)) in ab.iter().zip(bb) {
                if let Some(d) = a.first_difference(b) {
                    return Some(format!(
                        "checkpoint, c{} n{}: {d} (reference first)",
                        c.0, n.0
                    ));
                }
            }
            if ah.len() != bh.len() {
                return Some("checkpoint covers different host arrays".into());
            }
            for ((n, a), (_, b)) in ah.iter().zip(bh) {
                if let Some(d) = a.first_difference(b) {
                    return Some(format!("checkpoint, host n{}: {d} (reference first)", n.0));
                }
            }
            None
        }
        (a, b) if a == b => None,
        (a, b) => Some(format!("expected {a:?}\n     got {b:?}")),
    }
}

/// Executes a program's operations one at a time on some system.
pub trait Executor {
    /// Runs one operation.
    fn apply(&mut self, op: &Op) -> OpResult;

    /// Operation `index` of the program is about to be applied (for recorders).
    fn begin_op(&mut self, index: usize) {
        let _ = index;
    }

    /// Sizes of the system's bookkeeping, for boundedness checks (`None`: not available).
    fn probe(&self) -> Option<Probe> {
        None
    }
}

/// Bookkeeping sizes of a running system, summed over devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    /// Events held by the protocol tables, host arrays included.
    pub events: usize,
    /// Buffers with a use record.
    pub buffers: usize,
    /// Live contexts.
    pub contexts: usize,
    /// Bytes in live allocations (merge buffers included).
    pub live_bytes: u64,
    /// Bytes of all pools.
    pub reserved_bytes: u64,
    /// Bytes freed but waiting for events.
    pub pending_bytes: u64,
}

/// Something that runs programs: the engine, the actor system, the reference.
pub trait ProgramRunner {
    /// A short name for reports.
    fn name(&self) -> String;

    /// Starts a fresh system for `setup`.
    fn start(&mut self, setup: &Setup) -> Result<Box<dyn Executor>, String>;

    /// The dependency-graph check of the last run, for runners that record one
    /// ([`super::graph`]).
    fn graph(&self) -> Option<super::graph::GraphReport> {
        None
    }

    /// Runs `program` on a fresh system.
    fn run(&mut self, program: &Program) -> Outcome {
        let mut exec = match self.start(&program.setup) {
            Ok(e) => e,
            Err(e) => {
                return Outcome {
                    results: vec![Err(format!("Start: {e}"))],
                }
            }
        };
        let results = program
            .ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                exec.begin_op(i);
                exec.apply(op)
            })
            .collect();
        Outcome { results }
    }
}

/// Writes programs by hand: each method appends an operation and returns the handles it
/// creates.
#[derive(Clone, Debug)]
pub struct Builder {
    /// The program so far.
    pub program: Program,
    contexts: usize,
    routines: usize,
}

impl Builder {
    /// An empty program on `devices` x `streams` with `nodes`.
    pub fn new(devices: usize, streams: usize, nodes: Vec<NodeDecl>) -> Builder {
        Builder {
            program: Program {
                setup: Setup {
                    devices,
                    streams,
                    nodes,
                    pool_bytes: 1 << 20,
                },
                ops: Vec::new(),
            },
            contexts: 0,
            routines: 0,
        }
    }

    /// Appends an operation that creates nothing.
    pub fn op(&mut self, op: Op) -> &mut Self {
        self.program.ops.push(op);
        self
    }

    fn new_context(&mut self, op: Op) -> C {
        self.program.ops.push(op);
        self.contexts += 1;
        C(self.contexts - 1)
    }

    /// `root(device, stream)`.
    pub fn root(&mut self, device: usize, stream: usize) -> C {
        self.new_context(Op::Root { device, stream })
    }

    /// `link(ctx, kernel)`: the routine and its context.
    pub fn link(&mut self, ctx: C, kernel: Kernel) -> (R, C) {
        let c = self.new_context(Op::Link { ctx, kernel });
        self.routines += 1;
        (R(self.routines - 1), c)
    }

    /// `init_from_host(ctx, node, data)`.
    pub fn init(&mut self, ctx: C, node: N, data: Data) -> C {
        self.new_context(Op::InitFromHost { ctx, node, data })
    }

    /// `schedule(routine)`.
    pub fn schedule(&mut self, routine: R) -> &mut Self {
        self.op(Op::Schedule { routine })
    }

    /// `schedule_with(routine, t)`.
    pub fn schedule_with(&mut self, routine: R, t: i64) -> &mut Self {
        self.op(Op::ScheduleWith { routine, t })
    }

    /// `device_to_device(node, src, dst, mode)`.
    pub fn d2d(&mut self, node: N, src: C, dst: C, mode: D2d) -> &mut Self {
        self.op(Op::DeviceToDevice {
            node,
            src,
            dst,
            mode,
        })
    }

    /// The program.
    pub fn build(&self) -> Program {
        self.program.clone()
    }
}
