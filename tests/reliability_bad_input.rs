//! Bad input: every misuse of the public API, with the error variant it must get.
//!
//! Each row runs on a fresh, quiescent [`World`]: optional set-up, then the misuse, which
//! must fail with exactly the expected variant; then nothing may have changed (memory
//! statistics, protocol table sizes), and a probe of later operations must still work and
//! give the right values, down to every context finalizing and memory returning to the
//! device-wide buffers only.
//!
//! Not reachable through the engine API, so not in the table: scheduling on a shut-down
//! system (the engine has no shutdown; dropping it leaves no handle to call), and a stream
//! whose worker died (in `reliability_faults.rs`: work scheduled there fails with the
//! death as root cause).

mod common;

use std::time::Duration;

use common::{program::describe, watchdog::Watchdog};
use tributary::{
    kernels::{self, Access, RoutineSpec},
    memory::{PoolConfig, PoolKind},
    protocol::{Context, Routine},
    DType, Engine, EngineConfig, Error, MemoryMode, MergeBufferUse, Sharing, TensorNode,
};

const N: usize = 100;
const BOUND: Duration = Duration::from_secs(20);

/// A small, quiescent system with something in every table.
struct World {
    e: Engine,
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
}

fn f32_node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

fn world() -> World {
    let mut e = Engine::cpu(EngineConfig {
        devices: 2,
        streams_per_device: 2,
        pools: PoolConfig {
            pool_bytes: 64 << 10,
            limit_bytes: Some(1 << 20),
            ..PoolConfig::default()
        },
    })
    .expect("engine");
    let w = f32_node("w", MemoryMode::hosted_changed_on_devices());
    let g = f32_node("g", MemoryMode::on_device());
    let s = f32_node("s", MemoryMode::OnDevice(Sharing::SharedCrossStreams));
    let i = TensorNode::new("i", DType::I32, [N]);
    let small = TensorNode::new("small", DType::F32, [N / 2]);
    let r00 = e.context(0, 0).unwrap();
    let r01 = e.context(0, 1).unwrap();
    let r10 = e.context(1, 0).unwrap();
    let cw = e.init_from_host(&r00, &w, &[1.0f32; N]).unwrap();
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
    e.schedule(&fill_s).unwrap();
    e.schedule(&grad).unwrap();
    e.schedule(&gone).unwrap();
    e.finalize(gone.context()).unwrap();
    e.sync_all_timeout(BOUND).unwrap();
    World {
        e,
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
    }
}

/// Later operations work and give the right values; everything finalizes; only the
/// device-wide buffer of `s` on d0 stays.
fn probe(wd: &mut World) {
    let e = &mut wd.e;
    e.schedule(&wd.fill_s).unwrap();
    e.schedule(&wd.bump).unwrap();
    assert_eq!(
        e.host_read::<f32>(&wd.w).unwrap(),
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
        e.read::<f32>(wd.merge.context(), &wd.g).unwrap(),
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
        e.read::<f32>(wd.m01.context(), &wd.g).unwrap(),
        vec![3.0; N]
    );
    e.schedule(&wd.plain01).unwrap();
    assert_eq!(
        e.read::<f32>(wd.plain01.context(), &wd.small).unwrap(),
        vec![4.0; N / 2]
    );
    for c in [
        wd.plain01.context(),
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
    e.sync_all_timeout(BOUND).unwrap();
    let (tables, _) = e.table_sizes();
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

/// One row: what is misused, the variant it must get, an optional set-up, the misuse.
struct Case {
    what: &'static str,
    expect: &'static str,
    setup: Option<fn(&mut World)>,
    misuse: Misuse,
}

const fn case(what: &'static str, expect: &'static str, misuse: Misuse) -> Case {
    Case {
        what,
        expect,
        setup: None,
        misuse,
    }
}

fn cases() -> Vec<Case> {
    vec![
        // Wrong dtype.
        case("host_write with the wrong dtype", "DTypeMismatch", |w| {
            w.e.host_write(&w.w, &[1.0f64; N])
        }),
        case("host_read with the wrong dtype", "DTypeMismatch", |w| {
            w.e.host_read::<i32>(&w.w).map(drop)
        }),
        case("read with the wrong dtype", "DTypeMismatch", |w| {
            w.e.read::<f64>(&w.cw, &w.w).map(drop)
        }),
        case(
            "init_from_host with the wrong dtype",
            "DTypeMismatch",
            |w| w.e.init_from_host(&w.r01, &w.w, &[1i32; N]).map(drop),
        ),
        case("a kernel mixing dtypes", "DTypeMismatch", |w| {
            kernels::add_into(&w.g, &w.i).map(drop)
        }),
        case("a float kernel on i32", "DTypeMismatch", |w| {
            kernels::scale(&w.i, &w.i, 2.0).map(drop)
        }),
        // Wrong shape or size.
        case("host_write with the wrong length", "SizeMismatch", |w| {
            w.e.host_write(&w.w, &[1.0f32; N - 1])
        }),
        case(
            "init_from_host with the wrong length",
            "SizeMismatch",
            |w| w.e.init_from_host(&w.r01, &w.w, &[1.0f32; N + 1]).map(drop),
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
            |w| w.e.read::<f32>(&w.r00, &w.g).map(drop),
        ),
        case(
            "to_host of a node not in the context",
            "NodeNotInContext",
            |w| w.e.to_host(&w.r01, &w.w).map(drop),
        ),
        case(
            "from_host of a node not in the context",
            "NodeNotInContext",
            |w| w.e.from_host(&w.r01, &w.w).map(drop),
        ),
        case(
            "device_to_device from a context without the node",
            "NodeNotInContext",
            |w| {
                let dst = w.merge.context().clone();
                w.e.device_to_device(&w.g, &w.r00, &dst, MergeBufferUse::No)
                    .map(drop)
            },
        ),
        case(
            "device_to_device into a context without the node",
            "NodeNotInContext",
            |w| {
                let src = w.grad.context().clone();
                w.e.device_to_device(&w.g, &src, &w.r01, MergeBufferUse::No)
                    .map(drop)
            },
        ),
        case(
            "init_from_host of a node already in the context",
            "AlreadyInContext",
            |w| w.e.init_from_host(&w.cw, &w.w, &[1.0f32; N]).map(drop),
        ),
        // Not hosted, or a contradicting mode.
        case("host_read of a device-only node", "NotHosted", |w| {
            w.e.host_read::<f32>(&w.g).map(drop)
        }),
        case("host_write of a device-only node", "NotHosted", |w| {
            w.e.host_write(&w.g, &[1.0f32; N])
        }),
        case("to_host of a device-only node", "NotHosted", |w| {
            let c = w.grad.context().clone();
            w.e.to_host(&c, &w.g).map(drop)
        }),
        case(
            "init_from_host of a device-only node",
            "ModeConflict",
            |w| w.e.init_from_host(&w.r01, &w.g, &[1.0f32; N]).map(drop),
        ),
        case("refining a virtual node to storage", "ModeConflict", |_| {
            let v = TensorNode::new("v", DType::F32, [N]).with_mode(MemoryMode::Virtual)?;
            v.refine_mode(MemoryMode::NeverVirtual).map(drop)
        }),
        case("linking a virtual node", "NotMaterialized", |w| {
            let v = TensorNode::new("v", DType::F32, [N]).with_mode(MemoryMode::Virtual)?;
            w.e.link(&w.r00, kernels::fill(&v, 1.0)?).map(drop)
        }),
        case("linking a local node", "NotMaterialized", |w| {
            let l = TensorNode::new("l", DType::F32, [N]).with_mode(MemoryMode::Local)?;
            w.e.link(&w.r00, kernels::fill(&l, 1.0)?).map(drop)
        }),
        // Finalized contexts.
        case("link into a finalized context", "ContextFinalized", |w| {
            let c = w.gone.context().clone();
            w.e.link(&c, kernels::fill(&w.g, 1.0)?).map(drop)
        }),
        case(
            "schedule a routine of a finalized context",
            "ContextFinalized",
            |w| {
                let r = w.gone.clone();
                w.e.schedule(&r).map(drop)
            },
        ),
        case("read from a finalized context", "ContextFinalized", |w| {
            let c = w.gone.context().clone();
            w.e.read::<f32>(&c, &w.g).map(drop)
        }),
        case("finalize a finalized context", "ContextFinalized", |w| {
            let c = w.gone.context().clone();
            w.e.finalize(&c)
        }),
        case(
            "init_from_host into a finalized context",
            "ContextFinalized",
            |w| {
                let c = w.gone.context().clone();
                w.e.init_from_host(&c, &w.w, &[1.0f32; N]).map(drop)
            },
        ),
        case(
            "device_to_device from a finalized context",
            "ContextFinalized",
            |w| {
                let (src, dst) = (w.gone.context().clone(), w.merge.context().clone());
                w.e.device_to_device(&w.g, &src, &dst, MergeBufferUse::Copy)
                    .map(drop)
            },
        ),
        case(
            "device_to_device into a finalized context",
            "ContextFinalized",
            |w| {
                let (src, dst) = (w.grad.context().clone(), w.gone.context().clone());
                w.e.device_to_device(&w.g, &src, &dst, MergeBufferUse::No)
                    .map(drop)
            },
        ),
        case(
            "finalize a context with a live child",
            "ContextInUse",
            |w| {
                let c = w.cw.clone();
                w.e.finalize(&c)
            },
        ),
        // Merge buffers.
        case(
            "merging from an empty merge buffer",
            "MergeBufferMismatch",
            |w| {
                let r = w.m01.clone();
                w.e.schedule(&r).map(drop)
            },
        ),
        Case {
            what: "merging while the merge buffer holds another node",
            expect: "MergeBufferMismatch",
            setup: Some(|w| {
                let (src, dst) = (w.fill_s.context().clone(), w.m01.context().clone());
                w.e.device_to_device(&w.s, &src, &dst, MergeBufferUse::Copy)
                    .unwrap();
                w.e.sync_all_timeout(BOUND).unwrap();
            }),
            misuse: |w| {
                let r = w.m01.clone();
                w.e.schedule(&r).map(drop)
            },
        },
        case(
            "streaming another node to a merge routine",
            "MergeBufferMismatch",
            |w| {
                let (src, dst) = (w.fill_s.context().clone(), w.m01.context().clone());
                w.e.device_to_device(
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
                w.e.device_to_device(&w.g, &src, &w.r00, MergeBufferUse::StreamingFor(r))
                    .map(drop)
            },
        ),
        case(
            "streaming to a routine that reads no merge buffer",
            "InvalidRoutine",
            |w| {
                let (src, dst) = (w.grad.context().clone(), w.plain01.context().clone());
                let r = w.plain01.clone();
                w.e.device_to_device(&w.g, &src, &dst, MergeBufferUse::StreamingFor(r))
                    .map(drop)
            },
        ),
        case(
            "streaming a buffer its consumer writes",
            "StreamingUnsupported",
            |w| {
                let c = w.merge.context().clone();
                let r = w.merge.clone();
                w.e.device_to_device(&w.g, &c, &c, MergeBufferUse::StreamingFor(r))
                    .map(drop)
            },
        ),
        // Sharing.
        case(
            "a second writer of a cross-stream-shared node",
            "SecondWriter",
            |w| w.e.link(&w.r01, kernels::fill(&w.s, 1.0)?).map(drop),
        ),
        // Sizes.
        case("a zero-size node", "InvalidSize", |w| {
            let z = TensorNode::new("empty", DType::F32, [0]);
            w.e.link(&w.r00, kernels::fill(&z, 1.0)?).map(drop)
        }),
        case("host_read of a zero-size hosted node", "InvalidSize", |w| {
            let z = TensorNode::new("empty", DType::F32, [4, 0])
                .with_mode(MemoryMode::hosted_changed_on_devices())?;
            w.e.host_read::<f32>(&z).map(drop)
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
                w.e.link(&w.r00, kernels::fill(&big, 1.0)?).map(drop)
            },
        ),
        // Another engine's contexts and routines (their ids mean other buffers here).
        case("a context of another engine", "Unknown", |w| {
            let mut other = Engine::cpu(EngineConfig::default())?;
            let c = other.context(0, 0)?;
            let r = other.link(&c, kernels::fill(&w.g, 1.0)?)?;
            w.e.read::<f32>(r.context(), &w.g).map(drop)
        }),
        case("a routine of another engine", "Unknown", |w| {
            let mut other = Engine::cpu(EngineConfig::default())?;
            let c = other.context(0, 0)?;
            let r = other.link(&c, kernels::fill(&w.s, 1.0)?)?;
            w.e.schedule(&r).map(drop)
        }),
        // Unknown devices and streams, malformed routines.
        case("an unknown device", "Unknown", |w| {
            w.e.context(7, 0).map(drop)
        }),
        case("an unknown stream", "Unknown", |w| {
            w.e.context(0, 7).map(drop)
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
    ]
}

#[test]
fn every_misuse_gets_its_error_and_changes_nothing() {
    let _watchdog = Watchdog::arm(Duration::from_secs(300), || "bad input table".into());
    let table = cases();
    let mut failures = Vec::new();
    for c in &table {
        let mut w = world();
        if let Some(setup) = c.setup {
            setup(&mut w);
        }
        let (memory, tables) = (w.e.memory_stats(), w.e.table_sizes());
        match (c.misuse)(&mut w) {
            Ok(()) => failures.push(format!("{}: accepted, expected {}", c.what, c.expect)),
            Err(e) => {
                let got = describe(&e);
                if !got.starts_with(&format!("{}:", c.expect)) {
                    failures.push(format!("{}: expected {}, got {got}", c.what, c.expect));
                    continue;
                }
                if w.e.memory_stats() != memory || w.e.table_sizes() != tables {
                    failures.push(format!("{}: the refused call changed the state", c.what));
                    continue;
                }
                probe(&mut w);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        table.len(),
        failures.join("\n")
    );
}

#[test]
fn the_world_itself_passes_the_probe() {
    // Without a misuse the probe holds: the table's rows are measured against it.
    probe(&mut world());
}

#[test]
fn a_configuration_without_streams_is_refused() {
    let err = Engine::cpu(EngineConfig {
        streams_per_device: 0,
        ..EngineConfig::default()
    })
    .err()
    .expect("refused");
    assert!(matches!(err, Error::Unknown { .. }), "{err}");
}
