//! Scheduling a routine: uploads of lagging hosted inputs first, then the waits of DESIGN.md
//! §3 rule 1 and the stream's merge-buffer slot of rule 4.

use std::sync::Arc;

use super::{DeviceState, MergeFrom, Source};
use crate::{
    error::{Error, Result},
    kernels::{Access, Bindings},
    protocol::{
        context::Routine,
        host::{DeviceCopy, HostTable},
        plan::{ArgBinding, Deps, Plan, Plans, Work},
    },
};

impl DeviceState {
    /// Schedules a linked routine: auto-uploads of lagging hosted inputs, then the routine.
    /// A routine that declares indices needs their values: [`DeviceState::schedule_with`].
    pub fn schedule(&mut self, routine: &Routine, host: &mut HostTable) -> Result<Plans> {
        self.schedule_with(routine, &Bindings::none(), host)
    }

    /// [`DeviceState::schedule`] with values for the routine's declared indices, checked
    /// against its declarations first ([`Routine::bind`]: a missing, unknown, repeated or
    /// out-of-range value refuses the schedule and changes nothing) and snapshotted into
    /// the routine's plan.
    pub fn schedule_with(
        &mut self,
        routine: &Routine,
        bindings: &Bindings,
        host: &mut HostTable,
    ) -> Result<Plans> {
        let bindings = routine.bind(bindings)?;
        self.schedule_inner(routine, MergeFrom::Slot, bindings, host)
    }

    /// Schedules `routine` reading `source` in place as its merge buffer (`StreamingFor`).
    ///
    /// The caller must record the routine's event (the last plan's) as a reader of the
    /// source on the source device ([`DeviceState::record_remote_read`]).
    pub fn schedule_streaming(
        &mut self,
        routine: &Routine,
        source: &Source,
        host: &mut HostTable,
    ) -> Result<Plans> {
        self.check_streaming(routine, source)?;
        source.check_written()?;
        let bindings = routine.bind(Bindings::none())?;
        self.schedule_inner(routine, MergeFrom::Source(source), bindings, host)
    }

    /// Checks, without changing anything, that `routine` can be scheduled on this device
    /// reading `source` in place (`StreamingFor`): the checks of
    /// [`DeviceState::schedule_streaming`], made before a device-to-device operation
    /// plans anything on the source device.
    pub fn check_streaming(&self, routine: &Routine, source: &Source) -> Result<()> {
        self.check_context(routine.context())?;
        // A streaming consumer is scheduled without index values.
        routine.bind(Bindings::none())?;
        self.resolve(routine, &MergeFrom::Source(source))
            .map(|_| ())
    }

    /// Resolves the bindings of `routine` and its merge argument, and checks everything
    /// that can make scheduling it fail, without touching any table.
    fn resolve(
        &self,
        routine: &Routine,
        merge_from: &MergeFrom<'_>,
    ) -> Result<(Arc<[ArgBinding]>, Option<ArgBinding>)> {
        let ctx = routine.context();
        let stream = ctx.stream();
        let spec = &routine.0.spec;
        // Resolved when the routine was linked; its buffers must still be live.
        let bindings = routine.0.args.clone();
        for (p, b) in spec.params.iter().zip(bindings.iter()) {
            if !self.buffers.contains_key(&b.loc.loc) {
                return Err(Error::BufferNotFound {
                    node: p.node.to_string(),
                    loc: b.loc.loc,
                });
            }
        }
        if let MergeFrom::Source(src) = merge_from {
            if spec.merge.is_none() {
                return Err(Error::InvalidRoutine {
                    routine: spec.name.clone(),
                    reason: format!(
                        "it reads no merge buffer, so it cannot consume {}",
                        src.node
                    ),
                });
            }
            // Read in place while the kernel writes the same buffer: the kernel would get
            // overlapping shared and mutable views.
            if bindings
                .iter()
                .any(|b| b.loc == src.loc && b.access.writes())
            {
                return Err(Error::StreamingUnsupported {
                    src: src.loc.device,
                    dst: self.device,
                    reason: format!(
                        "the source buffer of {} is written by the consumer {}",
                        src.node, spec.name
                    ),
                });
            }
        }
        let merge = match (&spec.merge, merge_from) {
            (None, _) => None,
            (Some(expected), MergeFrom::Slot) => {
                let slot = &self.streams[stream.index as usize].merge;
                match (&slot.node, slot.alloc) {
                    (Some(n), Some(a)) if n == expected || mutant!("merge_check") => {
                        Some(ArgBinding {
                            loc: self.global(a.loc),
                            bytes: expected.size_in_bytes()?,
                            dtype: expected.dtype(),
                            shape: expected.shape().clone(),
                            access: Access::Read,
                        })
                    }
                    (found, _) => {
                        return Err(Error::MergeBufferMismatch {
                            stream,
                            expected: expected.to_string(),
                            found: found.as_ref().map_or("nothing".into(), |n| n.to_string()),
                        })
                    }
                }
            }
            (Some(expected), MergeFrom::Source(src)) => {
                if &src.node != expected {
                    return Err(Error::MergeBufferMismatch {
                        stream,
                        expected: expected.to_string(),
                        found: src.node.to_string(),
                    });
                }
                Some(ArgBinding {
                    loc: src.loc,
                    bytes: src.bytes,
                    dtype: expected.dtype(),
                    shape: expected.shape().clone(),
                    access: Access::Read,
                })
            }
        };
        Ok((bindings, merge))
    }

    fn schedule_inner(
        &mut self,
        routine: &Routine,
        merge_from: MergeFrom<'_>,
        bindings: Bindings,
        host: &mut HostTable,
    ) -> Result<Plans> {
        let ctx = routine.context().clone();
        self.check_context(&ctx)?;
        let stream = ctx.stream();
        let spec = &routine.0.spec;

        // Resolve every binding before touching any table.
        let (args, merge) = self.resolve(routine, &merge_from)?;
        for (p, b) in spec.params.iter().zip(args.iter()) {
            if !matches!(p.access, Access::Write) {
                self.check_written(&ctx, &p.node, b.loc.loc, || {
                    format!("routine '{}'", spec.name)
                })?;
            }
        }

        // Automatic uploads of hosted inputs whose buffer lags the host array (rule 2).
        let mut plans = Plans::new();
        for (p, b) in spec.params.iter().zip(args.iter()) {
            if p.node.mode().is_hosted() && !matches!(p.access, Access::Write) {
                let version = host.version(p.node.id());
                let lagging = self
                    .buffers
                    .get(&b.loc.loc)
                    .is_some_and(|r| r.host_version != Some(version))
                    && !mutant!("host_upload");
                if lagging {
                    plans.push(self.plan_from_host(stream, &p.node, b.loc.loc, host)?);
                }
            }
        }

        // Rule 1: RAW on inputs, WAR and WAW on outputs (any stream, any device).
        let mut deps = Deps::new();
        for (p, b) in spec.params.iter().zip(args.iter()) {
            if let Some(rec) = self.buffers.get_mut(&b.loc.loc) {
                if !matches!(p.access, Access::Write) {
                    rec.uses.read_deps(&mut deps);
                }
                if !matches!(p.access, Access::Read) {
                    rec.uses.write_deps(stream, &mut deps);
                }
            }
        }
        match &merge_from {
            MergeFrom::Slot if merge.is_some() => {
                self.streams[stream.index as usize]
                    .merge
                    .uses
                    .read_deps(&mut deps);
            }
            MergeFrom::Source(src) => deps.extend(src.deps.iter().cloned()),
            MergeFrom::Slot => {}
        }

        let event = self.issue(stream);
        for (p, b) in spec.params.iter().zip(args.iter()) {
            let Some(rec) = self.buffers.get_mut(&b.loc.loc) else {
                continue;
            };
            if matches!(p.access, Access::Read) {
                rec.uses.record_read(event.clone());
            } else {
                rec.uses.record_write(event.clone());
                rec.written = true;
                rec.host_version = Some(host.version(p.node.id()));
                if p.node.mode().is_hosted() {
                    let order = host.order();
                    host.record(&p.node)?
                        .device_wrote(DeviceCopy { stream, loc: b.loc }, order);
                }
            }
        }
        if let (MergeFrom::Slot, Some(_)) = (&merge_from, &merge) {
            self.streams[stream.index as usize]
                .merge
                .uses
                .record_read(event.clone());
        }
        plans.push(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::Run {
                name: routine.0.name.clone(),
                kernel: spec.kernel.clone(),
                args,
                merge,
                bindings,
            },
        });
        Ok(plans)
    }
}
