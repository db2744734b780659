//! The device actors' decisions (`tributary::dispatch`) driven by hand, one device at a time,
//! to pin down orders that thread timing makes rare in the random programs.

use std::sync::Mutex as StdMutex;

use tributary::{
    dispatch::{
        answer, block_on, messages::Answer, DeviceCore, DeviceSlot, Dispatcher, Inbox, PlanSink,
    },
    kernels,
    memory::{PoolConfig, PoolMemory},
    protocol::{current_issue, DeviceState, HostTable, Plans, Work},
    sync::{Arc, Mutex},
    DType, DeviceId, MergeBufferUse, PoolId, StreamId, TensorNode, Timeline,
};

/// What happened to a device's pools, in the order it happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// A pool was released, placed at `current_issue()` in program order.
    Release {
        device: DeviceId,
        pool: PoolId,
        placed: u64,
    },
    /// A plan that writes into `pool` was submitted, with its issue stamp.
    Plan {
        device: DeviceId,
        pool: PoolId,
        issue: u64,
    },
}

type Log = std::sync::Arc<StdMutex<Vec<Seen>>>;

struct Memory {
    device: DeviceId,
    log: Log,
}

impl PoolMemory for Memory {
    fn create_pool(&mut self, _pool: PoolId, _bytes: u64, _align: u64) -> tributary::Result<()> {
        Ok(())
    }

    fn release_pool(&mut self, pool: PoolId) {
        self.log.lock().unwrap().push(Seen::Release {
            device: self.device,
            pool,
            placed: current_issue(),
        });
    }
}

/// Keeps the plans' stamps and the pools they write; runs nothing (the test completes
/// their events itself).
struct Sink(Log);

impl PlanSink for Sink {
    fn submit(&mut self, plans: &mut Plans) {
        let mut log = self.0.lock().unwrap();
        for p in plans.drain(..) {
            let dst = match p.work() {
                Work::Copy { dst, .. } | Work::Memset { dst, .. } | Work::FromHost { dst, .. } => {
                    *dst
                }
                _ => continue,
            };
            log.push(Seen::Plan {
                device: dst.device,
                pool: dst.loc.pool,
                issue: p.issue(),
            });
        }
    }
}

struct Devices {
    dispatcher: Dispatcher,
    cores: Vec<(
        DeviceCore,
        std::sync::Arc<Inbox<tributary::dispatch::messages::DeviceOp>>,
    )>,
    log: Log,
}

impl Devices {
    /// `n` devices of one stream each, whose pools are 256 bytes (a larger node gets a pool
    /// of its own).
    fn new(n: u32) -> Devices {
        let log = Log::default();
        let host = Arc::new(Mutex::new(HostTable::default()));
        let (mut cores, mut slots) = (Vec::new(), Vec::new());
        for d in 0..n {
            let device = DeviceId(d);
            let timelines = vec![Timeline::new(StreamId { device, index: 0 })];
            let pools = PoolConfig {
                pool_bytes: 256,
                ..PoolConfig::default()
            };
            let memory = Memory {
                device,
                log: log.clone(),
            };
            let state = DeviceState::new(device, timelines.clone(), pools, Box::new(memory));
            let inbox = Inbox::new(device, 64);
            let core = DeviceCore::new(state, host.clone(), None, Box::new(Sink(log.clone())));
            cores.push((core, inbox.clone()));
            slots.push(DeviceSlot {
                id: device,
                inbox,
                timelines,
            });
        }
        let dispatcher = Dispatcher::new(slots, std::sync::Arc::new(|_, _| true), host);
        Devices {
            dispatcher,
            cores,
            log,
        }
    }

    /// Device `d` decides what was posted to it.
    fn run(&mut self, d: usize) {
        let (core, inbox) = &mut self.cores[d];
        let _ = core.run(inbox);
    }

    /// Device `d` decides, then `a` is answered.
    fn get<T: Clone>(&mut self, d: usize, a: Answer<T>) -> T {
        self.run(d);
        block_on(answer(a)).expect("answered")
    }

    /// Everything device `d` issued completes.
    fn complete(&self, d: usize) {
        let state = self.cores[d].0.state();
        state.timeline(0).expect("stream 0").signal(state.issued(0));
    }
}

/// A copy's destination half that waits for the source's answer has decided nothing: a
/// pool its device releases meanwhile (returning the memory of finalized contexts after its
/// batch) is placed before the plans the copy makes once it goes on. It used to be placed
/// at the end of the copy's stamps, after those plans: when the copy's new merge buffer
/// took the released pool's id, the graph checker of the random programs saw the copy into
/// the new pool come before the release of the old one ("missing edge: ... copy ... ->
/// d1:p1+0 must complete before the release of d1 PoolId(1)").
#[test]
fn a_release_while_a_copy_waits_for_its_source_comes_before_the_copy() {
    let mut devices = Devices::new(2);
    let x = TensorNode::new("x", DType::F32, [4]);
    let a = devices.dispatcher.new_context(0, 0).unwrap();
    let c0 = devices.get(0, a);
    let a = devices
        .dispatcher
        .link(&c0, kernels::fill(&x, 1.0).unwrap())
        .unwrap();
    let fill = devices.get(0, a);
    devices.dispatcher.schedule(&fill, fill.bindings()).unwrap();
    devices.run(0);
    // Device 1: two contexts with a pool each, finalized while their memsets still run.
    let a = devices.dispatcher.new_context(1, 0).unwrap();
    let c1 = devices.get(1, a);
    let mut children = Vec::new();
    for name in ["y", "z"] {
        let n = TensorNode::new(name, DType::F32, [1024]);
        let a = devices
            .dispatcher
            .link(&c1, kernels::fill(&n, 2.0).unwrap())
            .unwrap();
        children.push(devices.get(1, a).context().clone());
    }
    for child in &children {
        let a = devices.dispatcher.finalize(child).unwrap();
        devices.get(1, a);
    }
    // Copy x into device 1's merge buffer: the destination half decides first and waits.
    devices
        .dispatcher
        .device_to_device(&x, fill.context(), &c1, MergeBufferUse::Copy)
        .unwrap()
        .expect("a copy");
    devices.complete(1);
    let before = devices.log.lock().unwrap().len();
    devices.run(1);
    let released: Vec<Seen> = devices.log.lock().unwrap()[before..].to_vec();
    assert!(
        released.iter().any(|s| matches!(
            s,
            Seen::Release {
                device: DeviceId(1),
                ..
            }
        )),
        "device 1 releases an empty pool while the copy waits: {released:?}"
    );
    // The source answers; the destination makes the copy into a new merge buffer.
    devices.run(0);
    devices.run(1);
    let log = devices.log.lock().unwrap().clone();
    let mut checked = 0;
    for (i, s) in log.iter().enumerate() {
        let Seen::Release {
            device,
            pool,
            placed,
        } = *s
        else {
            continue;
        };
        for later in &log[i + 1..] {
            match *later {
                Seen::Plan {
                    device: d,
                    pool: p,
                    issue,
                } if d == device && p == pool => {
                    checked += 1;
                    assert!(
                        placed <= issue,
                        "the release of {device} {pool:?} is placed at {placed}, after the \
                         plan on the new {pool:?} made after it ({issue}): {log:?}"
                    );
                }
                Seen::Release {
                    device: d, pool: p, ..
                } if d == device && p == pool => break,
                _ => {}
            }
        }
    }
    assert!(
        checked > 0,
        "the copy's merge buffer takes the released pool's id: {log:?}"
    );
}
