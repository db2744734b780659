//! Random programs, with shrinking.
//!
//! Proptest generates an [`AbsProgram`]: a setup and a list of *abstract* operations whose
//! targets are plain numbers. [`resolve`] turns it into a concrete, valid [`Program`] by
//! walking it with the reference as oracle: each number picks among what exists at that
//! point (live contexts, routines, nodes in a context, ...), and an operation the
//! reference refuses (a second writer, a merge buffer holding another node) is dropped.
//! Shrinking removes and simplifies abstract operations; whatever remains still resolves
//! to a valid program, so the shrunk counterexample is a real, minimal-ish program.

use proptest::prelude::*;

use super::{
    program::*,
    reference::{Reference, Streaming},
};

/// Size limits of generated programs.
#[derive(Clone, Copy, Debug)]
pub struct Profile {
    /// Devices: 1 to this.
    pub max_devices: usize,
    /// Streams per device: 1 to this.
    pub max_streams: usize,
    /// Nodes: 1 to this.
    pub max_nodes: usize,
    /// Abstract operations: 1 to this (the program adds roots, a checkpoint, a teardown).
    pub max_ops: usize,
    /// Whether nodes may be hosted (otherwise every node is on-device only).
    pub hosted: bool,
}

/// A generated program before resolution.
#[derive(Clone, Debug)]
pub struct AbsProgram {
    /// Devices.
    pub devices: usize,
    /// Streams per device.
    pub streams: usize,
    /// Nodes.
    pub nodes: Vec<NodeDecl>,
    /// Pool size.
    pub pool_bytes: u64,
    /// Abstract operations.
    pub ops: Vec<Abs>,
}

/// An abstract operation: numbers pick targets among what exists when it is resolved.
#[derive(Clone, Debug)]
pub enum Abs {
    /// A new root context.
    Root { device: u8, stream: u8 },
    /// Link a kernel (kind, destination, source, value), then maybe schedule it.
    Link {
        ctx: u16,
        kind: u8,
        a: u8,
        b: u8,
        value: i8,
        schedule: bool,
    },
    /// Schedule a live routine (with `t` for its index, if it declares one).
    Schedule { routine: u16, t: i16 },
    /// `init_from_host` of a hosted node not yet in the context.
    Init { ctx: u16, node: u8, data: Data },
    /// `from_host` of a hosted node of the context.
    FromHost { ctx: u16, node: u8 },
    /// `to_host` of a hosted node of the context.
    ToHost { ctx: u16, node: u8 },
    /// Host read of a hosted node.
    HostRead { node: u8 },
    /// Host write of a non-constant hosted node.
    HostWrite { node: u8, data: Data },
    /// Read of a node of a context.
    Read { ctx: u16, node: u8 },
    /// `device_to_device(No)` of a node between two contexts holding it.
    Copy { node: u8, src: u16, dst: u16 },
    /// Feed a merge routine: `Copy` then schedule, `Copy` only, or `StreamingFor`.
    Merge { routine: u16, src: u16, how: u8 },
    /// A host write of a hosted node some context holds, then a read of that node's value
    /// in a context (`then` 0), a copy into another context's buffer (1), or a merge
    /// consumer fed by `Copy` (2) or `StreamingFor` (3): the source buffers lag the host
    /// write, so these read what only the host array holds.
    HostWriteThen {
        node: u8,
        data: Data,
        then: u8,
        a: u16,
        b: u16,
    },
    /// Finalize a context without live children.
    Finalize { ctx: u16 },
    /// Observe everything.
    Checkpoint,
    /// Wait for everything.
    Sync,
}

fn arb_mode(hosted: bool) -> BoxedStrategy<Mode> {
    if !hosted {
        return prop_oneof![
            Just(Mode::OnDevice(Share::Unset)),
            Just(Mode::OnDevice(Share::PerStream)),
            Just(Mode::OnDevice(Share::Shared)),
        ]
        .boxed();
    }
    prop_oneof![
        Just(Mode::OnDevice(Share::Unset)),
        Just(Mode::OnDevice(Share::PerStream)),
        Just(Mode::OnDevice(Share::Shared)),
        Just(Mode::Hosted(Share::Unset)),
        Just(Mode::Hosted(Share::PerStream)),
        Just(Mode::Hosted(Share::Shared)),
        Just(Mode::Constant),
        Just(Mode::Volatile),
    ]
    .boxed()
}

fn arb_node(hosted: bool) -> impl Strategy<Value = NodeDecl> {
    (
        prop_oneof![3 => Just(Dt::F32), 1 => Just(Dt::I32)],
        prop_oneof![3 => Just(4usize), 4 => Just(64), 2 => Just(1000), 1 => Just(1)],
        any::<bool>(),
        arb_mode(hosted),
        any::<bool>(),
    )
        .prop_map(|(dtype, numel, two_d, mode, zeroed)| NodeDecl {
            dtype,
            dims: if two_d && numel % 4 == 0 {
                vec![4, numel / 4]
            } else {
                vec![numel]
            },
            mode,
            zeroed,
        })
}

fn arb_data() -> impl Strategy<Value = Data> {
    prop_oneof![
        (0u32..64).prop_map(Data::Ints),
        (0u32..64).prop_map(Data::Fractions)
    ]
}

fn arb_abs() -> impl Strategy<Value = Abs> {
    let ix = || 0u16..512;
    let nd = || 0u8..32;
    prop_oneof![
        2 => (0u8..4, 0u8..3).prop_map(|(device, stream)| Abs::Root { device, stream }),
        30 => (ix(), 0u8..9, nd(), nd(), any::<i8>(), prop::bool::weighted(0.7)).prop_map(
            |(ctx, kind, a, b, value, schedule)| Abs::Link { ctx, kind, a, b, value, schedule }
        ),
        14 => (ix(), any::<i16>()).prop_map(|(routine, t)| Abs::Schedule { routine, t }),
        8 => (ix(), nd(), arb_data()).prop_map(|(ctx, node, data)| Abs::Init { ctx, node, data }),
        3 => (ix(), nd()).prop_map(|(ctx, node)| Abs::FromHost { ctx, node }),
        3 => (ix(), nd()).prop_map(|(ctx, node)| Abs::ToHost { ctx, node }),
        5 => nd().prop_map(|node| Abs::HostRead { node }),
        4 => (nd(), arb_data()).prop_map(|(node, data)| Abs::HostWrite { node, data }),
        4 => (ix(), nd()).prop_map(|(ctx, node)| Abs::Read { ctx, node }),
        8 => (nd(), ix(), ix()).prop_map(|(node, src, dst)| Abs::Copy { node, src, dst }),
        12 => (ix(), ix(), 0u8..3).prop_map(|(routine, src, how)| Abs::Merge { routine, src, how }),
        5 => (nd(), arb_data(), 0u8..4, ix(), ix()).prop_map(|(node, data, then, a, b)| {
            Abs::HostWriteThen { node, data, then, a, b }
        }),
        6 => ix().prop_map(|ctx| Abs::Finalize { ctx }),
        1 => Just(Abs::Checkpoint),
        1 => Just(Abs::Sync),
    ]
}

/// Programs within `profile`.
pub fn arb_program(profile: Profile) -> impl Strategy<Value = AbsProgram> {
    (
        1..=profile.max_devices,
        1..=profile.max_streams,
        prop::collection::vec(arb_node(profile.hosted), 1..=profile.max_nodes),
        prop_oneof![Just(1u64 << 20), Just(1 << 16), Just(1 << 12)],
        prop::collection::vec(arb_abs(), 1..=profile.max_ops),
    )
        .prop_map(|(devices, streams, nodes, pool_bytes, ops)| AbsProgram {
            devices,
            streams,
            nodes,
            pool_bytes,
            ops,
        })
}

/// Schedules `routine`, with the value `t` for its index if it declares one.
fn schedule_op(indexed: bool, routine: R, t: i64) -> Op {
    if indexed {
        Op::ScheduleWith { routine, t }
    } else {
        Op::Schedule { routine }
    }
}

fn pick<T: Copy>(v: &[T], i: impl Into<usize>) -> Option<T> {
    if v.is_empty() {
        None
    } else {
        Some(v[i.into() % v.len()])
    }
}

struct Resolver {
    reference: Reference,
    ops: Vec<Op>,
}

impl Resolver {
    /// Keeps `op` if the reference accepts it.
    fn push(&mut self, op: Op) -> bool {
        let ok = self.reference.apply(&op).is_ok();
        if ok {
            self.ops.push(op);
        }
        ok
    }

    fn nodes(&self, keep: impl Fn(N, &NodeDecl) -> bool) -> Vec<N> {
        self.reference
            .setup()
            .nodes
            .iter()
            .enumerate()
            .filter(|(i, d)| keep(N(*i), d))
            .map(|(i, _)| N(i))
            .collect()
    }

    fn ctx(&self, i: u16) -> Option<C> {
        pick(&self.reference.live_contexts(), i)
    }

    fn kernel(&self, kind: u8, a: u8, b: u8, value: i8) -> Option<Kernel> {
        let decls = self.reference.setup().nodes.clone();
        let dst = pick(&self.nodes(|_, d| d.mode.device_writable()), a)?;
        let dd = &decls[dst.0];
        let compat = self.nodes(|n, d| n != dst && d.dtype == dd.dtype && d.numel() == dd.numel());
        let value = if value % 2 == 0 {
            f64::from(value) / 2.0
        } else {
            f64::from(value) / 10.0
        };
        let src = pick(&compat, b);
        let alpha = [2.0, -1.0, 0.5, 0.1, 3.0][usize::from(b) % 5];
        Some(match (kind % 9, src) {
            (8, _) => Kernel::FillIndex { dst },
            (1, Some(src)) => Kernel::Copy { dst, src },
            (2 | 6, Some(src)) => Kernel::AddInto { dst, src },
            (3 | 7, _) => Kernel::AddMerge { dst },
            (4, Some(src)) if dd.dtype == Dt::F32 => Kernel::Scale { dst, src, alpha },
            (5, Some(src)) if dd.dtype == Dt::F32 => Kernel::Axpy {
                y: dst,
                x: src,
                alpha,
            },
            (4 | 5, Some(src)) => Kernel::AddInto { dst, src },
            _ => Kernel::Fill { dst, value },
        })
    }

    fn resolve(&mut self, a: &Abs) -> Option<()> {
        let r = &self.reference;
        let setup = r.setup().clone();
        match *a {
            Abs::Root { device, stream } => {
                self.push(Op::Root {
                    device: usize::from(device) % setup.devices,
                    stream: usize::from(stream) % setup.streams,
                });
            }
            Abs::Link {
                ctx,
                kind,
                a,
                b,
                value,
                schedule,
            } => {
                let ctx = self.ctx(ctx)?;
                let kernel = self.kernel(kind, a, b, value)?;
                let indexed = kernel.index().is_some();
                if self.push(Op::Link { ctx, kernel }) && schedule {
                    let routine = R(self.reference.routine_count() - 1);
                    self.push(schedule_op(indexed, routine, i64::from(value) * 37));
                }
            }
            Abs::Schedule { routine, t } => {
                let routine = pick(&r.live_routines(), routine)?;
                let indexed = r.kernel_of(routine).index().is_some();
                self.push(schedule_op(indexed, routine, i64::from(t)));
            }
            Abs::Init { ctx, node, data } => {
                let ctx = self.ctx(ctx)?;
                let hosted = self.nodes(|n, d| d.mode.is_hosted() && !r.contains(ctx, n));
                let node = pick(&hosted, node)?;
                self.push(Op::InitFromHost { ctx, node, data });
            }
            Abs::FromHost { ctx, node } | Abs::ToHost { ctx, node } => {
                let ctx = self.ctx(ctx)?;
                let hosted = self.nodes(|n, d| d.mode.is_hosted() && r.contains(ctx, n));
                let node = pick(&hosted, node)?;
                self.push(match a {
                    Abs::FromHost { .. } => Op::FromHost { ctx, node },
                    _ => Op::ToHost { ctx, node },
                });
            }
            Abs::HostRead { node } => {
                let node = pick(&self.nodes(|_, d| d.mode.is_hosted()), node)?;
                self.push(Op::HostRead { node });
            }
            Abs::HostWrite { node, data } => {
                let node = pick(&self.nodes(|_, d| d.mode.host_writable()), node)?;
                self.push(Op::HostWrite { node, data });
            }
            Abs::Read { ctx, node } => {
                let ctx = self.ctx(ctx)?;
                let node = pick(&r.nodes_of(ctx), node)?;
                self.push(Op::Read { ctx, node });
            }
            Abs::Copy { node, src, dst } => {
                let src = self.ctx(src)?;
                let writable: Vec<N> = r
                    .nodes_of(src)
                    .into_iter()
                    .filter(|n| setup.nodes[n.0].mode.device_writable())
                    .collect();
                let node = pick(&writable, node)?;
                let holders: Vec<C> = r
                    .live_contexts()
                    .into_iter()
                    .filter(|&c| r.contains(c, node))
                    .collect();
                let dst = pick(&holders, dst)?;
                self.push(Op::DeviceToDevice {
                    node,
                    src,
                    dst,
                    mode: D2d::No,
                });
            }
            Abs::Merge { routine, src, how } => {
                let mergers: Vec<R> = r
                    .live_routines()
                    .into_iter()
                    .filter(|&x| r.kernel_of(x).merge().is_some())
                    .collect();
                let routine = pick(&mergers, routine)?;
                let node = r.kernel_of(routine).merge()?;
                let dst = r.context_of(routine);
                let holders: Vec<C> = r
                    .live_contexts()
                    .into_iter()
                    .filter(|&c| r.contains(c, node))
                    .collect();
                let src = pick(&holders, src)?;
                let copy = |mode| Op::DeviceToDevice {
                    node,
                    src,
                    dst,
                    mode,
                };
                match how % 3 {
                    0 => {
                        if self.push(copy(D2d::Copy)) {
                            self.push(Op::Schedule { routine });
                        }
                    }
                    1 => {
                        self.push(copy(D2d::Copy));
                    }
                    _ => {
                        self.push(copy(D2d::StreamingFor(routine)));
                    }
                }
            }
            Abs::HostWriteThen {
                node,
                data,
                then,
                a,
                b,
            } => {
                let held = |n: N| r.live_contexts().into_iter().any(|c| r.contains(c, n));
                let node = pick(&self.nodes(|n, d| d.mode.host_writable() && held(n)), node)?;
                let holders: Vec<C> = r
                    .live_contexts()
                    .into_iter()
                    .filter(|&c| r.contains(c, node))
                    .collect();
                let src = pick(&holders, a)?;
                let mergers: Vec<R> = r
                    .live_routines()
                    .into_iter()
                    .filter(|&x| r.kernel_of(x).merge() == Some(node))
                    .collect();
                let writable = setup.nodes[node.0].mode.device_writable();
                let then = match then % 4 {
                    1 if writable => Op::DeviceToDevice {
                        node,
                        src,
                        dst: pick(&holders, b)?,
                        mode: D2d::No,
                    },
                    2 | 3 if !mergers.is_empty() => {
                        let routine = pick(&mergers, b)?;
                        let mode = if then % 4 == 2 {
                            D2d::Copy
                        } else {
                            D2d::StreamingFor(routine)
                        };
                        Op::DeviceToDevice {
                            node,
                            src,
                            dst: r.context_of(routine),
                            mode,
                        }
                    }
                    _ => Op::Read { ctx: src, node },
                };
                if !self.push(Op::HostWrite { node, data }) {
                    return None;
                }
                let copy_into_merge = matches!(
                    then,
                    Op::DeviceToDevice {
                        mode: D2d::Copy,
                        ..
                    }
                );
                if self.push(then) && copy_into_merge {
                    let routine = pick(&mergers, b)?;
                    self.push(Op::Schedule { routine });
                }
            }
            Abs::Finalize { ctx } => {
                let ctx = pick(&r.leaf_contexts(), ctx)?;
                self.push(Op::Finalize { ctx });
            }
            Abs::Checkpoint => {
                self.push(Op::Checkpoint);
            }
            Abs::Sync => {
                self.push(Op::Sync);
            }
        }
        Some(())
    }
}

/// The valid program `abs` stands for: a root context on every stream, the operations the
/// reference accepts, then a checkpoint and a teardown.
pub fn resolve(abs: &AbsProgram) -> Program {
    resolve_for(abs, Streaming::AnyDevice)
}

/// [`resolve`] for a backend that streams as `streaming` says.
pub fn resolve_for(abs: &AbsProgram, streaming: Streaming) -> Program {
    let setup = Setup {
        devices: abs.devices,
        streams: abs.streams,
        nodes: abs.nodes.clone(),
        pool_bytes: abs.pool_bytes,
    };
    let mut r = Resolver {
        reference: Reference::with_streaming(&setup, streaming),
        ops: Vec::new(),
    };
    for device in 0..setup.devices {
        for stream in 0..setup.streams {
            r.push(Op::Root { device, stream });
        }
    }
    for a in &abs.ops {
        let _ = r.resolve(a);
    }
    r.push(Op::Checkpoint);
    r.push(Op::Teardown);
    Program { setup, ops: r.ops }
}
