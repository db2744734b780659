//! Property tests of the slab-pool bookkeeping: random sequences of alloc / free /
//! event completion / reclaim / merge-buffer requests over 1-3 streams, checked against a
//! model of what the memory is and who may still be touching it. The backend refuses some
//! pool creations: a refused pool must never be recorded, and the request must change
//! nothing the model knows.
#![allow(clippy::unwrap_used)] // tests may unwrap

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use proptest::{prelude::*, sample::Index};
use tributary::{
    memory::{
        Allocation, DevicePools, PoolConfig, PoolKind, PoolMemory, PoolOp, PoolStats,
        RangeAllocator, UseEvent,
    },
    DeviceError, DeviceId, Error, PoolId, StreamId,
};

const D: DeviceId = DeviceId(0);

/// A fake event: a shared done flag and the stream it runs on.
#[derive(Clone, Debug)]
struct Ev {
    done: Arc<AtomicBool>,
    stream: StreamId,
}

impl Ev {
    fn new(stream: StreamId) -> Self {
        Self {
            done: Arc::new(AtomicBool::new(false)),
            stream,
        }
    }
}

impl UseEvent for Ev {
    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
    fn stream(&self) -> StreamId {
        self.stream
    }
}

fn local(index: u32) -> StreamId {
    StreamId { device: D, index }
}

/// Streams that events may run on: the device's own, plus one of another device (a
/// cross-device copy reading the buffer).
fn event_stream(code: u32, streams: u32) -> StreamId {
    if code == 3 {
        StreamId {
            device: DeviceId(1),
            index: 0,
        }
    } else {
        local(code % streams)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        stream: u32,
        bytes: u64,
        align_log: u32,
        refuse: bool,
    },
    Free {
        pick: Index,
        uses: Vec<u32>,
    },
    DoubleFree {
        pick: Index,
    },
    Complete {
        pick: Index,
    },
    Reclaim,
    Merge {
        stream: u32,
        bytes: u64,
        retire: Vec<u32>,
        refuse: bool,
    },
}

/// A backend that records the pool operations and refuses every creation when `refuse`.
struct Backend<'a> {
    ops: &'a mut Vec<PoolOp>,
    refuse: bool,
}

impl PoolMemory for Backend<'_> {
    fn create_pool(&mut self, pool: PoolId, bytes: u64, align: u64) -> tributary::Result<()> {
        if self.refuse {
            return Err(DeviceError::OutOfMemory { requested: bytes }.into());
        }
        self.ops.create_pool(pool, bytes, align)
    }

    fn release_pool(&mut self, pool: PoolId) {
        self.ops.release_pool(pool);
    }
}

/// Whether `e` is a refused creation (and one was asked for).
fn refused(e: &Error, refuse: bool) -> bool {
    refuse && matches!(e, Error::Device(DeviceError::OutOfMemory { .. }))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..3, 1u64..3000, 0u32..10, prop::bool::weighted(0.2))
            .prop_map(|(stream, bytes, align_log, refuse)| Op::Alloc {
                stream,
                bytes,
                align_log,
                refuse
            }),
        4 => (any::<Index>(), prop::collection::vec(0u32..4, 0..3))
            .prop_map(|(pick, uses)| Op::Free { pick, uses }),
        1 => any::<Index>().prop_map(|pick| Op::DoubleFree { pick }),
        4 => any::<Index>().prop_map(|pick| Op::Complete { pick }),
        1 => Just(Op::Reclaim),
        2 => (0u32..3, 1u64..2500, prop::collection::vec(0u32..4, 0..3), prop::bool::weighted(0.2))
            .prop_map(|(stream, bytes, retire, refuse)| Op::Merge { stream, bytes, retire, refuse }),
    ]
}

fn config() -> impl Strategy<Value = PoolConfig> {
    (
        prop_oneof![Just(512u64), Just(1024), Just(4096)],
        prop_oneof![Just(None), (2048u64..16384).prop_map(Some)],
        any::<bool>(),
    )
        .prop_map(
            |(pool_bytes, limit_bytes, release_empty_pools)| PoolConfig {
                pool_bytes,
                min_alignment: 64,
                limit_bytes,
                release_empty_pools,
            },
        )
}

/// What the test knows independently of the implementation.
#[derive(Default)]
struct Model {
    /// Live general allocations and the stream they were allocated for.
    live: Vec<(Allocation, StreamId)>,
    /// Allocations already freed (for double frees).
    freed: Vec<(Allocation, StreamId)>,
    /// Every event made so far.
    events: Vec<Ev>,
    /// Byte ranges `(pool, start, end)` that were freed, with the events of the work that
    /// touched them; forgotten when the pool is released.
    touched: Vec<(PoolId, u64, u64, Vec<Ev>)>,
    /// Current merge buffer of each stream.
    merge: BTreeMap<StreamId, Allocation>,
    /// Retired merge pools and the events still using them.
    retiring: Vec<(PoolId, Vec<Ev>)>,
    /// Pools as the backend sees them (from `PoolOp`s): capacity and base alignment.
    pools: BTreeMap<PoolId, (u64, u64)>,
    /// Whether a same-stream reuse was seen.
    stream_reuse_seen: bool,
}

impl Model {
    fn apply_ops(&mut self, ops: &[PoolOp]) {
        for op in ops {
            match *op {
                PoolOp::Create { pool, bytes, align } => {
                    assert!(align.is_power_of_two());
                    assert!(
                        self.pools.insert(pool, (bytes, align)).is_none(),
                        "{pool} created twice"
                    );
                }
                PoolOp::Release { pool } => {
                    assert!(self.pools.remove(&pool).is_some(), "{pool} not there");
                    assert!(
                        self.live.iter().all(|(a, _)| a.loc.pool != pool),
                        "{pool} released with live allocations"
                    );
                    assert!(
                        self.merge.values().all(|m| m.loc.pool != pool),
                        "{pool} released while a stream's merge buffer"
                    );
                    for (p, _, _, evs) in &self.touched {
                        if *p == pool {
                            assert!(
                                evs.iter().all(Ev::is_done),
                                "{pool} released before work on it finished"
                            );
                        }
                    }
                    for (p, evs) in &self.retiring {
                        if *p == pool {
                            assert!(
                                evs.iter().all(Ev::is_done),
                                "merge pool {pool} released before its users finished"
                            );
                        }
                    }
                    self.touched.retain(|(p, ..)| *p != pool);
                    self.retiring.retain(|(p, _)| *p != pool);
                }
            }
        }
    }

    /// Checks a new allocation for `stream` against everything the model knows.
    fn check_new(&self, a: &Allocation, stream: StreamId, bytes: u64, align: u64) {
        let (capacity, pool_align) = self.pools[&a.loc.pool];
        assert_eq!(a.loc.offset % align, 0, "misaligned {a:?}");
        assert!(pool_align >= align, "pool base less aligned than {a:?}");
        assert!(a.bytes >= bytes && a.bytes % align == 0);
        assert!(a.loc.offset + a.bytes <= capacity, "{a:?} outside its pool");
        assert!(self.merge.values().all(|m| m.loc.pool != a.loc.pool));
        assert!(self.retiring.iter().all(|(p, _)| *p != a.loc.pool));
        let (start, end) = (a.loc.offset, a.loc.offset + a.bytes);
        for (b, _) in &self.live {
            let disjoint =
                b.loc.pool != a.loc.pool || b.loc.offset + b.bytes <= start || end <= b.loc.offset;
            assert!(disjoint, "{a:?} overlaps live {b:?}");
        }
        for (pool, s, e, evs) in &self.touched {
            if *pool == a.loc.pool && *s < end && start < *e {
                for ev in evs {
                    assert!(
                        ev.is_done() || ev.stream == stream,
                        "{a:?} handed to {stream} while {} still uses it",
                        ev.stream
                    );
                }
            }
        }
    }
}

fn check_stats(pools: &DevicePools<Ev>, model: &Model) -> PoolStats {
    let st = pools.stats();
    assert_eq!(
        st.live_bytes + st.free_bytes + st.pending_free_bytes,
        st.reserved_bytes,
        "{st:?}"
    );
    assert_eq!(
        st.per_pool.iter().map(|p| p.capacity).sum::<u64>(),
        st.reserved_bytes
    );
    assert!(st.peak_live_bytes >= st.live_bytes);
    assert!(st.peak_reserved_bytes >= st.reserved_bytes);
    if let Some(limit) = pools.config().limit_bytes {
        assert!(st.reserved_bytes <= limit);
    }
    assert_eq!(st.allocations, model.live.len());
    let merge_bytes: u64 = model.merge.values().map(|m| m.bytes).sum();
    let live_bytes: u64 = model.live.iter().map(|(a, _)| a.bytes).sum();
    assert_eq!(st.live_bytes, live_bytes + merge_bytes);
    let backend: BTreeMap<PoolId, u64> = model.pools.iter().map(|(&p, &(c, _))| (p, c)).collect();
    let mine: BTreeMap<PoolId, u64> = st.per_pool.iter().map(|p| (p.pool, p.capacity)).collect();
    assert_eq!(backend, mine, "pools differ from what the ops built");
    for (a, _) in &model.live {
        assert_eq!(pools.live(a.loc), Some(*a));
    }
    for (s, m) in &model.merge {
        assert_eq!(pools.current_merge_buffer(*s), Some(*m));
        assert_eq!(pools.pool_kind(m.loc.pool), Some(PoolKind::MergeBuffer(*s)));
    }
    st
}

/// `pools` after only the `reclaim` that every `alloc` starts with, and the ops it pushes:
/// what a failing request must leave behind.
fn after_reclaim(pools: &DevicePools<Ev>) -> (PoolStats, Vec<PoolOp>) {
    let mut probe = pools.clone();
    let mut ops = Vec::new();
    probe.reclaim(&mut ops);
    (probe.stats(), ops)
}

/// After a refused pool creation: no pool was recorded or created, and nothing live
/// changed. The only change beyond `reclaim`'s may be empty general pools released to make
/// room under the limit (never without one).
fn refused_changed_nothing(
    pools: &DevicePools<Ev>,
    expect: &PoolStats,
    ops: &[PoolOp],
    limited: bool,
) {
    let st = pools.stats();
    assert!(
        ops.iter().all(|op| matches!(op, PoolOp::Release { .. })),
        "a refused request created a pool: {ops:?}"
    );
    assert_eq!(
        st.live_bytes, expect.live_bytes,
        "refused request changed live bytes"
    );
    assert_eq!(st.allocations, expect.allocations);
    assert_eq!(st.pending_free_bytes, expect.pending_free_bytes);
    assert_eq!(st.merge_pools, expect.merge_pools, "{st:?}");
    if !limited {
        assert_eq!(&st, expect, "refused request changed state");
    }
}

/// Runs `program`, checking every step; returns whether a same-stream reuse happened.
fn run(config: PoolConfig, streams: u32, program: Vec<Op>) -> bool {
    let limited = config.limit_bytes.is_some();
    let mut pools: DevicePools<Ev> = DevicePools::new(D, config);
    let mut m = Model::default();
    for op in program {
        let mut ops = Vec::new();
        match op {
            Op::Alloc {
                stream,
                bytes,
                align_log,
                refuse,
            } => {
                let stream = local(stream % streams);
                let align = (1u64 << align_log).max(64);
                let (expect_stats, expect_ops) = after_reclaim(&pools);
                let reused = pools.stats().stream_reuse_count;
                let mut backend = Backend {
                    ops: &mut ops,
                    refuse,
                };
                match pools.alloc(bytes, 1 << align_log, stream, &mut backend) {
                    Ok(a) => {
                        m.apply_ops(&ops);
                        m.check_new(&a, stream, bytes, align);
                        m.live.push((a, stream));
                        m.stream_reuse_seen |= pools.stats().stream_reuse_count > reused;
                    }
                    Err(e) if refused(&e, refuse) => {
                        refused_changed_nothing(&pools, &expect_stats, &ops, limited);
                        m.apply_ops(&ops);
                    }
                    Err(e) => {
                        assert!(limited && matches!(e, Error::PoolExhausted { .. }), "{e}");
                        assert_eq!(pools.stats(), expect_stats, "failed alloc changed state");
                        assert_eq!(ops, expect_ops);
                        m.apply_ops(&ops);
                    }
                }
            }
            Op::Free { pick, uses } => {
                if m.live.is_empty() {
                    continue;
                }
                let (a, stream) = m.live.swap_remove(pick.index(m.live.len()));
                let evs: Vec<Ev> = uses
                    .iter()
                    .map(|&c| Ev::new(event_stream(c, streams)))
                    .collect();
                m.events.extend(evs.iter().cloned());
                pools.free(a, evs.clone(), stream).unwrap();
                m.touched
                    .push((a.loc.pool, a.loc.offset, a.loc.offset + a.bytes, evs));
                m.freed.push((a, stream));
            }
            Op::DoubleFree { pick } => {
                if m.freed.is_empty() {
                    continue;
                }
                let (a, stream) = m.freed[pick.index(m.freed.len())];
                let before = pools.stats();
                let err = pools.free(a, vec![], stream).unwrap_err();
                assert!(
                    matches!(err, Error::NotLive { loc, .. } if loc == a.loc),
                    "{err}"
                );
                assert_eq!(pools.stats(), before);
            }
            Op::Complete { pick } => {
                let open: Vec<&Ev> = m.events.iter().filter(|e| !e.is_done()).collect();
                if !open.is_empty() {
                    open[pick.index(open.len())]
                        .done
                        .store(true, Ordering::Release);
                }
            }
            Op::Reclaim => {
                pools.reclaim(&mut ops);
                m.apply_ops(&ops);
            }
            Op::Merge {
                stream,
                bytes,
                retire,
                refuse,
            } => {
                let stream = local(stream % streams);
                let evs: Vec<Ev> = retire
                    .iter()
                    .map(|&c| Ev::new(event_stream(c, streams)))
                    .collect();
                m.events.extend(evs.iter().cloned());
                let (expect_stats, expect_ops) = after_reclaim(&pools);
                let mut backend = Backend {
                    ops: &mut ops,
                    refuse,
                };
                match pools.merge_buffer(stream, bytes, evs.clone(), &mut backend) {
                    Ok(a) => {
                        assert_eq!(a.loc.offset, 0);
                        assert!(a.bytes >= bytes && a.bytes % 64 == 0);
                        match m.merge.get(&stream) {
                            Some(old) if old.loc.pool == a.loc.pool => assert_eq!(a, *old),
                            Some(old) => m.retiring.push((old.loc.pool, evs)),
                            None => {}
                        }
                        // Ops come in order: a pool released here may be re-created as the
                        // new merge pool, so the new buffer counts only after them.
                        m.merge.remove(&stream);
                        m.apply_ops(&ops);
                        m.merge.insert(stream, a);
                        let (capacity, _) = m.pools[&a.loc.pool];
                        assert_eq!(capacity, a.bytes);
                        assert!(m.live.iter().all(|(b, _)| b.loc.pool != a.loc.pool));
                    }
                    Err(e) if refused(&e, refuse) => {
                        // `check_stats` below: the old merge buffer is still the stream's.
                        refused_changed_nothing(&pools, &expect_stats, &ops, limited);
                        m.apply_ops(&ops);
                    }
                    Err(e) => {
                        assert!(limited && matches!(e, Error::PoolExhausted { .. }), "{e}");
                        assert_eq!(pools.stats(), expect_stats, "failed merge changed state");
                        assert_eq!(ops, expect_ops);
                        m.apply_ops(&ops);
                    }
                }
            }
        }
        check_stats(&pools, &m);
    }
    // Drain: once every event is done and everything is freed, all memory is free again.
    for e in &m.events {
        e.done.store(true, Ordering::Release);
    }
    for (a, stream) in std::mem::take(&mut m.live) {
        pools.free(a, vec![], stream).unwrap();
    }
    let mut ops = Vec::new();
    pools.reclaim(&mut ops);
    m.apply_ops(&ops);
    let st = check_stats(&pools, &m);
    assert_eq!(st.pending_free_bytes, 0);
    assert_eq!(
        st.live_bytes,
        m.merge.values().map(|a| a.bytes).sum::<u64>()
    );
    m.stream_reuse_seen
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pools_never_hand_out_memory_in_use(
        config in config(),
        streams in 1u32..=3,
        program in prop::collection::vec(op(), 1..120),
    ) {
        run(config, streams, program);
    }

    #[test]
    fn range_allocator_tiles_its_capacity(
        capacity in 0u64..5000,
        steps in prop::collection::vec((any::<bool>(), 1u64..800, 0u32..8, any::<Index>()), 1..200),
    ) {
        let mut r = RangeAllocator::new(capacity);
        let mut live: Vec<(u64, u64)> = Vec::new();
        for (is_alloc, size, align_log, pick) in steps {
            if is_alloc || live.is_empty() {
                let align = 1u64 << align_log;
                let largest = r.largest_free();
                match r.alloc(size, align) {
                    Some(o) => {
                        prop_assert_eq!(o % align, 0);
                        prop_assert!(o + size <= capacity);
                        live.push((o, size));
                    }
                    // A block of `size + align - 1` bytes always fits, so a refusal means
                    // there is none.
                    None => prop_assert!(size + align - 1 > largest),
                }
            } else {
                let (o, size) = live.swap_remove(pick.index(live.len()));
                prop_assert_eq!(r.free(o), Some(size));
                prop_assert_eq!(r.free(o), None);
            }
            // Live ranges match the model, and live + free tile 0..capacity.
            let mut mine: Vec<(u64, u64)> = r.live_ranges().collect();
            let mut model = live.clone();
            mine.sort_unstable();
            model.sort_unstable();
            prop_assert_eq!(&mine, &model);
            let mut all: Vec<(u64, u64, bool)> = mine.iter().map(|&(o, s)| (o, s, true))
                .chain(r.free_ranges().map(|(o, s)| (o, s, false)))
                .collect();
            all.sort_unstable();
            let (mut at, mut prev_free) = (0, false);
            for (o, s, is_live) in all {
                prop_assert_eq!(o, at);
                prop_assert!(is_live || !prev_free, "free neighbours not coalesced");
                prev_free = !is_live;
                at = o + s;
            }
            prop_assert_eq!(at, capacity);
            prop_assert_eq!(r.live_bytes() + r.free_bytes(), capacity);
        }
    }
}

/// A directed program in which same-stream reuse must happen, run through the same checks.
#[test]
fn same_stream_reuse_happens_under_the_model() {
    let config = PoolConfig {
        pool_bytes: 1024,
        ..PoolConfig::default()
    };
    let mut pools: DevicePools<Ev> = DevicePools::new(D, config);
    let mut m = Model::default();
    let mut ops = Vec::new();
    let a = pools.alloc(1024, 64, local(0), &mut ops).unwrap();
    m.apply_ops(&ops);
    m.check_new(&a, local(0), 1024, 64);
    let e = Ev::new(local(0));
    pools.free(a, vec![e.clone()], local(0)).unwrap();
    m.touched.push((a.loc.pool, 0, 1024, vec![e.clone()]));
    ops.clear();
    let b = pools.alloc(512, 64, local(0), &mut ops).unwrap();
    m.apply_ops(&ops);
    m.check_new(&b, local(0), 512, 64);
    assert_eq!(b.loc, a.loc);
    assert_eq!(pools.stats().stream_reuse_count, 1);
    ops.clear();
    let c = pools.alloc(512, 64, local(1), &mut ops).unwrap();
    m.apply_ops(&ops);
    m.check_new(&c, local(1), 512, 64);
    assert_ne!(c.loc.pool, a.loc.pool);
    m.live.push((b, local(0)));
    m.live.push((c, local(1)));
    check_stats(&pools, &m);
}

/// The generator does reach the interesting path: some random programs reuse a pending
/// range on its own stream (fixed seed, so this is deterministic).
#[test]
fn random_programs_exercise_stream_reuse() {
    use proptest::{
        strategy::ValueTree,
        test_runner::{Config, RngAlgorithm, TestRng, TestRunner},
    };
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    );
    let strategy = (config(), 1u32..=3, prop::collection::vec(op(), 1..120));
    let seen = (0..64)
        .filter(|_| {
            let (config, streams, program) = strategy.new_tree(&mut runner).unwrap().current();
            run(config, streams, program)
        })
        .count();
    assert!(
        seen > 0,
        "no program reused a pending range on its own stream"
    );
}
