//! Fault injection (DESIGN.md §3, rule 6): a kernel that panics, a copy that fails (device
//! to device, into the merge buffer, to and from the host), a pool that cannot be created
//! or would exceed the device limit, a stream whose worker dies.
//!
//! For each: the failure reaches exactly the operations that depend on it, as
//! `Error::Failed` naming the root cause; unrelated work completes with correct values;
//! every wait is bounded and the tests assert the bound is never hit; after the failed
//! work is finalized and synced, memory accounting is back to its baseline.
//!
//! And a Vulkan device that stops answering or is lost (injected into its waits): its
//! operation fails with `device lost` after `VulkanConfig::device_timeout`, dependents on
//! other devices with that root cause, what it may still use is leaked, and the other
//! device and other backends keep serving.

use common::watchdog::Watchdog;
use std::{sync::Arc, time::Duration};
use support::{all, shared, slow_fill};
use tributary::{
    backend::{
        cpu::CpuBackend,
        fault::{Fault, FaultBackend, FaultRule, FaultRules, Target, WorkKind},
    },
    kernels,
    memory::{PoolConfig, PoolKind},
    protocol::Context,
    DType, DeviceId, Engine, Error, Event, Failure, MemoryMode, MergeBufferUse, StreamId,
    TensorNode,
};
use tributary_testkit::{common, support};

const N: usize = 100; // 400 bytes: not a multiple of the pool alignment
const BOUND: Duration = Duration::from_secs(20);

fn engine(devices: usize, streams: usize, rules: &FaultRules, pools: PoolConfig) -> Engine {
    let cpu = CpuBackend::new(DeviceId(0), devices);
    let backend = FaultBackend::new(Arc::new(cpu), rules.clone());
    Engine::with_backend(Arc::new(backend), streams, pools).expect("engine")
}

fn small_pools() -> PoolConfig {
    PoolConfig {
        pool_bytes: 1 << 16,
        ..PoolConfig::default()
    }
}

fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

/// [`node`], declared zero-initialised (an accumulator: its fresh buffers may be read).
fn zeroed_node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new_zeroed(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

fn stream(device: u32, index: u32) -> StreamId {
    StreamId {
        device: DeviceId(device),
        index,
    }
}

/// Waits for `e`, which must succeed within the bound.
fn ok(e: &Event) {
    match e.wait_timeout(BOUND) {
        Ok(()) => {}
        Err(err @ Error::Timeout { .. }) => panic!("a wait hit its bound: {err}"),
        Err(err) => panic!("event {e} failed: {err}"),
    }
}

/// Waits for `e`, which must fail within the bound; its root cause.
fn failed(e: &Event) -> Failure {
    match e.wait_timeout(BOUND) {
        Err(Error::Failed(f)) => (*f).clone(),
        Err(err @ Error::Timeout { .. }) => panic!("a wait hit its bound: {err}"),
        other => panic!("event {e} should have failed, got {other:?}"),
    }
}

/// The root cause of a failed call.
fn root<T: std::fmt::Debug>(r: tributary::Result<T>) -> Failure {
    match r {
        Err(Error::Failed(f)) => (*f).clone(),
        other => panic!("expected a failed dependency, got {other:?}"),
    }
}

/// Finalizes `ctxs` (children before parents), waits for everything, and checks that
/// general pools hold exactly `expected_live[d]` bytes on device `d`, with nothing pending.
fn teardown(e: &mut Engine, ctxs: &[&Context], expected_live: &[u64]) {
    teardown_quarantined(e, ctxs, expected_live, &vec![0; expected_live.len()]);
}

/// As [`teardown`], with `pending[d]` bytes still waiting on device `d` for operations that
/// will never complete (a dead stream's).
fn teardown_quarantined(e: &mut Engine, ctxs: &[&Context], expected_live: &[u64], pending: &[u64]) {
    for c in ctxs.iter().rev() {
        if e.is_live(c) {
            e.finalize(c).expect("finalize");
        }
    }
    // Failures of the last operations are expected in these tests; hangs are not.
    if let Err(err @ Error::Timeout { .. }) = e.sync_all_timeout(BOUND) {
        panic!("sync hit its bound: {err}");
    }
    for ((stats, &want), &pending) in e.memory_stats().iter().zip(expected_live).zip(pending) {
        let general: u64 = stats
            .per_pool
            .iter()
            .filter(|p| p.kind == PoolKind::General)
            .map(|p| p.live_bytes)
            .sum();
        assert_eq!(general, want, "live bytes on {}: {stats:?}", stats.device);
        assert_eq!(stats.pending_free_bytes, pending, "{stats:?}");
    }
    let (tables, _) = e.table_sizes();
    assert!(tables.iter().all(|t| t.contexts == 0), "{tables:?}");
}

fn aligned(bytes: u64) -> u64 {
    bytes.div_ceil(64) * 64
}

#[test]
fn panicking_kernel_fails_exactly_its_dependents() {
    let _w = Watchdog::arm(Duration::from_secs(120), || "panicking kernel test".into());
    let rules = FaultRules::default();
    let mut e = engine(2, 2, &rules, small_pools());
    let x = node("boomx", shared());
    let (y, u, z, busy) = (
        node("y", MemoryMode::on_device()),
        zeroed_node("u", MemoryMode::on_device()), // accumulated into
        node("z", MemoryMode::on_device()),
        node("busy", MemoryMode::on_device()),
    );
    let h = node("h", MemoryMode::hosted_changed_on_devices());
    let (a0, b0, a1) = (
        e.context(0, 0).unwrap(),
        e.context(0, 1).unwrap(),
        e.context(1, 0).unwrap(),
    );
    let panic_rule = rules.add(FaultRule::once(
        Target::work().label("fill(boomx)").stream(stream(0, 0)),
        Fault::Panic("injected kernel panic".into()),
    ));

    let slow = e.link(&a0, slow_fill(&busy, 1.0)).unwrap();
    let boom = e
        .link(slow.context(), kernels::fill(&x, 1.0).unwrap())
        .unwrap();
    let dep = e.link(&b0, kernels::copy(&y, &x).unwrap()).unwrap(); // RAW across streams
    let dep2 = e
        .link(dep.context(), kernels::add_into(&u, &y).unwrap())
        .unwrap(); // transitively
    let unrelated = e.link(&b0, kernels::fill(&z, 8.0).unwrap()).unwrap();
    let x1 = e.link(&a1, kernels::fill(&x, 0.0).unwrap()).unwrap();
    let r1 = e
        .link(x1.context(), kernels::copy(&y, &x).unwrap())
        .unwrap();
    let to_h = e
        .link(boom.context(), kernels::copy(&h, &x).unwrap())
        .unwrap();

    ok(&e.schedule(&x1).unwrap());
    let ev_slow = e.schedule(&slow).unwrap();
    let ev_boom = e.schedule(&boom).unwrap();
    let ev_dep = e.schedule(&dep).unwrap();
    let ev_dep2 = e.schedule(&dep2).unwrap();
    let ev_unrelated = e.schedule(&unrelated).unwrap();
    let ev_copy = e
        .device_to_device(&x, boom.context(), x1.context(), MergeBufferUse::No)
        .unwrap()
        .expect("a copy between devices");
    let ev_r1 = e.schedule(&r1).unwrap();
    let ev_h = e.schedule(&to_h).unwrap();

    ok(&ev_slow);
    let cause = failed(&ev_boom);
    assert_eq!(rules.hits(panic_rule), 1);
    assert_eq!(cause.operation, "fill(boomx)");
    assert_eq!((cause.stream, cause.seq), (stream(0, 0), ev_boom.seq()));
    assert!(cause.message.contains("injected kernel panic"), "{cause}");
    // Every dependent, on another stream, another device, the host, names the root cause.
    for ev in [&ev_dep, &ev_dep2, &ev_copy, &ev_r1, &ev_h] {
        assert_eq!(failed(ev), cause, "dependent {ev}");
    }
    assert_eq!(root(e.host_read::<f32>(&h)), cause);
    assert_eq!(root(e.read::<f32>(boom.context(), &x)), cause);
    // Unrelated work on the dependents' stream completed with the right values.
    ok(&ev_unrelated);
    assert!(all(&e.read::<f32>(unrelated.context(), &z).unwrap(), 8.0));
    assert!(all(&e.read::<f32>(slow.context(), &busy).unwrap(), 1.0));

    // Work that only had to wait for the failed kernel (a later writer of x) succeeds and
    // heals x: its readers succeed again.
    let heal = e
        .link(boom.context(), kernels::fill(&x, 3.0).unwrap())
        .unwrap();
    ok(&e.schedule(&heal).unwrap());
    ok(&e.schedule(&dep).unwrap());
    assert!(all(&e.read::<f32>(dep.context(), &y).unwrap(), 3.0));
    // u += y still fails: u itself was never produced by the failed u += y, and stays so
    // until something writes it.
    assert_eq!(failed(&e.schedule(&dep2).unwrap()), cause);
    let reset_u = e
        .link(dep2.context(), kernels::fill(&u, 0.5).unwrap())
        .unwrap();
    ok(&e.schedule(&reset_u).unwrap());
    ok(&e.schedule(&dep2).unwrap());
    assert!(all(&e.read::<f32>(dep2.context(), &u).unwrap(), 3.5));
    ok(&e.schedule(&to_h).unwrap());
    assert!(all(&e.host_read::<f32>(&h).unwrap(), 3.0));

    // Only the device-wide buffers of x (one per device) outlive their contexts.
    let x_bytes = aligned(N as u64 * 4);
    teardown(
        &mut e,
        &[
            &a0,
            &b0,
            &a1,
            slow.context(),
            boom.context(),
            dep.context(),
            unrelated.context(),
            x1.context(),
            r1.context(),
            dep2.context(),
            reset_u.context(),
            to_h.context(),
            heal.context(),
        ],
        &[x_bytes, x_bytes],
    );
}

#[test]
fn failed_copies_fail_their_readers_only() {
    let _w = Watchdog::arm(Duration::from_secs(120), || "failed copy test".into());
    let rules = FaultRules::default();
    let mut e = engine(2, 2, &rules, small_pools());
    let (g, y, z) = (
        // Accumulated into (`add_merge`) and read where nothing wrote it (`double`).
        zeroed_node("g", MemoryMode::on_device()),
        node("y", MemoryMode::on_device()),
        node("z", MemoryMode::on_device()),
    );
    let h = node("h", MemoryMode::hosted_changed_on_devices());
    let (c00, c10, c11) = (
        e.context(0, 0).unwrap(),
        e.context(1, 0).unwrap(),
        e.context(1, 1).unwrap(),
    );
    let src = e.link(&c00, kernels::fill(&g, 2.0).unwrap()).unwrap();
    let dst = e.link(&c10, kernels::fill(&g, 0.0).unwrap()).unwrap();
    let reader = e
        .link(dst.context(), kernels::copy(&y, &g).unwrap())
        .unwrap();
    let other = e.link(&c10, kernels::fill(&z, 5.0).unwrap()).unwrap();
    let overwrite = e
        .link(src.context(), kernels::fill(&g, 7.0).unwrap())
        .unwrap();
    ok(&e.schedule(&src).unwrap());
    ok(&e.schedule(&dst).unwrap());

    // 1. A device-to-device copy into the node's buffer fails.
    rules.add(FaultRule::once(
        Target::work().kind(WorkKind::Copy).stream(stream(1, 0)),
        Fault::Error("injected copy failure".into()),
    ));
    let ev_copy = e
        .device_to_device(&g, src.context(), dst.context(), MergeBufferUse::No)
        .unwrap()
        .unwrap();
    let ev_reader = e.schedule(&reader).unwrap();
    let ev_other = e.schedule(&other).unwrap();
    let ev_over = e.schedule(&overwrite).unwrap(); // waits for the copy's read (order only)
    let cause = failed(&ev_copy);
    assert!(cause.operation.starts_with("copy "), "{cause}");
    assert_eq!(cause.message, "injected copy failure");
    assert_eq!(cause.stream, stream(1, 0));
    assert_eq!(failed(&ev_reader), cause);
    ok(&ev_other);
    ok(&ev_over);
    assert!(all(&e.read::<f32>(other.context(), &z).unwrap(), 5.0));
    assert!(all(&e.read::<f32>(overwrite.context(), &g).unwrap(), 7.0));
    // The destination stream keeps serving: the same copy again succeeds.
    e.device_to_device(&g, src.context(), dst.context(), MergeBufferUse::No)
        .unwrap();
    ok(&e.schedule(&reader).unwrap());
    assert!(all(&e.read::<f32>(reader.context(), &y).unwrap(), 7.0));

    // 2. A copy into the merge buffer fails: its consumer fails, the next copy heals.
    let base = e.link(&c11, kernels::fill(&g, 1.0).unwrap()).unwrap();
    let merge = e
        .link(base.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    ok(&e.schedule(&base).unwrap());
    rules.add(FaultRule::once(
        Target::work().kind(WorkKind::Copy).stream(stream(1, 1)),
        Fault::Error("injected merge copy failure".into()),
    ));
    e.device_to_device(&g, src.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    let merge_cause = failed(&e.schedule(&merge).unwrap());
    assert_eq!(merge_cause.message, "injected merge copy failure");
    // The failed merge did not produce g: its readers fail until g is written again.
    assert_eq!(root(e.read::<f32>(merge.context(), &g)), merge_cause);
    ok(&e.schedule(&base).unwrap());
    e.device_to_device(&g, src.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    ok(&e.schedule(&merge).unwrap());
    assert!(all(&e.read::<f32>(merge.context(), &g).unwrap(), 8.0));

    // 3. An upload fails: the routine reading the node fails, the host array is intact.
    rules.add(FaultRule::once(
        Target::work().kind(WorkKind::FromHost),
        Fault::Error("injected upload failure".into()),
    ));
    let with_h = e.init_from_host(&c00, &h, &vec![4.0f32; N]).unwrap();
    let use_h = e.link(&with_h, kernels::copy(&y, &h).unwrap()).unwrap();
    let up_cause = failed(&e.schedule(&use_h).unwrap());
    assert_eq!(up_cause.message, "injected upload failure");
    assert!(up_cause.operation.starts_with("from_host"), "{up_cause}");
    assert!(all(&e.host_read::<f32>(&h).unwrap(), 4.0));
    ok(&e.from_host(&with_h, &h).unwrap());
    ok(&e.schedule(&use_h).unwrap());
    assert!(all(&e.read::<f32>(use_h.context(), &y).unwrap(), 4.0));

    // 4. A download fails: the host read fails with it, and keeps failing (the value never
    // arrived) until a new device value is transferred.
    let double = e.link(&with_h, kernels::add_into(&h, &g).unwrap());
    let double = match double {
        Ok(r) => r,
        Err(err) => panic!("{err}"),
    };
    ok(&e.schedule(&double).unwrap());
    rules.add(FaultRule::once(
        Target::work().kind(WorkKind::ToHost),
        Fault::Error("injected download failure".into()),
    ));
    let down_cause = root(e.host_read::<f32>(&h));
    assert_eq!(down_cause.message, "injected download failure");
    assert_eq!(root(e.host_read::<f32>(&h)), down_cause);
    ok(&e.schedule(&double).unwrap());
    let v = e.host_read::<f32>(&h).unwrap();
    // h = 4 + g twice, g being zero in `with_h`'s fresh buffer.
    assert!(all(&v, 4.0), "{:?}", &v[..4]);

    teardown(
        &mut e,
        &[
            &c00,
            &c10,
            &c11,
            src.context(),
            dst.context(),
            reader.context(),
            other.context(),
            overwrite.context(),
            base.context(),
            merge.context(),
            &with_h,
            use_h.context(),
            double.context(),
        ],
        &[0, 0],
    );
}

#[test]
fn pool_limit_refuses_the_allocation_and_changes_nothing() {
    let _w = Watchdog::arm(Duration::from_secs(120), || "pool limit test".into());
    let rules = FaultRules::default();
    let limit = 4 << 10;
    let mut e = engine(
        1,
        2,
        &rules,
        PoolConfig {
            pool_bytes: 2 << 10,
            limit_bytes: Some(limit),
            ..PoolConfig::default()
        },
    );
    let small = TensorNode::new("small", DType::F32, [256]); // 1 KiB
    let big = TensorNode::new("big", DType::F32, [1024]); // 4 KiB: fits only alone
    let c = e.context(0, 0).unwrap();
    let a = e.link(&c, kernels::fill(&small, 1.0).unwrap()).unwrap();
    ok(&e.schedule(&a).unwrap());
    let before = e.memory_stats();
    let tables = e.table_sizes();
    let err = e.link(&c, kernels::fill(&big, 2.0).unwrap()).unwrap_err();
    assert!(
        matches!(err, Error::PoolExhausted { requested: 4096, limit: l, .. } if l == limit),
        "{err}"
    );
    assert_eq!(e.memory_stats(), before);
    assert_eq!(e.table_sizes(), tables);
    // The parent can still be finalized: no hidden child was registered.
    e.finalize(a.context()).unwrap();
    e.sync_all_timeout(BOUND).unwrap();
    let b = e.link(&c, kernels::fill(&big, 2.0).unwrap()).unwrap();
    ok(&e.schedule(&b).unwrap());
    assert!(all(&e.read::<f32>(b.context(), &big).unwrap(), 2.0));
    teardown(&mut e, &[&c, b.context()], &[0]);
}

#[test]
fn dead_worker_fails_its_stream_and_its_dependents() {
    let _w = Watchdog::arm(Duration::from_secs(120), || "dead worker test".into());
    let rules = FaultRules::default();
    let mut e = engine(2, 2, &rules, small_pools());
    let x = node("victim", shared());
    let (y, z, q) = (
        node("y", MemoryMode::on_device()),
        node("z", MemoryMode::on_device()),
        node("q", MemoryMode::on_device()),
    );
    let (a, b, d1) = (
        e.context(0, 1).unwrap(),
        e.context(0, 0).unwrap(),
        e.context(1, 1).unwrap(),
    );
    rules.add(FaultRule::once(
        Target::work().label("fill(victim)"),
        Fault::KillWorker,
    ));
    let before_death = e.link(&a, kernels::fill(&q, 6.0).unwrap()).unwrap();
    let producer = e
        .link(before_death.context(), kernels::fill(&x, 1.0).unwrap())
        .unwrap();
    let later = e
        .link(producer.context(), kernels::fill(&z, 2.0).unwrap())
        .unwrap();
    let reader = e.link(&b, kernels::copy(&y, &x).unwrap()).unwrap();
    let unrelated = e.link(&b, kernels::fill(&z, 3.0).unwrap()).unwrap();
    let remote = e.link(&d1, kernels::fill(&y, 4.0).unwrap()).unwrap();

    let ev_before = e.schedule(&before_death).unwrap();
    let ev_kill = e.schedule(&producer).unwrap();
    let ev_later = e.schedule(&later).unwrap();
    let ev_reader = e.schedule(&reader).unwrap();
    let ev_unrelated = e.schedule(&unrelated).unwrap();
    let ev_remote = e.schedule(&remote).unwrap();

    ok(&ev_before);
    let kill_cause = failed(&ev_kill);
    assert_eq!(
        (kill_cause.stream, kill_cause.seq),
        (stream(0, 1), ev_kill.seq())
    );
    assert_eq!(kill_cause.operation, "fill(victim)");
    // Everything after it on the dead stream fails with the worker's death...
    let death = failed(&ev_later);
    assert_eq!(
        (death.stream, death.operation.as_str()),
        (stream(0, 1), "worker")
    );
    assert!(death.message.contains("died"), "{death}");
    // ... and so does what is scheduled there from now on, without hanging.
    assert_eq!(failed(&e.schedule(&later).unwrap()), death);
    // The reader on another stream fails with the producer's failure as root cause.
    assert_eq!(failed(&ev_reader), kill_cause);
    // Other streams and devices keep working.
    ok(&ev_unrelated);
    ok(&ev_remote);
    assert!(all(&e.read::<f32>(unrelated.context(), &z).unwrap(), 3.0));
    assert!(all(&e.read::<f32>(remote.context(), &y).unwrap(), 4.0));
    // Reading on the dead stream fails, naming the death.
    assert_eq!(root(e.read::<f32>(before_death.context(), &q)), death);

    // Operations that failed only because their stream died never complete (a dead device
    // may still write), so memory they use is quarantined; here the submissions after the
    // death (refused by the dead queue) completed the timeline, and nothing stays pending.
    let x_bytes = aligned(N as u64 * 4);
    teardown_quarantined(
        &mut e,
        &[
            &a,
            &b,
            &d1,
            before_death.context(),
            producer.context(),
            later.context(),
            reader.context(),
            unrelated.context(),
            remote.context(),
        ],
        &[x_bytes, 0],
        &[0, 0],
    );
}

#[test]
fn failed_pool_creation_is_an_error_and_hangs_nothing() {
    let _w = Watchdog::arm(Duration::from_secs(120), || "pool creation test".into());
    let rules = FaultRules::default();
    let mut e = engine(2, 1, &rules, small_pools());
    let (x, y) = (
        node("x", MemoryMode::on_device()),
        node("y", MemoryMode::on_device()),
    );
    let (c0, c1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let ok0 = e.link(&c0, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let fail = rules.add(FaultRule::once(
        Target::PoolCreate(Some(DeviceId(1))),
        Fault::Error("no memory".into()),
    ));
    let before = (e.memory_stats(), e.table_sizes());
    let err = e.link(&c1, kernels::fill(&x, 2.0).unwrap()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Device(tributary::DeviceError::OutOfMemory { .. })
        ),
        "{err}"
    );
    assert_eq!(rules.hits(fail), 1);
    // Two-phase: the pool is asked for before anything is recorded, so the failed link
    // left no pool, no allocation, no hidden child context and no issued event behind.
    assert_eq!((e.memory_stats(), e.table_sizes()), before);
    // The device serves the next request, from a pool created then.
    let retry = e.link(&c1, kernels::fill(&x, 3.0).unwrap()).unwrap();
    ok(&e.schedule(&retry).unwrap());
    assert!(all(&e.read::<f32>(retry.context(), &x).unwrap(), 3.0));
    // Nothing waits forever, and the other device is unaffected.
    if let Err(err @ Error::Timeout { .. }) = e.sync_all_timeout(BOUND) {
        panic!("sync hit its bound: {err}");
    }
    ok(&e.schedule(&ok0).unwrap());
    assert!(all(&e.read::<f32>(ok0.context(), &x).unwrap(), 1.0));
    let r = e.link(&c0, kernels::fill(&y, 5.0).unwrap()).unwrap();
    ok(&e.schedule(&r).unwrap());
    assert!(all(&e.read::<f32>(r.context(), &y).unwrap(), 5.0));
}

/// A merge buffer that cannot grow (its new pool cannot be created) refuses the copy and
/// changes nothing: the old merge buffer stays, with the value a consumer expects there.
#[test]
fn failed_merge_pool_creation_keeps_the_old_merge_buffer() {
    let _w = Watchdog::arm(Duration::from_secs(120), || "merge pool test".into());
    let rules = FaultRules::default();
    let mut e = engine(2, 1, &rules, small_pools());
    let g = node("g", MemoryMode::on_device());
    let big = TensorNode::new("big", DType::F32, [4 * N]);
    let (c0, c1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let base = e.link(&c0, kernels::fill(&g, 1.0).unwrap()).unwrap();
    let merge = e
        .link(base.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    let src = e.link(&c1, kernels::fill(&g, 2.0).unwrap()).unwrap();
    let src_big = e
        .link(src.context(), kernels::fill(&big, 9.0).unwrap())
        .unwrap();
    ok(&e.schedule(&base).unwrap());
    ok(&e.schedule(&src_big).unwrap());
    ok(&e.schedule(&src).unwrap());
    e.device_to_device(&g, src.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    let fail = rules.add(FaultRule::once(
        Target::PoolCreate(Some(DeviceId(0))),
        Fault::Error("no memory".into()),
    ));
    // Completed events are pruned from the tables as operations pass; start from none.
    e.sync_all().unwrap();
    let before = (e.memory_stats(), e.table_sizes());
    // `big` needs a larger merge buffer than `g`'s.
    let err = e
        .device_to_device(
            &big,
            src_big.context(),
            merge.context(),
            MergeBufferUse::Copy,
        )
        .unwrap_err();
    assert!(matches!(err, Error::Device(_)), "{err}");
    assert_eq!(rules.hits(fail), 1);
    assert_eq!((e.memory_stats(), e.table_sizes()), before);
    // The merge buffer still holds g = 2: the consumer computes 1 + 2.
    ok(&e.schedule(&merge).unwrap());
    assert!(all(&e.read::<f32>(merge.context(), &g).unwrap(), 3.0));
    let ctxs = [&c0, &c1, base.context(), merge.context()];
    teardown(
        &mut e,
        &[&ctxs[..], &[src.context(), src_big.context()]].concat(),
        &[0, 0],
    );
}

/// A failed pool creation must not complete earlier work of the stream early: failing the
/// new plans' events out of order would advance the stream's timeline past work still
/// running, whose waiters would then read unfinished results.
#[test]
fn failed_pool_creation_keeps_the_stream_in_order() {
    let _w = Watchdog::arm(Duration::from_secs(120), || {
        "pool creation order test".into()
    });
    let rules = FaultRules::default();
    let mut e = engine(1, 1, &rules, small_pools());
    let busy = node("busy", MemoryMode::on_device());
    let big = TensorNode::new("big", DType::F32, [1 << 16]); // a dedicated pool
    let c = e.context(0, 0).unwrap();
    let slow = e.link(&c, slow_fill(&busy, 1.0)).unwrap();
    rules.add(FaultRule::once(
        Target::work().label("slow_fill"),
        Fault::Delay(Duration::from_millis(300)),
    ));
    let ev_slow = e.schedule(&slow).unwrap();
    rules.add(FaultRule::once(
        Target::PoolCreate(None),
        Fault::Error("no memory".into()),
    ));
    let err = e.link(&c, kernels::fill(&big, 2.0).unwrap()).unwrap_err();
    assert!(matches!(err, Error::Device(_)), "{err}");
    assert!(
        !ev_slow.is_done(),
        "the slow routine is still running but its event completed"
    );
    ok(&ev_slow);
    assert!(all(&e.read::<f32>(slow.context(), &busy).unwrap(), 1.0));
    if let Err(err @ Error::Timeout { .. }) = e.sync_all_timeout(BOUND) {
        panic!("sync hit its bound: {err}");
    }
}

// ---------------------------------------------------------------------------------------
// A Vulkan device that stops answering (issue 12, item 3). The fault is injected into the
// device's waits (`VulkanBackend::inject_wait_fault`); the work itself still runs on
// lavapipe, so these tests show the bookkeeping, not a real hang.

/// A Vulkan engine of 2 logical devices x 1 stream whose waits give up after `timeout`,
/// with its backend (to inject faults), or `None` (skipped) without Vulkan.
fn vulkan_engine(
    test: &str,
    timeout: Duration,
) -> Option<(Engine, Arc<tributary::backend::vulkan::VulkanBackend>)> {
    use tributary::backend::vulkan::{VulkanBackend, VulkanConfig};
    let config = VulkanConfig {
        device_timeout: timeout,
        ..support::vulkan_config(support::Kind::Vulkan, 2, test)?
    };
    let vk = Arc::new(VulkanBackend::new(DeviceId(0), config).expect("vulkan backend"));
    let e = Engine::with_backend(vk.clone(), 1, small_pools()).expect("engine");
    Some((e, vk))
}

/// Checks that `d0` is lost with `cause` while `d1` of the same backend, and a CPU engine,
/// keep serving.
fn others_keep_serving(
    e: &mut Engine,
    vk: &tributary::backend::vulkan::VulkanBackend,
    c1: &Context,
    cause: &Failure,
) {
    // Later work on the lost device fails at once, naming the loss.
    let c0 = e.context(0, 0).unwrap();
    let later = node("later", MemoryMode::on_device());
    // (Or is refused when it needs a new pool: the lost device allocates nothing.)
    let refused = match e.link(&c0, kernels::fill(&later, 1.0).unwrap()) {
        Ok(r) => match e.schedule(&r) {
            Ok(ev) => failed(&ev).message,
            Err(err) => err.to_string(),
        },
        Err(err) => err.to_string(),
    };
    assert!(refused.contains(&cause.message), "{refused} vs {cause}");
    assert!(vk.lost_cause(DeviceId(1)).unwrap().is_none());
    assert_eq!(vk.leaked_objects(DeviceId(1)).unwrap(), 0);
    let z = node("z", MemoryMode::on_device());
    let r = e.link(c1, kernels::fill(&z, 8.0).unwrap()).unwrap();
    ok(&e.schedule(&r).unwrap());
    assert!(all(&e.read::<f32>(r.context(), &z).unwrap(), 8.0));
    let mut cpu = Engine::cpu(Default::default()).unwrap();
    let cc = cpu.context(0, 0).unwrap();
    let r = cpu.link(&cc, kernels::fill(&z, 3.0).unwrap()).unwrap();
    ok(&cpu.schedule(&r).unwrap());
    assert!(all(&cpu.read::<f32>(r.context(), &z).unwrap(), 3.0));
}

#[test]
fn stuck_vulkan_device_is_lost_after_its_deadline() {
    use tributary::backend::vulkan::WaitFault;
    let _w = Watchdog::arm(Duration::from_secs(120), || "stuck Vulkan device".into());
    let timeout = Duration::from_millis(300);
    let Some((mut e, vk)) = vulkan_engine("stuck_vulkan_device", timeout) else {
        return;
    };
    let g = node("g", MemoryMode::on_device());
    let (c0, c1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let before = e.link(&c0, kernels::fill(&g, 2.0).unwrap()).unwrap();
    ok(&e.schedule(&before).unwrap());
    assert!(all(&e.read::<f32>(before.context(), &g).unwrap(), 2.0));
    let dst = e.link(&c1, kernels::fill(&g, 0.0).unwrap()).unwrap();
    ok(&e.schedule(&dst).unwrap());
    assert_eq!(vk.leaked_objects(DeviceId(0)).unwrap(), 0);

    vk.inject_wait_fault(DeviceId(0), WaitFault::Stuck).unwrap();
    let stuck = e
        .link(before.context(), kernels::fill(&g, 5.0).unwrap())
        .unwrap();
    let start = std::time::Instant::now();
    let ev = e.schedule(&stuck).unwrap();
    // A dependent on the other device: it reads what the stuck operation writes.
    let copy = e
        .device_to_device(&g, stuck.context(), dst.context(), MergeBufferUse::No)
        .unwrap()
        .expect("a copy between devices");
    let cause = failed(&ev);
    // The deadline had to pass before the wait gave up (a lower bound: no timing luck).
    assert!(
        start.elapsed() >= timeout,
        "lost after {:?}",
        start.elapsed()
    );
    assert!(cause.message.contains("device lost: timed out"), "{cause}");
    assert!(cause.message.contains("device_timeout"), "{cause}");
    assert_eq!(
        failed(&copy),
        cause,
        "the dependent fails with the root cause"
    );
    assert_eq!(root(e.read::<f32>(dst.context(), &g)), cause);
    let lost = vk
        .lost_cause(DeviceId(0))
        .unwrap()
        .expect("device 0 is lost");
    assert!(lost.contains("timed out"), "{lost}");
    // What the device might still use (the batch's buffers and pipeline, the semaphore)
    // was leaked, not freed.
    assert!(vk.leaked_objects(DeviceId(0)).unwrap() > 0);
    others_keep_serving(&mut e, &vk, &c1, &cause);
    // Shutting down does not wait for the lost device (the watchdog would fire).
    drop(e);
}

#[test]
fn lost_vulkan_device_fails_its_dependents() {
    use tributary::backend::vulkan::WaitFault;
    let _w = Watchdog::arm(Duration::from_secs(120), || "lost Vulkan device".into());
    let Some((mut e, vk)) = vulkan_engine("lost_vulkan_device", Duration::from_secs(60)) else {
        return;
    };
    let g = node("g", MemoryMode::on_device());
    let (c0, c1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let dst = e.link(&c1, kernels::fill(&g, 0.0).unwrap()).unwrap();
    ok(&e.schedule(&dst).unwrap());
    vk.inject_wait_fault(DeviceId(0), WaitFault::Lost).unwrap();
    let src = e.link(&c0, kernels::fill(&g, 5.0).unwrap()).unwrap();
    let ev = e.schedule(&src).unwrap();
    let copy = e
        .device_to_device(&g, src.context(), dst.context(), MergeBufferUse::No)
        .unwrap()
        .expect("a copy between devices");
    let cause = failed(&ev);
    assert!(cause.message.contains("ERROR_DEVICE_LOST"), "{cause}");
    assert_eq!(failed(&copy), cause);
    assert!(vk.leaked_objects(DeviceId(0)).unwrap() > 0);
    others_keep_serving(&mut e, &vk, &c1, &cause);
}
