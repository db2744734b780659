//! Bad input: every misuse of the public API, with the error variant it must get, against
//! the engine, the actor system's blocking methods and the raw actor messages.
//!
//! The table is written once against the [`Api`] of `tributary_testkit::bad_input` and run
//! by three tests, one per runner. Each row runs on a fresh, quiescent [`World`]: optional
//! set-up, then the misuse, which must fail with exactly the expected variant (one per row,
//! or a runner's own where its API differs, e.g. a raw host writes the host value itself);
//! then nothing may have changed (memory statistics, protocol table sizes), and a probe of
//! later operations must still work and give the right values, down to every context
//! finalizing and memory returning to the device-wide buffers only. For the actors, that
//! probe is what shows the actor still serves after the misuse.
//!
//! Rows only raw messages can express (a context sent to another device's actor, an
//! all-reduce whose lists disagree, ...) run on the messages runner only.
//!
//! Not reachable through the engine API, so not in the table: scheduling on a shut-down
//! system (the engine has no shutdown; dropping it leaves no handle to call), and a stream
//! whose worker died (in `reliability_faults`: work scheduled there fails with the
//! death as root cause).

use bad_input::{Api, Data, EngineApi, Given, MessagesApi, SystemApi};
use common::{program::describe, watchdog::Watchdog};
use std::time::Duration;
use tributary::{
    collective::{AllReduceStep, Transfer},
    kernels::{self, Access, RoutineSpec},
    memory::PoolKind,
    protocol::{Context, Routine},
    DType, Engine, EngineConfig, Error, MemoryMode, MergeBufferUse, Sharing, TensorNode,
};
use tributary_actors::messages::{
    AllReduce, CreateNode, Finalize, FromHost, InitFromHost, Link, RefineNode, Schedule,
    StreamLastEvent, ToHost,
};
use tributary_testkit::{bad_input, common};

const N: usize = 100;

/// A small, quiescent system with something in every table.
struct World {
    api: Box<dyn Api>,
    /// Hosted, initialised to 1 in `cw` on d0s0.
    w: TensorNode,
    /// On device: 3 on d1s0 (`grad`), merged on d0s0 and d0s1.
    g: TensorNode,
    /// Shared across the streams of d0, owned (written) by d0s0: 2.
    s: TensorNode,
    /// i32, on device.
    i: TensorNode,
    /// Half the size of the others.
    small: TensorNode,
    r00: Context,
    r01: Context,
    cw: Context,
    fill_s: Routine,
    bump: Routine,
    grad: Routine,
    merge: Routine,
    m01: Routine,
    plain01: Routine,
    gone: Routine,
    /// A node nothing writes, and a routine on d0s1 that reads it.
    fresh: TensorNode,
    reads_fresh: Routine,
    /// `log = t` on d0s1, with an index `t: u32`.
    log: TensorNode,
    stamp: Routine,
    /// `g += merge + t` on d0s1, reading the merge buffer, with an index `t: u32`.
    stamp_merge: Routine,
}

fn f32_node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

fn world(mut api: Box<dyn Api>) -> World {
    let e = &mut *api;
    let w = f32_node("w", MemoryMode::hosted_changed_on_devices());
    // An accumulator: `merge` adds into its fresh buffer.
    let g = TensorNode::new_zeroed("g", DType::F32, [N])
        .with_mode(MemoryMode::on_device())
        .expect("mode");
    let fresh = f32_node("fresh", MemoryMode::OnDevice(Sharing::PerStream));
    let sink = f32_node("sink", MemoryMode::OnDevice(Sharing::PerStream));
    let s = f32_node("s", MemoryMode::OnDevice(Sharing::SharedCrossStreams));
    let i = TensorNode::new("i", DType::I32, [N]);
    let small = TensorNode::new("small", DType::F32, [N / 2]);
    let r00 = e.context(0, 0).unwrap();
    let r01 = e.context(0, 1).unwrap();
    let r10 = e.context(1, 0).unwrap();
    let cw = e.init_from_host(&r00, &w, Data::F32(vec![1.0; N])).unwrap();
    let fill_s = e.link(&cw, kernels::fill(&s, 2.0).unwrap()).unwrap();
    let bump = e
        .link(fill_s.context(), kernels::add_into(&w, &s).unwrap())
        .unwrap();
    let grad = e.link(&r10, kernels::fill(&g, 3.0).unwrap()).unwrap();
    let merge = e
        .link(fill_s.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    let m01 = e.link(&r01, kernels::add_merge(&g).unwrap()).unwrap();
    let plain01 = e.link(&r01, kernels::fill(&small, 4.0).unwrap()).unwrap();
    let gone = e.link(&r01, kernels::fill(&g, 9.0).unwrap()).unwrap();
    let reads_fresh = e.link(&r01, kernels::copy(&sink, &fresh).unwrap()).unwrap();
    let log = f32_node("log", MemoryMode::OnDevice(Sharing::PerStream));
    let stamp = e.link(&r01, stamp_spec(&log)).unwrap();
    let stamp_merge = e
        .link(
            &r01,
            RoutineSpec::custom(
                "stamp_merge",
                vec![(g.clone(), Access::ReadWrite)],
                Some(g.clone()),
                |a| {
                    let t = a.index("t")? as f32;
                    let m = a.merge::<f32>()?.to_vec();
                    for (g, m) in a.output::<f32>(0)?.iter_mut().zip(m) {
                        *g += m + t;
                    }
                    Ok(())
                },
            )
            .and_then(|s| s.with_index("t"))
            .unwrap(),
        )
        .unwrap();
    e.schedule(&fill_s).unwrap();
    e.schedule(&grad).unwrap();
    e.schedule(&gone).unwrap();
    e.finalize(gone.context()).unwrap();
    e.quiesce().unwrap();
    World {
        api,
        w,
        g,
        s,
        i,
        small,
        r00,
        r01,
        cw,
        fill_s,
        bump,
        grad,
        merge,
        m01,
        plain01,
        gone,
        fresh,
        reads_fresh,
        log,
        stamp,
        stamp_merge,
    }
}

/// `log = t`, with an index `t: u32`.
fn stamp_spec(log: &TensorNode) -> RoutineSpec {
    RoutineSpec::custom("stamp", vec![(log.clone(), Access::Write)], None, |a| {
        let t = a.index("t")? as f32;
        a.output::<f32>(0)?.fill(t);
        Ok(())
    })
    .and_then(|s| s.with_index("t"))
    .unwrap()
}

/// Later operations work and give the right values; everything finalizes; only the
/// device-wide buffer of `s` on d0 stays.
fn probe(wd: &mut World) {
    let e = &mut *wd.api;
    e.schedule(&wd.fill_s).unwrap();
    e.schedule(&wd.bump).unwrap();
    assert_eq!(
        e.host_read(&wd.w, DType::F32).unwrap().f32(),
        vec![3.0; N],
        "w = 1 + s"
    );
    e.device_to_device(
        &wd.g,
        wd.grad.context(),
        wd.merge.context(),
        MergeBufferUse::Copy,
    )
    .unwrap();
    e.schedule(&wd.merge).unwrap();
    assert_eq!(
        e.read(wd.merge.context(), &wd.g, DType::F32).unwrap().f32(),
        vec![3.0; N]
    );
    e.device_to_device(
        &wd.g,
        wd.grad.context(),
        wd.m01.context(),
        MergeBufferUse::StreamingFor(wd.m01.clone()),
    )
    .unwrap();
    assert_eq!(
        e.read(wd.m01.context(), &wd.g, DType::F32).unwrap().f32(),
        vec![3.0; N]
    );
    e.schedule(&wd.plain01).unwrap();
    assert_eq!(
        e.read(wd.plain01.context(), &wd.small, DType::F32)
            .unwrap()
            .f32(),
        vec![4.0; N / 2]
    );
    e.schedule_with(&wd.stamp, Given::Pairs(&[("t", 5)]))
        .unwrap();
    assert_eq!(
        e.read(wd.stamp.context(), &wd.log, DType::F32)
            .unwrap()
            .f32(),
        vec![5.0; N]
    );
    for c in [
        wd.stamp_merge.context(),
        wd.stamp.context(),
        wd.plain01.context(),
        wd.reads_fresh.context(),
        wd.m01.context(),
        wd.merge.context(),
        wd.grad.context(),
        wd.bump.context(),
        wd.fill_s.context(),
        &wd.cw,
        &wd.r00,
        &wd.r01,
    ] {
        e.finalize(c).unwrap();
    }
    let r10 = wd.grad.context().parent().unwrap().clone();
    e.finalize(&r10).unwrap();
    e.quiesce().unwrap();
    let tables = e.table_sizes();
    assert!(tables.iter().all(|t| t.contexts == 0), "{tables:?}");
    let live: Vec<u64> = e
        .memory_stats()
        .iter()
        .map(|m| {
            assert_eq!(m.pending_free_bytes, 0, "{m:?}");
            m.per_pool
                .iter()
                .filter(|p| p.kind == PoolKind::General)
                .map(|p| p.live_bytes)
                .sum()
        })
        .collect();
    assert_eq!(
        live,
        vec![448, 0],
        "only s's device-wide buffer on d0 stays"
    );
}

type Misuse = fn(&mut World) -> Result<(), Error>;

/// One row: what is misused, the variant it must get (and a runner's own, where its API
/// differs), an optional set-up, the runner it is limited to, the misuse.
struct Case {
    what: &'static str,
    expect: &'static str,
    on: Vec<(&'static str, &'static str)>,
    setup: Option<fn(&mut World)>,
    only: Option<&'static str>,
    misuse: Misuse,
}

fn case(what: &'static str, expect: &'static str, misuse: Misuse) -> Case {
    Case {
        what,
        expect,
        on: Vec::new(),
        setup: None,
        only: None,
        misuse,
    }
}

/// A row only raw messages can express.
fn message_case(what: &'static str, expect: &'static str, misuse: Misuse) -> Case {
    Case {
        only: Some("messages"),
        ..case(what, expect, misuse)
    }
}

impl Case {
    /// Through `runner`, the row expects `variant` instead.
    fn on(mut self, runner: &'static str, variant: &'static str) -> Case {
        self.on.push((runner, variant));
        self
    }

    fn expect_on(&self, runner: &str) -> &'static str {
        self.on
            .iter()
            .find(|(r, _)| *r == runner)
            .map_or(self.expect, |(_, v)| v)
    }
}

fn cases() -> Vec<Case> {
    let mut cases = vec![
        // Wrong dtype.
        case("host_write with the wrong dtype", "DTypeMismatch", |w| {
            w.api.host_write(&w.w, Data::F64(vec![1.0; N]))
        }),
        case("host_read with the wrong dtype", "DTypeMismatch", |w| {
            w.api.host_read(&w.w, DType::I32).map(drop)
        }),
        case("read with the wrong dtype", "DTypeMismatch", |w| {
            w.api.read(&w.cw, &w.w, DType::F64).map(drop)
        }),
        case(
            "init_from_host with the wrong dtype",
            "DTypeMismatch",
            |w| {
                w.api
                    .init_from_host(&w.r01, &w.w, Data::I32(vec![1; N]))
                    .map(drop)
            },
        ),
        case("a kernel mixing dtypes", "DTypeMismatch", |w| {
            kernels::add_into(&w.g, &w.i).map(drop)
        }),
        case("a float kernel on i32", "DTypeMismatch", |w| {
            kernels::scale(&w.i, &w.i, 2.0).map(drop)
        }),
        // Wrong shape or size.
        case("host_write with the wrong length", "SizeMismatch", |w| {
            w.api.host_write(&w.w, Data::F32(vec![1.0; N - 1]))
        }),
        case(
            "init_from_host with the wrong length",
            "SizeMismatch",
            |w| {
                w.api
                    .init_from_host(&w.r01, &w.w, Data::F32(vec![1.0; N + 1]))
                    .map(drop)
            },
        ),
        case(
            "an elementwise kernel with different sizes",
            "SizeMismatch",
            |w| kernels::copy(&w.g, &w.small).map(drop),
        ),
        case("a matmul with incompatible shapes", "SizeMismatch", |_| {
            let a = TensorNode::new("a", DType::F32, [4, 5]);
            let b = TensorNode::new("b", DType::F32, [6, 7]);
            let c = TensorNode::new("c", DType::F32, [4, 7]);
            kernels::matmul(&c, &a, &b).map(drop)
        }),
        // Node not in the context, or already there.
        case(
            "read of a node not in the context",
            "NodeNotInContext",
            |w| w.api.read(&w.r00, &w.g, DType::F32).map(drop),
        ),
        case(
            "to_host of a node not in the context",
            "NodeNotInContext",
            |w| w.api.to_host(&w.r01, &w.w).map(drop),
        ),
        case(
            "from_host of a node not in the context",
            "NodeNotInContext",
            |w| w.api.from_host(&w.r01, &w.w).map(drop),
        ),
        case(
            "device_to_device from a context without the node",
            "NodeNotInContext",
            |w| {
                let dst = w.merge.context().clone();
                w.api
                    .device_to_device(&w.g, &w.r00, &dst, MergeBufferUse::No)
                    .map(drop)
            },
        ),
        case(
            "device_to_device into a context without the node",
            "NodeNotInContext",
            |w| {
                let src = w.grad.context().clone();
                w.api
                    .device_to_device(&w.g, &src, &w.r01, MergeBufferUse::No)
                    .map(drop)
            },
        ),
        case(
            "init_from_host of a node already in the context",
            "AlreadyInContext",
            |w| {
                w.api
                    .init_from_host(&w.cw, &w.w, Data::F32(vec![1.0; N]))
                    .map(drop)
            },
        ),
        // Not hosted, or a contradicting mode.
        case("host_read of a device-only node", "NotHosted", |w| {
            w.api.host_read(&w.g, DType::F32).map(drop)
        }),
        case("host_write of a device-only node", "NotHosted", |w| {
            w.api.host_write(&w.g, Data::F32(vec![1.0; N]))
        }),
        case("to_host of a device-only node", "NotHosted", |w| {
            let c = w.grad.context().clone();
            w.api.to_host(&c, &w.g).map(drop)
        }),
        case(
            "init_from_host of a device-only node",
            "ModeConflict",
            |w| {
                w.api
                    .init_from_host(&w.r01, &w.g, Data::F32(vec![1.0; N]))
                    .map(drop)
            },
        )
        // A raw host writes the host value first (no message does), which refuses it.
        .on("messages", "NotHosted"),
        case("refining a virtual node to storage", "ModeConflict", |_| {
            let v = TensorNode::new("v", DType::F32, [N]).with_mode(MemoryMode::Virtual)?;
            v.refine_mode(MemoryMode::NeverVirtual).map(drop)
        }),
        case("linking a virtual node", "NotMaterialized", |w| {
            let v = TensorNode::new("v", DType::F32, [N]).with_mode(MemoryMode::Virtual)?;
            w.api.link(&w.r00, kernels::fill(&v, 1.0)?).map(drop)
        }),
        case("linking a local node", "NotMaterialized", |w| {
            let l = TensorNode::new("l", DType::F32, [N]).with_mode(MemoryMode::Local)?;
            w.api.link(&w.r00, kernels::fill(&l, 1.0)?).map(drop)
        }),
        // Finalized contexts.
        case("link into a finalized context", "ContextFinalized", |w| {
            let c = w.gone.context().clone();
            w.api.link(&c, kernels::fill(&w.g, 1.0)?).map(drop)
        }),
        case(
            "schedule a routine of a finalized context",
            "ContextFinalized",
            |w| {
                let r = w.gone.clone();
                w.api.schedule(&r).map(drop)
            },
        ),
        case("read from a finalized context", "ContextFinalized", |w| {
            let c = w.gone.context().clone();
            w.api.read(&c, &w.g, DType::F32).map(drop)
        }),
        case("finalize a finalized context", "ContextFinalized", |w| {
            let c = w.gone.context().clone();
            w.api.finalize(&c)
        }),
        case(
            "init_from_host into a finalized context",
            "ContextFinalized",
            |w| {
                let c = w.gone.context().clone();
                w.api
                    .init_from_host(&c, &w.w, Data::F32(vec![1.0; N]))
                    .map(drop)
            },
        ),
        case(
            "device_to_device from a finalized context",
            "ContextFinalized",
            |w| {
                let (src, dst) = (w.gone.context().clone(), w.merge.context().clone());
                w.api
                    .device_to_device(&w.g, &src, &dst, MergeBufferUse::Copy)
                    .map(drop)
            },
        ),
        case(
            "device_to_device into a finalized context",
            "ContextFinalized",
            |w| {
                let (src, dst) = (w.grad.context().clone(), w.gone.context().clone());
                w.api
                    .device_to_device(&w.g, &src, &dst, MergeBufferUse::No)
                    .map(drop)
            },
        ),
        case(
            "finalize a context with a live child",
            "ContextInUse",
            |w| {
                let c = w.cw.clone();
                w.api.finalize(&c)
            },
        ),
        // Merge buffers.
        case(
            "merging from an empty merge buffer",
            "MergeBufferMismatch",
            |w| {
                let r = w.m01.clone();
                w.api.schedule(&r).map(drop)
            },
        ),
        Case {
            setup: Some(|w| {
                let (src, dst) = (w.fill_s.context().clone(), w.m01.context().clone());
                w.api
                    .device_to_device(&w.s, &src, &dst, MergeBufferUse::Copy)
                    .unwrap();
                w.api.quiesce().unwrap();
            }),
            ..case(
                "merging while the merge buffer holds another node",
                "MergeBufferMismatch",
                |w| {
                    let r = w.m01.clone();
                    w.api.schedule(&r).map(drop)
                },
            )
        },
        case(
            "streaming another node to a merge routine",
            "MergeBufferMismatch",
            |w| {
                let (src, dst) = (w.fill_s.context().clone(), w.m01.context().clone());
                w.api
                    .device_to_device(
                        &w.s,
                        &src,
                        &dst,
                        MergeBufferUse::StreamingFor(w.m01.clone()),
                    )
                    .map(drop)
            },
        ),
        case(
            "streaming to a routine on another stream",
            "InvalidRoutine",
            |w| {
                let src = w.grad.context().clone();
                let r = w.m01.clone();
                w.api
                    .device_to_device(&w.g, &src, &w.r00, MergeBufferUse::StreamingFor(r))
                    .map(drop)
            },
        ),
        case(
            "streaming to a routine that reads no merge buffer",
            "InvalidRoutine",
            |w| {
                let (src, dst) = (w.grad.context().clone(), w.plain01.context().clone());
                let r = w.plain01.clone();
                w.api
                    .device_to_device(&w.g, &src, &dst, MergeBufferUse::StreamingFor(r))
                    .map(drop)
            },
        ),
        case(
            "streaming a buffer its consumer writes",
            "StreamingUnsupported",
            |w| {
                let c = w.merge.context().clone();
                let r = w.merge.clone();
                w.api
                    .device_to_device(&w.g, &c, &c, MergeBufferUse::StreamingFor(r))
                    .map(drop)
            },
        ),
        // Reading what nothing wrote.
        case(
            "a routine reading a buffer nothing wrote",
            "UninitialisedRead",
            |w| {
                let r = w.reads_fresh.clone();
                w.api.schedule(&r).map(drop)
            },
        ),
        case(
            "device_to_device of a buffer nothing wrote",
            "UninitialisedRead",
            |w| {
                let (src, dst) = (w.reads_fresh.context().clone(), w.merge.context().clone());
                w.api
                    .device_to_device(&w.fresh, &src, &dst, MergeBufferUse::Copy)
                    .map(drop)
            },
        ),
        // Sharing.
        case(
            "a second writer of a cross-stream-shared node",
            "SecondWriter",
            |w| w.api.link(&w.r01, kernels::fill(&w.s, 1.0)?).map(drop),
        ),
        // Sizes.
        case("a zero-size node", "InvalidSize", |w| {
            let z = TensorNode::new("empty", DType::F32, [0]);
            w.api.link(&w.r00, kernels::fill(&z, 1.0)?).map(drop)
        }),
        case("host_read of a zero-size hosted node", "InvalidSize", |w| {
            let z = TensorNode::new("empty", DType::F32, [4, 0])
                .with_mode(MemoryMode::hosted_changed_on_devices())?;
            w.api.host_read(&z, DType::F32).map(drop)
        }),
        case("a shape whose size overflows", "InvalidSize", |_| {
            let h = TensorNode::new("huge", DType::F32, [usize::MAX, 2]);
            kernels::fill(&h, 1.0).map(drop)
        }),
        case(
            "a node larger than the device limit",
            "PoolExhausted",
            |w| {
                let big = TensorNode::new("big", DType::F32, [1 << 20]);
                w.api.link(&w.r00, kernels::fill(&big, 1.0)?).map(drop)
            },
        ),
        // Another instance's contexts and routines (their ids mean other buffers here).
        case("a context of another instance", "ForeignContext", |w| {
            let mut other = w.api.another()?;
            let c = other.context(0, 0)?;
            let r = other.link(&c, kernels::fill(&w.g, 1.0)?)?;
            w.api.read(r.context(), &w.g, DType::F32).map(drop)
        }),
        case("a routine of another instance", "ForeignContext", |w| {
            let mut other = w.api.another()?;
            let c = other.context(0, 0)?;
            let r = other.link(&c, kernels::fill(&w.s, 1.0)?)?;
            w.api.schedule(&r).map(drop)
        }),
        // Unknown devices and streams, malformed routines.
        case("an unknown device", "NoSuchDevice", |w| {
            w.api.context(7, 0).map(drop)
        }),
        case("an unknown stream", "NoSuchStream", |w| {
            w.api.context(0, 7).map(drop)
        }),
        case("a routine naming a node twice", "InvalidRoutine", |w| {
            RoutineSpec::custom(
                "twice",
                vec![(w.g.clone(), Access::Read), (w.g.clone(), Access::Write)],
                None,
                |_| Ok(()),
            )
            .map(drop)
        }),
        case("a routine without parameters", "InvalidRoutine", |_| {
            RoutineSpec::custom("nothing", vec![], None, |_| Ok(())).map(drop)
        }),
        // Per-schedule bindings: declarations, then the values of a schedule.
        case("an index declared twice", "InvalidRoutine", |w| {
            stamp_spec(&w.log).with_index("t").map(drop)
        }),
        case("an index declared on a built-in", "InvalidRoutine", |w| {
            kernels::fill(&w.log, 1.0)?.with_index("t").map(drop)
        }),
        case(
            "more indices than a routine may declare",
            "InvalidRoutine",
            |w| {
                let mut spec = stamp_spec(&w.log);
                for i in 1..=kernels::MAX_INDICES {
                    spec = spec.with_index(&format!("i{i}"))?;
                }
                Ok(())
            },
        ),
        case(
            "a routine with an index scheduled without values",
            "MissingBinding",
            |w| w.api.schedule(&w.stamp.clone()).map(drop),
        ),
        case("a value for an undeclared index", "UnknownBinding", |w| {
            w.api
                .schedule_with(&w.stamp.clone(), Given::Pairs(&[("t", 1), ("u", 2)]))
                .map(drop)
        }),
        case("an index given twice", "DuplicateBinding", |w| {
            w.api
                .schedule_with(&w.stamp.clone(), Given::Pairs(&[("t", 1), ("t", 2)]))
                .map(drop)
        }),
        case(
            "a value out of its index's range",
            "BindingOutOfRange",
            |w| {
                w.api
                    .schedule_with(&w.stamp.clone(), Given::Pairs(&[("t", -1)]))
                    .map(drop)
            },
        ),
        case("incomplete bindings", "MissingBinding", |w| {
            let b = w.stamp.bindings();
            w.api
                .schedule_with(&w.stamp.clone(), Given::Bindings(b))
                .map(drop)
        }),
        case(
            "bindings of another routine naming an undeclared index",
            "UnknownBinding",
            |w| {
                let other = stamp_spec(&w.log).with_index("u")?;
                let b = other.bindings().with("t", 1)?.with("u", 2)?;
                w.api
                    .schedule_with(&w.stamp.clone(), Given::Bindings(b))
                    .map(drop)
            },
        ),
        case(
            "bindings of another routine with a value out of range",
            "BindingOutOfRange",
            |w| {
                let other = RoutineSpec::custom(
                    "wide",
                    vec![(w.log.clone(), Access::Write)],
                    None,
                    |_| Ok(()),
                )?
                .with_index_typed("t", kernels::IndexType::I64)?;
                let b = other.bindings().with("t", 1 << 40)?;
                w.api
                    .schedule_with(&w.stamp.clone(), Given::Bindings(b))
                    .map(drop)
            },
        ),
        case(
            "a streaming consumer with indices (it gets no values)",
            "MissingBinding",
            |w| {
                let (g, grad, sm) = (w.g.clone(), w.grad.clone(), w.stamp_merge.clone());
                w.api
                    .device_to_device(
                        &g,
                        grad.context(),
                        sm.context(),
                        MergeBufferUse::StreamingFor(sm.clone()),
                    )
                    .map(drop)
            },
        ),
    ];
    cases.extend(message_cases());
    cases
}

/// The messages runner of a world (rows limited to it run nowhere else).
fn raw(w: &mut World) -> &mut MessagesApi {
    w.api.messages().expect("a row of the messages runner")
}

/// An all-reduce of `g` from the merge context on d0s0 into `m01`'s on d0s1, valid but for
/// what `spoil` changes.
fn all_reduce(w: &mut World, spoil: impl FnOnce(&mut AllReduce)) -> Result<(), Error> {
    let (g, merge, m01) = (w.g.clone(), w.merge.clone(), w.m01.clone());
    let m = raw(w);
    let mut msg = AllReduce::new(
        vec![AllReduceStep::Reduce {
            chunk: 0,
            src: 0,
            dst: 1,
        }],
        vec![g],
        vec![merge.context().clone(), m01.context().clone()],
        vec![vec![merge], vec![m01]],
        vec![vec![], vec![]],
        Transfer::Copy,
    );
    spoil(&mut msg);
    tributary_actors::block_on(m.system().coordinator().send(msg))
        .map_err(|e| Error::ShutDown(e.to_string()))?
        .map(drop)
}

fn message_cases() -> Vec<Case> {
    vec![
        // A context, routine or node sent to the actor of another device.
        message_case(
            "Link sent to another device's actor",
            "ForeignContext",
            |w| {
                let (ctx, spec) = (w.r00.clone(), kernels::fill(&w.g, 1.0)?);
                raw(w).ask(1, Link { ctx, spec })?.map(drop)
            },
        ),
        message_case(
            "Schedule sent to another device's actor",
            "ForeignContext",
            |w| {
                let r = w.fill_s.clone();
                let m = raw(w);
                let (msg, ticket) = Schedule::new(m.system(), r);
                m.ask(1, msg)?;
                ticket.event().map(drop)
            },
        ),
        message_case(
            "FromHost sent to another device's actor",
            "ForeignContext",
            |w| {
                let (ctx, node) = (w.cw.clone(), w.w.clone());
                let m = raw(w);
                let (msg, ticket) = FromHost::new(m.system(), ctx, node);
                m.ask(1, msg)?;
                ticket.event().map(drop)
            },
        ),
        message_case(
            "ToHost sent to another device's actor",
            "ForeignContext",
            |w| {
                let (ctx, node) = (w.cw.clone(), w.w.clone());
                let m = raw(w);
                let (msg, ticket) = ToHost::new(m.system(), ctx, node);
                m.ask(1, msg)?;
                ticket.event().map(drop)
            },
        ),
        message_case(
            "Finalize sent to another device's actor",
            "ForeignContext",
            |w| {
                let ctx = w.plain01.context().clone();
                let m = raw(w);
                let msg = Finalize::new(ctx);
                m.ask(1, msg)?
            },
        ),
        message_case(
            "InitFromHost sent to another device's actor",
            "ForeignContext",
            |w| {
                let (ctx, node) = (w.r01.clone(), w.w.clone());
                let m = raw(w);
                let msg = InitFromHost::new(ctx, node);
                m.ask(1, msg)?.map(drop)
            },
        ),
        // Messages without the checks `System` does before sending them.
        message_case(
            "InitFromHost of a node that is not hosted",
            "NotHosted",
            |w| {
                let (ctx, node) = (w.r01.clone(), w.g.clone());
                let m = raw(w);
                let msg = InitFromHost::new(ctx, node);
                m.ask(0, msg)?.map(drop)
            },
        ),
        message_case(
            "StreamLastEvent of a stream the device does not have",
            "NoSuchStream",
            |w| raw(w).ask(0, StreamLastEvent { stream: 2 })?.map(drop),
        ),
        message_case(
            "DeviceToDevice from a device the system does not have",
            "UnknownDevice",
            |w| {
                let other = tributary_actors::System::builder().cpu_devices(3).spawn()?;
                let src = other.context(2, 0)?;
                let src = other.link(&src, kernels::fill(&w.g, 1.0)?)?;
                let src = src.routine().context().clone();
                other.shutdown()?;
                let dst = w.merge.context().clone();
                w.api
                    .device_to_device(&w.g.clone(), &src, &dst, MergeBufferUse::Copy)
                    .map(drop)
            },
        ),
        message_case("RefineNode contradicting the mode", "ModeConflict", |w| {
            let node = w.g.clone();
            let m = raw(w);
            let msg = RefineNode {
                node,
                mode: MemoryMode::Virtual,
            };
            tributary_actors::block_on(m.system().coordinator().send(msg))
                .map_err(|e| Error::ShutDown(e.to_string()))?
                .map(drop)
        }),
        message_case(
            "CreateNode of a virtual node refined to storage",
            "ModeConflict",
            |w| {
                let m = raw(w);
                let msg = CreateNode {
                    label: "v".into(),
                    dtype: DType::F32,
                    shape: [N].into(),
                    mode: MemoryMode::Virtual,
                };
                let v = tributary_actors::block_on(m.system().coordinator().send(msg))
                    .map_err(|e| Error::ShutDown(e.to_string()))??;
                let msg = RefineNode {
                    node: v,
                    mode: MemoryMode::NeverVirtual,
                };
                tributary_actors::block_on(m.system().coordinator().send(msg))
                    .map_err(|e| Error::ShutDown(e.to_string()))?
                    .map(drop)
            },
        ),
        // All-reduce messages: checked as a whole before any step is sent.
        message_case(
            "an all-reduce with fewer merge lists than contexts",
            "LengthMismatch",
            |w| all_reduce(w, |m| drop(m.merge.pop())),
        ),
        message_case(
            "an all-reduce with fewer scale lists than contexts",
            "LengthMismatch",
            |w| all_reduce(w, |m| m.scale.clear()),
        ),
        message_case(
            "an all-reduce with a merge routine missing for a chunk",
            "LengthMismatch",
            |w| all_reduce(w, |m| m.merge[1].clear()),
        ),
        message_case(
            "an all-reduce step naming a context it does not have",
            "IndexOutOfRange",
            |w| {
                all_reduce(w, |m| {
                    m.steps.push(AllReduceStep::Broadcast {
                        chunk: 0,
                        src: 1,
                        dst: 5,
                    })
                })
            },
        ),
        message_case(
            "an all-reduce step naming a chunk it does not have",
            "IndexOutOfRange",
            |w| {
                all_reduce(w, |m| {
                    m.steps.insert(
                        0,
                        AllReduceStep::Reduce {
                            chunk: 3,
                            src: 0,
                            dst: 1,
                        },
                    )
                })
            },
        ),
        message_case(
            "an all-reduce scale step without scale routines",
            "IndexOutOfRange",
            |w| {
                all_reduce(w, |m| {
                    m.steps.push(AllReduceStep::Scale { chunk: 0, ctx: 1 })
                })
            },
        ),
        message_case(
            "an all-reduce merge routine on another stream than its context",
            "InvalidRoutine",
            |w| all_reduce(w, |m| m.merge.swap(0, 1)),
        ),
        message_case(
            "an all-reduce of a chunk a context does not hold",
            "NodeNotInContext",
            |w| {
                let r01 = w.r01.clone();
                all_reduce(w, |m| m.contexts[1] = r01)
            },
        ),
    ]
}

/// Runs every row of the table (those limited to another runner excepted) on fresh worlds
/// of `make`'s runner.
fn run_table(make: fn() -> Box<dyn Api>) {
    let runner = make().name();
    let _watchdog = Watchdog::arm(Duration::from_secs(600), move || {
        format!("bad input table ({runner})")
    });
    let table: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.only.is_none_or(|r| r == runner))
        .collect();
    let mut failures = Vec::new();
    for c in &table {
        let expect = c.expect_on(runner);
        let mut w = world(make());
        if let Some(setup) = c.setup {
            setup(&mut w);
        }
        let before = w.api.snapshot();
        match (c.misuse)(&mut w) {
            Ok(()) => failures.push(format!("{}: accepted, expected {expect}", c.what)),
            Err(e) => {
                let got = describe(&e);
                if !got.starts_with(&format!("{expect}:")) {
                    failures.push(format!("{}: expected {expect}, got {got}", c.what));
                    continue;
                }
                if w.api.snapshot() != before {
                    failures.push(format!("{}: the refused call changed the state", c.what));
                    continue;
                }
                probe(&mut w);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{runner}: {} of {} rows failed:\n{}",
        failures.len(),
        table.len(),
        failures.join("\n")
    );
}

fn engine() -> Box<dyn Api> {
    Box::new(EngineApi::new().expect("engine"))
}

fn system() -> Box<dyn Api> {
    Box::new(SystemApi(bad_input::system().expect("system")))
}

fn messages() -> Box<dyn Api> {
    Box::new(MessagesApi(bad_input::system().expect("system")))
}

#[test]
fn every_misuse_of_the_engine_gets_its_error_and_changes_nothing() {
    run_table(engine);
}

#[test]
fn every_misuse_of_the_system_gets_its_error_and_changes_nothing() {
    run_table(system);
}

#[test]
fn every_misuse_in_raw_messages_gets_its_error_and_the_actors_serve_on() {
    run_table(messages);
}

#[test]
fn the_world_itself_passes_the_probe() {
    // Without a misuse the probe holds, on every runner: the rows are measured against it.
    for make in [engine, system, messages] {
        probe(&mut world(make()));
    }
}

#[test]
fn a_configuration_without_streams_is_refused() {
    let err = Engine::cpu(EngineConfig {
        streams_per_device: 0,
        ..EngineConfig::default()
    })
    .err()
    .expect("refused");
    assert!(
        matches!(err, Error::InvalidConfig { ref setting, ref value, .. } if setting == "streams" && value == "0"),
        "{err}"
    );
}
