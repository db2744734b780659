//! Starting a system: the backend, one arbiter per device with its device and stream actors,
//! the coordinator, and the dispatcher the host posts through.

use std::{
    sync::{atomic::AtomicBool, Arc, Mutex},
    thread::JoinHandle,
};

use actix::{Actor, Addr, Arbiter};
use tributary::{
    backend::{Backend, DeviceInfo, StreamQueue},
    dispatch::{messages::DeviceOp, DeviceCore, DeviceSlot, DeviceTurn, Dispatcher, Inbox},
    protocol::{DeviceState, HostTable},
    trace::Recorder,
    DeviceId, Error, Result, StreamId, Timeline,
};

use crate::{
    config::{SystemBuilder, SystemConfig},
    coordinator::Coordinator,
    device::{DeviceActor, QueueSink},
    stream::StreamActor,
    system::{Shared, System},
};

/// The actors of a started system, and the arbiters they run on.
type Actors = (Vec<Addr<DeviceActor>>, Addr<Coordinator>, Vec<Arbiter>);

/// What the actor thread hands back once every actor is started.
type Started = (
    Vec<Addr<DeviceActor>>,
    Addr<Coordinator>,
    Vec<Arbiter>,
    actix::System,
);

/// One device before its actors start.
struct Device {
    id: DeviceId,
    inbox: tributary::sync::Arc<Inbox<DeviceOp>>,
    timelines: Vec<tributary::sync::Arc<Timeline>>,
}

impl SystemBuilder {
    /// Starts the actor system on its own threads.
    ///
    /// ```
    /// use tributary::backend::BackendKind;
    /// let sys = tributary_actors::System::builder().spawn()?; // 2 CPU devices x 2 streams
    /// assert_eq!((sys.device_count(), sys.device(1).stream_count()), (2, 2));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn spawn(self) -> Result<System> {
        System::spawn(self.config, self.instance)
    }
}

impl System {
    pub(crate) fn spawn(
        config: SystemConfig,
        instance: Option<Arc<dyn Backend>>,
    ) -> Result<System> {
        let recorder = config.record_timeline.then(|| Arc::new(Recorder::new()));
        let backend: Arc<dyn Backend> = match instance {
            Some(backend) => backend,
            None => {
                config
                    .backend
                    .create_with(config.cpu_devices, &config.cpu, recorder.clone())?
            }
        };
        let mut ids = backend.devices();
        if ids.is_empty() {
            return Err(Error::InvalidConfig {
                setting: "cpu_devices".into(),
                value: config.cpu_devices.to_string(),
                reason: "the backend has no devices to run".into(),
            });
        }
        ids.sort();
        let device_info = ids
            .iter()
            .map(|&d| backend.device_info(d))
            .collect::<std::result::Result<Vec<DeviceInfo>, _>>()?;
        let streams = config.streams.streams_per_device();
        let devices: Vec<Device> = ids
            .iter()
            .map(|&id| Device {
                id,
                inbox: Inbox::new(id, config.mailbox_capacity),
                timelines: (0..streams as u32)
                    .map(|index| Timeline::new(StreamId { device: id, index }))
                    .collect(),
            })
            .collect();
        // Whether each device can read each other's memory in place, asked once here: the
        // dispatcher lives on the host side and must not keep the backend alive there.
        let streamable: Vec<Vec<bool>> = ids
            .iter()
            .map(|&s| ids.iter().map(|&d| backend.can_stream(s, d)).collect())
            .collect();
        let index = ids.clone();
        let can_stream = Arc::new(move |s: DeviceId, d: DeviceId| {
            match (
                index.iter().position(|&x| x == s),
                index.iter().position(|&x| x == d),
            ) {
                (Some(s), Some(d)) => streamable[s][d],
                _ => false,
            }
        });
        let host = tributary::sync::Arc::new(tributary::sync::Mutex::new(HostTable::default()));
        let dispatcher = Arc::new(
            Dispatcher::new(
                devices
                    .iter()
                    .map(|d| DeviceSlot {
                        id: d.id,
                        inbox: d.inbox.clone(),
                        timelines: d.timelines.clone(),
                    })
                    .collect(),
                can_stream,
                host.clone(),
            )
            .with_auto_replay(config.auto_replay, recorder.clone()),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let cfg = config.clone();
        let d2 = dispatcher.clone();
        let thread: JoinHandle<()> = std::thread::Builder::new()
            .name("tributary-actix".into())
            .spawn(move || {
                let sys = actix::System::new();
                let started =
                    sys.block_on(async move { start_actors(&cfg, backend, host, devices, d2) });
                let ok = started.is_ok();
                let _ = tx.send(started.map(|(d, c, a)| (d, c, a, actix::System::current())));
                if ok {
                    let _ = sys.run();
                }
            })
            .map_err(|e| Error::Io {
                what: "spawn the actor thread".into(),
                message: e.to_string(),
            })?;
        let (addrs, coordinator, arbiters, actix): Started = rx
            .recv()
            .map_err(|_| Error::ShutDown("actor thread died during start-up".into()))??;
        Ok(System {
            shared: Arc::new(Shared {
                dispatcher,
                streams: vec![streams; addrs.len()],
                devices: addrs,
                coordinator,
                actix,
                thread: Mutex::new(Some(thread)),
                arbiters: Mutex::new(arbiters),
                shut_down: AtomicBool::new(false),
                config,
                recorder,
                device_info,
                order: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }
}

/// Starts, on the actor thread, every device's arbiter with its stream actors and device
/// actor, and the coordinator.
fn start_actors(
    config: &SystemConfig,
    backend: Arc<dyn Backend>,
    host: tributary::sync::Arc<tributary::sync::Mutex<HostTable>>,
    devices: Vec<Device>,
    dispatcher: Arc<Dispatcher>,
) -> Result<Actors> {
    let mut addrs = Vec::new();
    let mut arbiters = Vec::new();
    for (index, device) in devices.into_iter().enumerate() {
        let arbiter = Arbiter::new();
        let mut queues: Vec<Arc<dyn StreamQueue>> = Vec::new();
        let mut stream_addrs = Vec::new();
        let mut watches = Vec::new();
        for timeline in &device.timelines {
            // SAFETY: `timeline` is fresh and completed only by this queue; the plans it
            // receives are those of the `DeviceState` made below from these timelines (its
            // device core submits them, and nothing else does), whose pool memory is
            // `backend`'s `device.id`; every device lives on such queues.
            let queue: Arc<dyn StreamQueue> =
                Arc::from(unsafe { backend.start_stream(timeline.stream(), timeline.clone()) }?);
            let (addr, watch) = StreamActor::start(
                &arbiter.handle(),
                timeline.stream(),
                queue.clone(),
                timeline.clone(),
            );
            queues.push(queue);
            stream_addrs.push(addr);
            watches.push(watch);
        }
        let mut pools = config.pools.clone();
        pools.min_alignment = pools.min_alignment.max(backend.min_alignment(device.id));
        let memory = tributary::backend::BackendMemory::new(backend.clone(), device.id);
        let state = DeviceState::new(device.id, device.timelines.clone(), pools, Box::new(memory));
        let core = DeviceCore::new(
            state,
            host.clone(),
            Some(backend.clone()),
            Box::new(QueueSink::new(queues, watches)),
        );
        let turn = DeviceTurn::new(core, device.inbox.clone());
        if config.decide_on_posting_thread {
            turn.decide_on_posting_threads();
        }
        let d = dispatcher.clone();
        let addr = DeviceActor::start_in_arbiter(&arbiter.handle(), move |_| {
            DeviceActor::new(turn, d, index, stream_addrs)
        });
        addrs.push(addr);
        arbiters.push(arbiter);
    }
    let coordinator = Coordinator::new(dispatcher).start();
    Ok((addrs, coordinator, arbiters))
}
