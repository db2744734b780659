//! Plans: what the protocol asks a backend to do for one operation.
//!
//! A [`Plan`] is the whole outcome of scheduling one operation: the stream it runs on,
//! the events it must wait for ([`Dep`]), the work, and the event it completes. Bindings
//! (buffer locations, the merge-buffer source, host arrays) are resolved when the plan is
//! made, i.e. at schedule time, never at execution time (OCANNL read some of them at
//! execution time on the CPU and at launch time on CUDA; DESIGN.md §1).

use std::{fmt, sync::Arc};

use crate::{
    error::{Error, Failure},
    event::Event,
    ids::{BufferLoc, DeviceId, StreamId},
    kernels::{Access, Kernel},
    memory::AlignedBuffer,
    node::{DType, Shape},
};

/// A buffer location qualified by its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GlobalLoc {
    /// The device whose pools hold the buffer.
    pub device: DeviceId,
    /// The location inside that device's pools.
    pub loc: BufferLoc,
}

impl fmt::Display for GlobalLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.device, self.loc)
    }
}

/// Why an operation waits for an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DepKind {
    /// The operation reads what the event's operation wrote (read after write). If that
    /// operation failed, this one fails with the same root cause.
    Data,
    /// The operation must not start before the event's operation finished (write after
    /// read, write after write, reuse of memory). A failure there does not propagate.
    Order,
}

/// One event an operation waits for.
#[derive(Clone, Debug)]
pub struct Dep {
    /// The event.
    pub event: Event,
    /// Why.
    pub kind: DepKind,
}

/// A buffer bound as a kernel argument.
#[derive(Clone, Debug)]
pub struct ArgBinding {
    /// Where the buffer is.
    pub loc: GlobalLoc,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its element type.
    pub dtype: DType,
    /// Its shape.
    pub shape: Shape,
    /// How the kernel uses it.
    pub access: Access,
}

/// The work of one operation.
#[derive(Clone)]
pub enum Work {
    /// Run a kernel over bound buffers.
    Run {
        /// Routine name (for errors and traces).
        name: Arc<str>,
        /// The kernel.
        kernel: Kernel,
        /// Parameters in the kernel's argument order.
        args: Vec<ArgBinding>,
        /// The merge-buffer argument, resolved at schedule time.
        merge: Option<ArgBinding>,
    },
    /// Copy `bytes` from one buffer to another (possibly on another device).
    Copy {
        /// Source buffer.
        src: GlobalLoc,
        /// Destination buffer.
        dst: GlobalLoc,
        /// Bytes to copy.
        bytes: u64,
    },
    /// Copy a host array into a buffer.
    FromHost {
        /// The host array.
        host: Arc<AlignedBuffer>,
        /// Destination buffer.
        dst: GlobalLoc,
        /// Bytes to copy.
        bytes: u64,
    },
    /// Copy a buffer into a host array.
    ToHost {
        /// Source buffer.
        src: GlobalLoc,
        /// The host array.
        host: Arc<AlignedBuffer>,
        /// Bytes to copy.
        bytes: u64,
    },
    /// Zero a buffer.
    Memset {
        /// The buffer.
        dst: GlobalLoc,
        /// Bytes to zero.
        bytes: u64,
    },
    /// Nothing: only completes an event (used to mark a point on a stream).
    Marker,
}

impl Work {
    /// A short name of the operation, for errors and traces.
    pub fn label(&self) -> String {
        match self {
            Work::Run { name, .. } => name.to_string(),
            Work::Copy { src, dst, .. } => format!("copy {src} -> {dst}"),
            Work::FromHost { dst, .. } => format!("from_host -> {dst}"),
            Work::ToHost { src, .. } => format!("to_host {src} ->"),
            Work::Memset { dst, .. } => format!("memset {dst}"),
            Work::Marker => "marker".to_string(),
        }
    }

    /// Bytes moved or touched, for traces and bandwidth figures.
    pub fn bytes(&self) -> u64 {
        match self {
            Work::Run { args, .. } => args.iter().map(|a| a.bytes).sum(),
            Work::Copy { bytes, .. }
            | Work::FromHost { bytes, .. }
            | Work::ToHost { bytes, .. }
            | Work::Memset { bytes, .. } => *bytes,
            Work::Marker => 0,
        }
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// Everything a stream must do for one operation.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The stream that runs it.
    pub stream: StreamId,
    /// The event it completes (its sequence number on `stream`).
    pub event: Event,
    /// What it waits for first. Every dependency is waited for, even after one failed, so
    /// that an operation completes only after all its dependencies completed: this is what
    /// makes pruning the tables sound (a completed write implies completed earlier uses).
    pub deps: Vec<Dep>,
    /// The work.
    pub work: Work,
}

/// Waits for every dependency of a plan, as every executor must before running its work.
///
/// Returns the root cause of the first failed [`DepKind::Data`] dependency, if any: the
/// plan must then fail with it instead of running. Every dependency is waited for even
/// after one failed, so that a plan completes only after all its dependencies completed.
pub fn await_deps(deps: &[Dep]) -> Result<(), Arc<Failure>> {
    await_deps_observed(deps, |_, _| {})
}

/// [`await_deps`], calling `observe(dep, result)` around each wait that had to block
/// (the dependency was not complete when reached): `observe` is called with `None` before
/// blocking and with `Some(ok)` after. For timelines and profiling.
pub fn await_deps_observed(
    deps: &[Dep],
    mut observe: impl FnMut(&Dep, Option<bool>),
) -> Result<(), Arc<Failure>> {
    let mut failed: Option<Arc<Failure>> = None;
    for dep in deps {
        let blocked = !dep.event.is_done();
        if blocked {
            observe(dep, None);
        }
        let r = dep.event.wait();
        if blocked {
            observe(dep, Some(r.is_ok()));
        }
        if let (Err(Error::Failed(f)), DepKind::Data) = (r, dep.kind) {
            if !mutant!("failure") {
                failed.get_or_insert(f);
            }
        }
    }
    match failed {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

impl Plan {
    /// Fails the plan's event without running it (its work could not be submitted), so that
    /// nobody waits for it and its dependents fail with `error` as the root cause.
    pub fn fail(&self, error: &Error) {
        self.event.timeline().fail(
            self.event.seq(),
            Arc::new(Failure {
                stream: self.stream,
                seq: self.event.seq(),
                operation: self.work.label(),
                message: format!("not submitted: {error}"),
            }),
        );
    }
}
