//! Soak: up to a million small operations over 2 devices x 3 streams, bounded in time,
//! checking that the protocol tables and memory stay bounded (pruning works, deferred
//! frees come back) and that nothing leaks, while every observed value is compared
//! bitwise with the sequential reference running the same operations in lockstep.
//!
//! `TRIBUTARY_SOAK_SECS` (default 30) and `TRIBUTARY_SOAK_OPS` (default 1,000,000) bound
//! the run, whichever comes first; `TRIBUTARY_SOAK_SEED` replays one.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use tributary_testkit::common;

use common::{
    engine_runner::EngineRunner, env_count, program::*, reference::ReferenceRunner,
    watchdog::Watchdog,
};

const DEVICES: usize = 2;
const STREAMS: usize = 3;
/// Operations between two syncs (where the tables must be empty and memory at baseline).
const SYNC_EVERY: u64 = 4096;

/// xorshift64*: a reproducible stream of choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The engine and the reference, fed the same operations.
struct Lockstep {
    engine: Box<dyn Executor>,
    reference: Box<dyn Executor>,
    contexts: usize,
    routines: usize,
    applied: u64,
    recent: VecDeque<(u64, Op)>,
}

impl Lockstep {
    fn apply(&mut self, op: Op) -> Obs {
        let expected = self.reference.apply(&op);
        let got = self.engine.apply(&op);
        self.recent.push_back((self.applied, op.clone()));
        if self.recent.len() > 40 {
            self.recent.pop_front();
        }
        let same = match (&expected, &got) {
            (Ok(Obs::Values(a)), Ok(Obs::Values(b))) => a.first_difference(b).is_none(),
            (a, b) => a == b,
        };
        if !same || expected.is_err() {
            let recent: Vec<String> = self
                .recent
                .iter()
                .map(|(i, op)| format!("{i:9}: {op:?}"))
                .collect();
            panic!(
                "soak operation {} differs from the reference (or was refused):\n  expected \
                 {expected:?}\n  got      {got:?}\nlast operations:\n{}",
                self.applied,
                recent.join("\n")
            );
        }
        self.applied += 1;
        match op {
            Op::Root { .. } | Op::InitFromHost { .. } => self.contexts += 1,
            Op::Link { .. } => {
                self.contexts += 1;
                self.routines += 1;
            }
            _ => {}
        }
        got.unwrap_or(Obs::Done)
    }

    fn last_context(&self) -> C {
        C(self.contexts - 1)
    }

    fn link(&mut self, ctx: C, kernel: Kernel) -> (R, C) {
        self.apply(Op::Link { ctx, kernel });
        (R(self.routines - 1), self.last_context())
    }

    fn init(&mut self, ctx: C, node: N, data: Data) -> C {
        self.apply(Op::InitFromHost { ctx, node, data });
        self.last_context()
    }
}

/// What one stream has linked: its deepest context and its routines.
struct Lane {
    ctx: C,
    routines: Vec<R>,
    merge: R,
}

const A: N = N(0); // f32, per stream: accumulates, merged between lanes
const B: N = N(1); // f32, per stream
const S: N = N(2); // f32, shared by the streams of a device, written by stream 0
const W: N = N(3); // f32, hosted: device writes, host reads and writes
const K: N = N(4); // i32 counter
const ONE: N = N(5); // i32 hosted constant
const T: N = N(6); // f32, per stream: scratch of short-lived contexts
const U: N = N(7); // f32, hosted per stream: short-lived contexts with host traffic

fn nodes() -> Vec<NodeDecl> {
    let f = |mode| NodeDecl {
        dtype: Dt::F32,
        dims: vec![16],
        mode,
        zeroed: true,
    };
    let i = |mode| NodeDecl {
        dtype: Dt::I32,
        dims: vec![4, 4],
        mode,
        zeroed: true,
    };
    vec![
        f(Mode::OnDevice(Share::Unset)),
        f(Mode::OnDevice(Share::PerStream)),
        f(Mode::OnDevice(Share::Shared)),
        f(Mode::Hosted(Share::Unset)),
        i(Mode::OnDevice(Share::Unset)),
        i(Mode::Constant),
        f(Mode::OnDevice(Share::PerStream)),
        f(Mode::Hosted(Share::PerStream)),
    ]
}

fn prologue(ls: &mut Lockstep) -> Vec<Lane> {
    let mut lanes = Vec::new();
    for d in 0..DEVICES {
        for st in 0..STREAMS {
            ls.apply(Op::Root {
                device: d,
                stream: st,
            });
            let mut c = ls.last_context();
            if st == 0 {
                c = ls.init(c, ONE, Data::Ints(9));
            }
            c = ls.init(c, W, Data::Fractions(d as u32 * 8 + st as u32));
            let mut routines = Vec::new();
            let mut add = |ls: &mut Lockstep, c: &mut C, k: Kernel| {
                let (r, next) = ls.link(*c, k);
                routines.push(r);
                *c = next;
            };
            let v = (d * STREAMS + st) as f64;
            add(ls, &mut c, Kernel::Fill { dst: A, value: v });
            add(
                ls,
                &mut c,
                Kernel::Fill {
                    dst: B,
                    value: 0.25,
                },
            );
            add(ls, &mut c, Kernel::AddInto { dst: A, src: B });
            add(ls, &mut c, Kernel::AddInto { dst: K, src: ONE });
            add(ls, &mut c, Kernel::AddInto { dst: W, src: A });
            add(
                ls,
                &mut c,
                Kernel::Scale {
                    dst: B,
                    src: A,
                    alpha: 0.5,
                },
            );
            if st == 0 {
                add(ls, &mut c, Kernel::Fill { dst: S, value: -v });
                add(ls, &mut c, Kernel::AddInto { dst: S, src: B });
            } else {
                add(ls, &mut c, Kernel::Copy { dst: B, src: S });
                add(
                    ls,
                    &mut c,
                    Kernel::Axpy {
                        y: A,
                        x: S,
                        alpha: 0.125,
                    },
                );
            }
            let (merge, c) = ls.link(c, Kernel::AddMerge { dst: A });
            lanes.push(Lane {
                ctx: c,
                routines,
                merge,
            });
        }
    }
    lanes
}

/// A short-lived branch of `lane`: link, run, observe, finalize.
fn churn(ls: &mut Lockstep, rng: &mut Rng, lane: &Lane) {
    if rng.below(2) == 0 {
        let (fill, c1) = ls.link(
            lane.ctx,
            Kernel::Fill {
                dst: T,
                value: rng.below(9) as f64,
            },
        );
        let (add, c2) = ls.link(c1, Kernel::AddInto { dst: T, src: A });
        ls.apply(Op::Schedule { routine: fill });
        ls.apply(Op::Schedule { routine: add });
        if rng.below(4) == 0 {
            ls.apply(Op::Read { ctx: c2, node: T });
        }
        ls.apply(Op::Finalize { ctx: c2 });
        ls.apply(Op::Finalize { ctx: c1 });
    } else {
        let c1 = ls.init(lane.ctx, U, Data::Fractions(rng.below(64) as u32));
        let (add, c2) = ls.link(c1, Kernel::AddInto { dst: U, src: B });
        ls.apply(Op::Schedule { routine: add });
        if rng.below(3) == 0 {
            ls.apply(Op::HostRead { node: U });
        }
        // Finalizing saves U's newest value to the host array.
        ls.apply(Op::Finalize { ctx: c2 });
        ls.apply(Op::Finalize { ctx: c1 });
    }
}

#[test]
fn a_million_small_operations_stay_bounded() {
    let secs = env_count("TRIBUTARY_SOAK_SECS", 30);
    let max_ops = env_count("TRIBUTARY_SOAK_OPS", 1_000_000);
    let seed = env_count(
        "TRIBUTARY_SOAK_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    ) | 1;
    eprintln!("soak: {secs} s or {max_ops} operations, TRIBUTARY_SOAK_SEED={seed}");
    let _watchdog = Watchdog::arm(Duration::from_secs(secs + 240), move || {
        format!("soak with TRIBUTARY_SOAK_SEED={seed}")
    });
    let setup = Setup {
        devices: DEVICES,
        streams: STREAMS,
        nodes: nodes(),
        pool_bytes: 64 << 10,
    };
    let mut ls = Lockstep {
        engine: EngineRunner::cpu().start(&setup).expect("engine"),
        reference: ReferenceRunner::default().start(&setup).expect("reference"),
        contexts: 0,
        routines: 0,
        applied: 0,
        recent: VecDeque::new(),
    };
    let mut rng = Rng(seed);
    let lanes = prologue(&mut ls);
    ls.apply(Op::Sync);
    let baseline = ls.engine.probe().expect("the engine reports its tables");
    assert_eq!(baseline.events, 0, "{baseline:?}");
    eprintln!("soak baseline: {baseline:?}");

    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let mut max_events = 0;
    let mut syncs = 0u64;
    let mut first_reserved = None;
    let total_streams = DEVICES * STREAMS;
    // One writer and a reader per stream for each buffer and merge buffer, plus host arrays.
    let event_bound = (baseline.buffers + total_streams + 2 * total_streams) * (total_streams + 1);
    while ls.applied < max_ops && Instant::now() < deadline {
        for _ in 0..SYNC_EVERY {
            let lane = &lanes[rng.below(lanes.len())];
            match rng.below(100) {
                0..=64 => {
                    let r = lane.routines[rng.below(lane.routines.len())];
                    ls.apply(Op::Schedule { routine: r });
                }
                65..=76 => {
                    let src = lanes[rng.below(lanes.len())].ctx;
                    if src == lane.ctx {
                        continue;
                    }
                    let mode = if rng.below(3) == 0 {
                        D2d::StreamingFor(lane.merge)
                    } else {
                        D2d::Copy
                    };
                    ls.apply(Op::DeviceToDevice {
                        node: A,
                        src,
                        dst: lane.ctx,
                        mode,
                    });
                    if mode == D2d::Copy {
                        ls.apply(Op::Schedule {
                            routine: lane.merge,
                        });
                    }
                }
                77..=81 => {
                    let src = lanes[rng.below(lanes.len())].ctx;
                    let node = [A, B, W][rng.below(3)];
                    ls.apply(Op::DeviceToDevice {
                        node,
                        src,
                        dst: lane.ctx,
                        mode: D2d::No,
                    });
                }
                82..=95 => churn(&mut ls, &mut rng, lane),
                96 => {
                    ls.apply(Op::HostRead { node: W });
                }
                97 => {
                    ls.apply(Op::HostWrite {
                        node: W,
                        data: Data::Ints(rng.below(32) as u32),
                    });
                }
                98 => {
                    let op = if rng.below(2) == 0 {
                        Op::ToHost {
                            ctx: lane.ctx,
                            node: W,
                        }
                    } else {
                        Op::FromHost {
                            ctx: lane.ctx,
                            node: W,
                        }
                    };
                    ls.apply(op);
                }
                _ => {
                    let node = [A, B, S, W, K, ONE][rng.below(6)];
                    ls.apply(Op::Read {
                        ctx: lane.ctx,
                        node,
                    });
                }
            }
        }
        // Before the sync: in flight, bounded by the buffers, not by the operations.
        let busy = ls.engine.probe().expect("probe");
        max_events = max_events.max(busy.events);
        assert!(
            busy.events <= event_bound,
            "{busy:?} > {event_bound} events"
        );
        assert!(busy.contexts <= baseline.contexts, "{busy:?}");
        ls.apply(Op::Sync);
        syncs += 1;
        // After it: everything completed was pruned, every freed range came back.
        let idle = ls.engine.probe().expect("probe");
        assert_eq!(idle.events, 0, "events held after a sync: {idle:?}");
        assert_eq!(idle.contexts, baseline.contexts, "{idle:?}");
        assert_eq!(idle.buffers, baseline.buffers, "{idle:?}");
        assert_eq!(idle.pending_bytes, 0, "{idle:?}");
        // Merge buffers appear when first used; general buffers are back to the baseline.
        assert!(idle.live_bytes >= baseline.live_bytes, "{idle:?}");
        let reserved = *first_reserved.get_or_insert(idle.reserved_bytes);
        assert!(
            idle.reserved_bytes <= reserved,
            "pools grew from {reserved} to {} bytes",
            idle.reserved_bytes
        );
    }
    let elapsed = start.elapsed();
    // Observe everything once more, then everything must go.
    ls.apply(Op::Checkpoint);
    let end = ls.apply(Op::Teardown);
    let Obs::Memory(devices) = end else {
        panic!("teardown observed {end:?}");
    };
    // Only the device-wide buffers (S and the constant ONE, per device) outlive the run.
    assert!(
        devices
            .iter()
            .all(|m| m.allocations == 2 && m.contexts == 0),
        "{devices:?}"
    );
    eprintln!(
        "soak: {} operations in {elapsed:.1?} ({:.0} ops/s), {syncs} syncs, at most {max_events} \
         events in the tables (bound {event_bound})",
        ls.applied,
        ls.applied as f64 / elapsed.as_secs_f64()
    );
    assert!(
        ls.applied >= 10_000,
        "the soak ran only {} operations",
        ls.applied
    );
}
