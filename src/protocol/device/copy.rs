//! Device-to-device operations, DESIGN.md §3 rule 3, one device's half at a time. The source
//! describes its buffer as a [`Source`] and records the remote read. The destination plans the
//! copy or the streaming consumer. [`device_to_device`] composes the halves for one owner.

use super::DeviceState;
use crate::{
    error::{Error, Result},
    event::Event,
    ids::BufferLoc,
    node::TensorNode,
    protocol::{
        context::Context,
        host::{DeviceCopy, HostTable},
        plan::{Dep, DepKind, Deps, GlobalLoc, Plan, Plans, Work},
        tables::BufferUses,
    },
};

/// A buffer read by a device-to-device operation, as seen by its source device.
///
/// Made only by [`DeviceState::source`] (private fields): the plans made from it read
/// `loc` after `deps`, so a hand-made one could read a buffer while it is written.
#[derive(Clone, Debug)]
pub struct Source {
    /// The node.
    pub(crate) node: TensorNode,
    /// Where the source buffer is.
    pub(crate) loc: GlobalLoc,
    /// Its size in bytes.
    pub(crate) bytes: u64,
    /// What a reader of it must wait for (its last write).
    pub(crate) deps: Deps,
    /// The host version its content corresponds to (see [`HostTable`]).
    pub(crate) host_version: Option<u64>,
    /// `UninitialisedRead` when nothing has written the buffer: raised by the destination
    /// step, after its own checks, so that errors come in the order of the reference.
    pub(crate) unwritten: Option<Box<Error>>,
}

impl Source {
    /// The node.
    pub fn node(&self) -> &TensorNode {
        &self.node
    }

    /// Where the source buffer is.
    pub fn loc(&self) -> GlobalLoc {
        self.loc
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What a reader of it must wait for (its last write).
    pub fn deps(&self) -> &[Dep] {
        &self.deps
    }

    /// The host version its content corresponds to (see [`HostTable`]).
    pub fn host_version(&self) -> Option<u64> {
        self.host_version
    }

    /// [`Error::UninitialisedRead`] if nothing has written the source buffer (no routine,
    /// copy or upload; the node neither hosted nor declared zeroed): a copy of it would
    /// deliver whatever the allocation held.
    pub fn check_written(&self) -> Result<()> {
        match &self.unwritten {
            Some(e) => Err((**e).clone()),
            None => Ok(()),
        }
    }
}

impl DeviceState {
    /// Describes `node`'s buffer in `ctx` as the source of a device-to-device operation.
    pub fn source(&mut self, ctx: &Context, node: &TensorNode) -> Result<Source> {
        self.check_context(ctx)?;
        let loc = self.entry(ctx, node)?.loc;
        let unwritten = self
            .check_written(ctx, node, loc, || "a copy".into())
            .err()
            .map(Box::new);
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        let mut deps = Deps::new();
        rec.uses.read_deps(&mut deps);
        Ok(Source {
            node: node.clone(),
            loc: GlobalLoc {
                device: self.device,
                loc,
            },
            bytes: rec.bytes,
            deps,
            host_version: rec.host_version,
            unwritten,
        })
    }

    /// Whether the buffer of hosted `node` in `ctx` lags its host array: a host write came
    /// after the value it holds (or it was never uploaded), so what it stands for is the
    /// host array's value, which a routine reading it would upload first (rule 2).
    /// `false` for a node that is not hosted.
    pub fn lags(&self, ctx: &Context, node: &TensorNode, host: &HostTable) -> Result<bool> {
        self.check_context(ctx)?;
        let loc = self.entry(ctx, node)?.loc;
        Ok(node.mode().is_hosted()
            && self
                .buffers
                .get(&loc)
                .is_some_and(|r| r.host_version != Some(host.version(node.id()))))
    }

    /// Before a device-to-device operation reads `source` (described by
    /// [`DeviceState::source`] for `ctx`): if its buffer lags the host array, plans the
    /// upload that a routine reading it would do, on `ctx`'s stream, and makes the source's
    /// readers wait for that upload instead of the buffer's last write.
    ///
    /// The upload is an operation of this device like any [`DeviceState::from_host`]: it
    /// is recorded in the tables when planned, so the returned plan must be submitted
    /// whatever happens to the destination step afterwards. `None` when nothing lags.
    pub fn upload_lagging_source(
        &mut self,
        ctx: &Context,
        source: &mut Source,
        host: &mut HostTable,
    ) -> Result<Option<Plan>> {
        if !self.lags(ctx, &source.node, host)? {
            return Ok(None);
        }
        let plan = self.plan_from_host(ctx.stream(), &source.node, source.loc.loc, host)?;
        source.deps = std::iter::once(Dep {
            event: plan.event.clone(),
            kind: DepKind::Data,
        })
        .collect();
        source.host_version = Some(host.version(source.node.id()));
        Ok(Some(plan))
    }

    /// Records that `event` (on any stream, any device) reads the buffer at `loc`.
    pub fn record_remote_read(&mut self, loc: BufferLoc, event: Event) {
        if mutant!("d2d_reader") {
            return;
        }
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.record_read(event);
        }
    }

    /// Forgets `event` as a reader of the buffer at `loc`: it was recorded by
    /// [`DeviceState::record_remote_read`] as a deferred event, and its operation was
    /// refused by its device (nothing reads the buffer).
    pub fn forget_remote_read(&mut self, loc: BufferLoc, event: &Event) {
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.forget_read(event);
        }
    }

    /// Copies `source` into `dst_ctx`: into the node's own buffer (`into_merge == false`,
    /// mode `No`) or into the stream's merge buffer (mode `Copy`).
    ///
    /// Returns `None` when there is nothing to do (the source *is* the destination buffer).
    /// The caller must record the returned plan's event as a reader of the source.
    pub fn copy_in(
        &mut self,
        dst_ctx: &Context,
        source: &Source,
        into_merge: bool,
        host: &mut HostTable,
    ) -> Result<Option<Plan>> {
        self.check_context(dst_ctx)?;
        let stream = dst_ctx.stream();
        let node = &source.node;
        if !into_merge {
            let loc = self.entry(dst_ctx, node)?.loc;
            let dst = self.global(loc);
            if dst == source.loc {
                return Ok(None);
            }
            source.check_written()?;
            let Some(rec) = self.buffers.get_mut(&loc) else {
                return Err(Error::BufferNotFound {
                    node: node.to_string(),
                    loc,
                });
            };
            let mut deps = source.deps.clone();
            rec.uses.write_deps(stream, &mut deps);
            let event = self.issue(stream);
            if let Some(rec) = self.buffers.get_mut(&loc) {
                rec.uses.record_write(event.clone());
                rec.written = true;
                rec.host_version = source.host_version;
            }
            if node.mode().is_hosted() {
                let order = host.order();
                let current = Some(host.version(node.id()));
                let hrec = host.record(node)?;
                if source.host_version == current {
                    hrec.device_wrote(DeviceCopy { stream, loc: dst }, order);
                } else {
                    // Not reached through `device_to_device`, which uploads a lagging
                    // source first; kept for a caller that composes the steps itself.
                    // The source lags the host array (a host write came after its value),
                    // so what it holds counts as the host's value: it would be uploaded
                    // before any routine read it (rule 2). So does the copy: it lags too,
                    // and is not a device value newer than the host. Counting it as the
                    // newest device write made the next host read transfer the stale value
                    // over the host write.
                    hrec.host_caught_up(Some(dst), order);
                }
            }
            return Ok(Some(Plan {
                issue: self.next_issue(),
                stream,
                event,
                deps,
                work: Work::Copy {
                    src: source.loc,
                    dst,
                    bytes: source.bytes,
                },
            }));
        }
        // Merge buffer: grows when a larger node arrives; the old one is retired after
        // its pending uses (rule 5), and reuse waits for the previous consumer (rule 4).
        source.check_written()?;
        let idx = stream.index as usize;
        let retire = self.streams[idx].merge.uses.all_events();
        let alloc = self
            .pools
            .merge_buffer(stream, source.bytes, retire, &mut *self.memory)?;
        let slot = &mut self.streams[idx].merge;
        if slot.alloc.map(|a| a.loc) != Some(alloc.loc) {
            slot.uses = BufferUses::default();
        }
        let mut deps = source.deps.clone();
        slot.uses.write_deps(stream, &mut deps);
        let event = self.issue(stream);
        let slot = &mut self.streams[idx].merge;
        slot.uses.record_write(event.clone());
        slot.alloc = Some(alloc);
        slot.node = Some(node.clone());
        Ok(Some(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::Copy {
                src: source.loc,
                dst: GlobalLoc {
                    device: self.device,
                    loc: alloc.loc,
                },
                bytes: source.bytes,
            },
        }))
    }
}

/// What [`device_to_device`] planned. Submit `upload` (when there is one) whatever
/// `destination` says: it is already recorded in the source device's tables.
#[derive(Debug)]
pub struct DeviceToDevicePlans {
    /// The upload of a source buffer that lagged its host array, on the source's stream.
    pub upload: Option<Plan>,
    /// The copy or the streaming consumer (with the consumer's own uploads first), empty
    /// when both contexts share the buffer; or why the destination step failed after the
    /// upload was planned (a merge buffer that could not be allocated).
    pub destination: Result<Plans>,
}

/// Plans a device-to-device operation of `node` from `src` (on `devices[si]`) to `dst` (on
/// `devices[di]`; may be the same device) (DESIGN.md §3, rule 3):
///
/// 1. every check that can refuse the operation, with nothing planned yet;
/// 2. the source describes its buffer and, if it lags the host array, plans its upload (a
///    copy never reads a stale value: a lagging buffer stands for the host's value);
/// 3. the destination plans the copy or the streaming consumer and assigns its event;
/// 4. the source records that event as a reader.
///
/// Nothing is planned when both contexts share the buffer (mode `No`). `can_stream` says
/// whether the destination can read the source in place. An `Err` means nothing was
/// planned; a failure after the upload was planned is in
/// [`DeviceToDevicePlans::destination`].
///
/// The single-owner composition used by [`crate::Engine`] and the loom models; the actor
/// coordinator performs the same steps with messages.
#[allow(clippy::too_many_arguments)]
pub fn device_to_device(
    devices: &mut [DeviceState],
    si: usize,
    di: usize,
    node: &TensorNode,
    src: &Context,
    dst: &Context,
    mode: crate::protocol::MergeBufferUse,
    can_stream: bool,
    host: &mut HostTable,
) -> Result<DeviceToDevicePlans> {
    use crate::protocol::MergeBufferUse;
    let count = devices.len();
    let unknown = |index: usize| Error::NoSuchDevice { index, count };
    devices
        .get(di)
        .ok_or_else(|| unknown(di))?
        .check_context(dst)?;
    check_streaming_placement(&mode, src, dst, can_stream)?;
    let mut source = devices
        .get_mut(si)
        .ok_or_else(|| unknown(si))?
        .source(src, node)?;
    let dst_state = devices.get(di).ok_or_else(|| unknown(di))?;
    match &mode {
        MergeBufferUse::No => {
            let loc = dst_state.entry(dst, node)?.loc;
            if dst_state.global(loc) == source.loc {
                return Ok(DeviceToDevicePlans {
                    upload: None,
                    destination: Ok(Plans::new()),
                });
            }
        }
        MergeBufferUse::Copy => {}
        MergeBufferUse::StreamingFor(routine) => dst_state.check_streaming(routine, &source)?,
    }
    let upload = devices[si].upload_lagging_source(src, &mut source, host)?;
    let dst_state = &mut devices[di];
    let destination = match mode {
        MergeBufferUse::No | MergeBufferUse::Copy => {
            let into_merge = matches!(mode, MergeBufferUse::Copy);
            dst_state
                .copy_in(dst, &source, into_merge, host)
                .map(|plan| plan.into_iter().collect::<Plans>())
        }
        MergeBufferUse::StreamingFor(routine) => {
            dst_state.schedule_streaming(&routine, &source, host)
        }
    };
    if let Some(last) = destination.as_ref().ok().and_then(|p| p.last()) {
        devices[si].record_remote_read(source.loc.loc, last.event.clone());
    }
    Ok(DeviceToDevicePlans {
        upload,
        destination,
    })
}

/// The checks of a `StreamingFor` operation that need no device state: the consumer runs
/// on the destination stream, and the backend can read the source's memory there.
/// Shared by [`device_to_device`] and the actor coordinator.
pub fn check_streaming_placement(
    mode: &crate::protocol::MergeBufferUse,
    src: &Context,
    dst: &Context,
    can_stream: bool,
) -> Result<()> {
    let crate::protocol::MergeBufferUse::StreamingFor(routine) = mode else {
        return Ok(());
    };
    if routine.context().stream() != dst.stream() {
        return Err(Error::InvalidRoutine {
            routine: routine.name().into(),
            reason: format!(
                "streaming consumer runs on {}, destination is {}",
                routine.context().stream(),
                dst.stream()
            ),
        });
    }
    if !can_stream {
        return Err(Error::StreamingUnsupported {
            src: src.device(),
            dst: dst.device(),
            reason: "the backend cannot read that memory in place".into(),
        });
    }
    Ok(())
}
