//! The network stream's side: what runs when a network operation's routine runs, and the
//! state that keeps the ranks in step.
//!
//! Every network operation's kernel runs [`Network::execute`] on the network stream's worker.
//! It takes its entry from the issue queue, exchanges headers, then moves the data, polled
//! against the deadline. Small payloads travel in their header's message (one message per
//! peer instead of two: [`PIGGYBACK_MAX_BYTES`]); nothing received is used before the
//! headers agree. An entry still queued with a failed event had its kernel skipped.
//! The next kernel first sends that entry's header with [`Status::InputFailed`], and
//! [`Network::flush`] does the same at shutdown. `network/wire.rs` holds what each operation
//! sends and receives once the ranks agreed. See DESIGN.md §9, "Issue order and failed
//! inputs" and "Faults".

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard, OnceLock,
    },
    time::{Duration, Instant},
};

use tributary::{kernels::ArgError, Error, Event, EventStatus, Result};

use crate::Ticket;

mod wire;

pub(crate) use wire::check_dtype;

use super::{
    header::{check_headers, CrossRankAlgorithm, Header, OpDesc, OpKind, Status, HEADER_BYTES},
    mpi::{Mpi, Request, WaitError},
    reduce::Wire,
};

/// Payloads of at most this many bytes travel in their header's message: a `Direct`
/// all-reduce's wire input, and a transfer's data. One message per peer then carries both,
/// where a header exchange and then the data cost two one-way latencies (a 4 KiB all-reduce's
/// or a small `send`'s largest fixed cost). Every header receive has room for a header and
/// this much, so a message with a payload is taken whole even by a rank that expected a
/// header alone (a mismatch, reported as such, never a truncation). The receiver uses the
/// payload only once the headers agree: whether one travels is decided from the compared
/// fields (algorithm, element count, dtype), so agreeing ranks decide alike. Above it the
/// copy into the message would cost more than the latency it saves.
pub(crate) const PIGGYBACK_MAX_BYTES: usize = 16 * 1024;

/// The bytes of one rank's message slot: a header, then room for a payload.
pub(crate) const SLOT_BYTES: usize = HEADER_BYTES + PIGGYBACK_MAX_BYTES;
const SLOT_WORDS: usize = SLOT_BYTES / 8;

/// The cluster's network settings that every rank must share (they decide the algorithm).
#[derive(Clone, Debug)]
pub(crate) struct NetworkConfig {
    pub(crate) deadline: Duration,
    pub(crate) algorithm: CrossRankAlgorithm,
    pub(crate) direct_max_bytes: usize,
    pub(crate) chunk_bytes: usize,
}

/// One network operation, from its issue to its completion.
pub(crate) struct Issued {
    pub(crate) seq: u64,
    pub(crate) desc: OpDesc,
    /// How many contributions this rank adds (its contexts; all-reduce only).
    pub(crate) contributions: usize,
    /// The ticket of its routine, set right after it was scheduled or replayed (the host
    /// does not wait for the device's decision).
    pub(crate) event: OnceLock<EntryTicket>,
    /// The typed error it failed with on the network stream, if it did.
    pub(crate) error: OnceLock<Error>,
}

/// How a network operation's event is known.
pub(crate) enum EntryTicket {
    /// Its routine was scheduled: the routine's ticket.
    Issued(Ticket),
    /// It was replayed as part of a captured step: `back` operations before the last one
    /// of the network stream's part of that replay, whose ticket `last` is (a replay runs
    /// a stream's operations under consecutive sequence numbers).
    Replayed { last: Ticket, back: u64 },
}

impl EntryTicket {
    /// Its event, once its device decided it (or the error that refused it).
    pub(crate) fn event(&self) -> Result<Event> {
        match self {
            EntryTicket::Issued(t) => t.event(),
            EntryTicket::Replayed { last, back } => {
                let last = last.event()?;
                last.before(*back).ok_or_else(|| {
                    Error::Internal(format!(
                        "a replayed network operation {back} before {last:?}, its stream's \
                         last"
                    ))
                })
            }
        }
    }

    /// Waits for its event.
    pub(crate) fn wait(&self) -> Result<()> {
        self.event()?.wait()
    }
}

impl Issued {
    /// `(typed error or event error)`: what a waiter should see for this operation.
    pub(crate) fn outcome(&self, event_result: Result<()>) -> Result<()> {
        match (event_result, self.error.get()) {
            (Ok(()), _) => Ok(()),
            (Err(_), Some(typed)) => Err(typed.clone()),
            (Err(e), None) => Err(e),
        }
    }
}

#[derive(Default)]
struct IssueState {
    queue: VecDeque<Arc<Issued>>,
    next_collective: u64,
    /// Next sequence number of a transfer to / from each rank.
    sent: Vec<u64>,
    received: Vec<u64>,
}

/// What only the network stream's worker touches.
struct ExecState {
    /// The fault that broke the cluster (every later operation fails with it).
    broken: Option<Error>,
    /// Receive buffers (f64 words: aligned for every element type).
    staging: Vec<f64>,
    /// The message slots of the last header exchange (one per rank for a collective, two
    /// for a transfer: [`SLOT_BYTES`] each), kept for the next: the payloads that came
    /// with the headers are read from here.
    slots: Vec<f64>,
    /// This rank's contribution to an all-reduce in place, copied aside (kept for the
    /// next).
    own: Vec<f64>,
    /// Requests and buffers given up at a fault: never waited for, never freed, so that
    /// whatever MPI may still do with them (at the latest in `MPI_Finalize`) finds them.
    abandoned: Vec<(Vec<Request>, Vec<f64>)>,
}

/// The rank's network: MPI, the issue queue and the worker's state.
pub(crate) struct Network {
    mpi: Mpi,
    config: NetworkConfig,
    issue: Mutex<IssueState>,
    exec: Mutex<ExecState>,
    closed: AtomicBool,
    finalized: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a panic in code that only updates plain fields; the state
    // stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Message tags: `(sequence mod 4096) << 3 | phase`, at most 32767 (the smallest
/// `MPI_TAG_UB` the standard allows). Operations in flight at once are never 4096 apart:
/// a collective cannot finish on one rank before every rank started it.
mod phase {
    pub(super) const HEADER: i32 = 0;
    pub(super) const DIRECT: i32 = 1;
    pub(super) const SCATTER: i32 = 2;
    pub(super) const GATHER: i32 = 3;
    pub(super) const TRANSFER_HEADER: i32 = 4;
    pub(super) const TRANSFER_DATA: i32 = 5;
}

fn tag(seq: u64, phase: i32) -> i32 {
    (((seq % 4096) as i32) << 3) | phase
}

/// Whether an error stops the cluster: after it the ranks are no longer known to be in step.
fn breaks_cluster(e: &Error) -> bool {
    matches!(
        e,
        Error::RankUnreachable { .. } | Error::CollectiveMismatch { .. } | Error::Mpi { .. }
    )
}

impl Network {
    pub(crate) fn new(mpi: Mpi, config: NetworkConfig) -> Network {
        let size = mpi.size();
        Network {
            mpi,
            config,
            issue: Mutex::new(IssueState {
                sent: vec![0; size],
                received: vec![0; size],
                ..IssueState::default()
            }),
            exec: Mutex::new(ExecState {
                broken: None,
                staging: Vec::new(),
                slots: Vec::new(),
                own: Vec::new(),
                abandoned: Vec::new(),
            }),
            closed: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.mpi.rank()
    }

    pub(crate) fn size(&self) -> usize {
        self.mpi.size()
    }

    pub(crate) fn mpi(&self) -> &Mpi {
        &self.mpi
    }

    /// The algorithm an all-reduce of `bytes` wire bytes uses (the same on every rank with
    /// the same configuration; the header carries it, so a difference is a mismatch).
    pub(crate) fn algorithm_for(
        &self,
        chosen: Option<CrossRankAlgorithm>,
        wire_bytes: usize,
    ) -> CrossRankAlgorithm {
        match chosen.unwrap_or(self.config.algorithm) {
            CrossRankAlgorithm::Auto if wire_bytes <= self.config.direct_max_bytes => {
                CrossRankAlgorithm::Direct
            }
            CrossRankAlgorithm::Auto => CrossRankAlgorithm::Ring,
            a => a,
        }
    }

    // ------------------------------------------------------------------------------------
    // The host's side: issue order.
    // ------------------------------------------------------------------------------------

    /// Appends an operation to the issue queue and gives it its sequence number (the
    /// collective counter, or the counter of transfers between its two ranks).
    pub(crate) fn issue(&self, desc: OpDesc, contributions: usize) -> Arc<Issued> {
        let mut st = lock(&self.issue);
        let seq = match (desc.kind, desc.route) {
            (OpKind::Transfer, Some((from, to))) => {
                let (counters, peer) = if from == self.rank() {
                    (&mut st.sent, to)
                } else {
                    (&mut st.received, from)
                };
                let last = counters.len() - 1;
                let c = &mut counters[peer.min(last)];
                let seq = *c;
                *c += 1;
                seq
            }
            (OpKind::Raw, _) => u64::MAX,
            _ => {
                let seq = st.next_collective;
                st.next_collective += 1;
                seq
            }
        };
        let issued = Arc::new(Issued {
            seq,
            desc,
            contributions,
            event: OnceLock::new(),
            error: OnceLock::new(),
        });
        st.queue.push_back(issued.clone());
        issued
    }

    /// Takes back an operation whose scheduling was refused (nothing will run it). Only the
    /// newest operation can be refused (the host issues one at a time), so its sequence
    /// number is returned to its counter.
    pub(crate) fn retract(&self, issued: &Arc<Issued>) {
        let mut st = lock(&self.issue);
        if st.queue.back().is_some_and(|b| Arc::ptr_eq(b, issued)) {
            st.queue.pop_back();
            match (issued.desc.kind, issued.desc.route) {
                (OpKind::Transfer, Some((from, to))) => {
                    if from == self.mpi.rank() {
                        st.sent[to] -= 1;
                    } else {
                        st.received[from] -= 1;
                    }
                }
                (OpKind::Raw, _) => {}
                _ => st.next_collective -= 1,
            }
        }
    }

    /// The operations whose kernel will never run (their event failed, or their device
    /// refused them) before the first that may still run, taken off the queue, then that
    /// one (left queued unless `take`). Only one thread takes from the front at a time (the
    /// network stream's worker, or the shutdown after it drained); the host only pushes to
    /// and retracts from the back.
    fn front(&self, take: bool) -> (Vec<Arc<Issued>>, Option<Arc<Issued>>) {
        let mut skipped = Vec::new();
        loop {
            let Some(first) = lock(&self.issue).queue.front().cloned() else {
                return (skipped, None);
            };
            // Its device decided it before the running kernel's operation, issued after it
            // (one device decides both, in issue order), so this wait ends at once; it is
            // outside the lock all the same.
            let never_runs = first.event.get().is_some_and(|t| match t.event() {
                Ok(e) => matches!(e.status(), EventStatus::Failed(_)),
                Err(_) => true,
            });
            let mut st = lock(&self.issue);
            if never_runs {
                if let Some(s) = st.queue.pop_front() {
                    skipped.push(s);
                }
                continue;
            }
            let me = if take { st.queue.pop_front() } else { None };
            return (skipped, me);
        }
    }

    // ------------------------------------------------------------------------------------
    // The network stream's side.
    // ------------------------------------------------------------------------------------

    /// Runs the network operation whose kernel is running now: first catches up the
    /// operations skipped before it, then `body` unless the cluster is broken or closed.
    /// Records a typed error on the operation, and breaks the cluster on a fault.
    pub(crate) fn execute(
        &self,
        body: impl FnOnce(&Network, &mut ExecGuard<'_>, &Issued) -> Result<()>,
    ) -> std::result::Result<(), String> {
        let (skipped, me) = self.front(true);
        let mut guard = ExecGuard {
            state: lock(&self.exec),
        };
        for s in &skipped {
            self.catch_up(&mut guard, s);
        }
        let Some(me) = me else {
            return Err("a network routine ran that the cluster did not issue".into());
        };
        let result = if self.closed.load(Ordering::Acquire) {
            Err(Error::ShutDown("the cluster is shut down".into()))
        } else if let Some(b) = &guard.state.broken {
            Err(b.clone())
        } else {
            body(self, &mut guard, &me)
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                if breaks_cluster(&e) && guard.state.broken.is_none() {
                    guard.state.broken = Some(e.clone());
                }
                let text = e.to_string();
                let _ = me.error.set(e);
                Err(text)
            }
        }
    }

    /// [`Network::execute`] of `body` on `view`, the kernel's view of the operation's data;
    /// a view the kernel could not get is this rank's failed input (the other ranks are
    /// told, as for an input whose event failed).
    pub(crate) fn execute_on<V>(
        &self,
        view: std::result::Result<V, ArgError>,
        body: impl FnOnce(&Network, &mut ExecGuard<'_>, &Issued, V) -> Result<()>,
    ) -> std::result::Result<(), String> {
        self.execute(|net, guard, op| match view {
            Ok(v) => body(net, guard, op, v),
            Err(e) => net.input_failed(guard, op, e.to_string()),
        })
    }

    /// Sends the header of an operation whose input failed here, so the others fail it too.
    fn catch_up(&self, guard: &mut ExecGuard<'_>, skipped: &Issued) {
        if guard.state.broken.is_some()
            || self.closed.load(Ordering::Acquire)
            || mutant!("cluster_catch_up")
        {
            return;
        }
        let algorithm = match skipped.desc.kind {
            OpKind::AllReduce => {
                self.algorithm_for(skipped.desc.algorithm, wire_bytes(&skipped.desc))
            }
            _ => CrossRankAlgorithm::Direct,
        };
        let result = match skipped.desc.kind {
            OpKind::AllReduce | OpKind::Barrier => self
                .exchange_headers(guard, skipped, algorithm, Status::InputFailed, 0, &[])
                .map(|_| ()),
            OpKind::Transfer => self
                .transfer_headers(guard, skipped, Status::InputFailed, &[])
                .map(|_| ()),
            OpKind::Raw => Ok(()),
        };
        // The others learn of it through the header; this rank's own operation already
        // failed with its root cause. Only a fault matters here.
        if let Err(e) = result {
            if breaks_cluster(&e) {
                guard.state.broken = Some(e);
            }
        }
    }

    /// Catches up skipped operations at the end (the last ones may have failed with nothing
    /// after them), then marks the network closed. Called by the cluster's shutdown after
    /// the network stream drained.
    pub(crate) fn flush_and_close(&self) {
        let (skipped, _) = self.front(false);
        let mut guard = ExecGuard {
            state: lock(&self.exec),
        };
        for s in &skipped {
            self.catch_up(&mut guard, s);
        }
        self.closed.store(true, Ordering::Release);
    }

    /// Ends MPI, once. Abandoned requests and buffers are kept until after it.
    ///
    /// `MPI_Finalize` waits for every rank (Open MPI fences all processes), a dead one
    /// included: after a rank became unreachable it may never return. So on a cluster a
    /// rank fault broke, it runs on a thread of its own and is waited for at most the
    /// deadline; past it, the fault is returned and the thread is left to finish or to end
    /// with the process. `keep_alive` (the pools MPI may still write into) and the network
    /// (abandoned requests and their buffers) live as long as that thread: whatever MPI
    /// still does with them finds them alive. On a healthy cluster it runs here and waits
    /// for the other ranks' shutdowns, as MPI defines.
    pub(crate) fn finalize(
        self: &Arc<Self>,
        keep_alive: Box<dyn std::any::Any + Send>,
    ) -> Result<()> {
        if self.finalized.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.closed.store(true, Ordering::Release);
        let broken = lock(&self.exec).broken.clone();
        let Some(fault @ Error::RankUnreachable { .. }) = broken else {
            let _guard = lock(&self.exec);
            self.mpi.finalize();
            return Ok(());
        };
        let (done, finished) = std::sync::mpsc::sync_channel::<()>(1);
        let net = self.clone();
        let spawned = std::thread::Builder::new()
            .name("tributary-mpi-finalize".into())
            .spawn(move || {
                let _keep_alive = keep_alive;
                let _guard = lock(&net.exec);
                net.mpi.finalize();
                let _ = done.send(());
            });
        if spawned.is_err() {
            // No thread to bound it with: finalising here could hang, not finalising only
            // skips MPI's tidy end (the process exits all the same).
            return Err(fault);
        }
        match finished.recv_timeout(self.config.deadline) {
            Ok(()) => Ok(()),
            Err(_) => Err(fault),
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.deadline
    }

    /// Waits for `requests`; a stall or an MPI error abandons them (and `keep`) and is the
    /// typed fault for `op`.
    fn wait(
        &self,
        guard: &mut ExecGuard<'_>,
        mut requests: Vec<Request>,
        keep: Vec<f64>,
        op: &Issued,
        deadline: Instant,
    ) -> Result<Vec<f64>> {
        match self.mpi.wait_all(&mut requests, deadline) {
            Ok(()) => Ok(keep),
            Err(e) => {
                guard.state.abandoned.push((requests, keep));
                Err(match e {
                    WaitError::Mpi(e) => e,
                    WaitError::Stalled(s) => Error::RankUnreachable {
                        rank: s.peer.unwrap_or(usize::MAX),
                        call: op.seq,
                        operation: op.desc.describe(),
                        waited: self.config.deadline,
                    },
                })
            }
        }
    }

    /// The error of a failed post: the requests already posted are abandoned with `keep`.
    fn abandon(
        &self,
        guard: &mut ExecGuard<'_>,
        requests: Vec<Request>,
        keep: Vec<f64>,
        e: Error,
    ) -> Error {
        guard.state.abandoned.push((requests, keep));
        e
    }

    /// The message slots of an exchange with `count` slots, taken from the guard (given
    /// back by the exchange once no request uses them).
    fn take_slots(guard: &mut ExecGuard<'_>, count: usize) -> Vec<f64> {
        let mut slots = std::mem::take(&mut guard.state.slots);
        slots.resize(count * SLOT_WORDS, 0.0);
        slots
    }

    /// The payload that came with rank `slot`'s header in the last exchange (`len` bytes,
    /// at most [`PIGGYBACK_MAX_BYTES`]; meaningful only once the headers agreed that one
    /// travelled).
    pub(super) fn payload<'g>(guard: &'g ExecGuard<'_>, slot: usize, len: usize) -> &'g [u8] {
        let start = slot * SLOT_BYTES + HEADER_BYTES;
        let bytes = bytemuck_bytes(&guard.state.slots);
        bytes
            .get(start..start + len.min(PIGGYBACK_MAX_BYTES))
            .unwrap_or(&[])
    }

    /// Every rank's header of a collective (index = rank), after checking them against
    /// this rank's: a mismatch or a failed input elsewhere is an error here too. `payload`
    /// (at most [`PIGGYBACK_MAX_BYTES`], empty for none) travels in this rank's header
    /// message; the others' arrive in the guard's slots ([`Network::payload`]).
    fn exchange_headers(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        algorithm: CrossRankAlgorithm,
        status: Status,
        contributions: usize,
        payload: &[u8],
    ) -> Result<Vec<Header>> {
        let (rank, size) = (self.rank(), self.size());
        let mut mine = Header::new(&op.desc, op.seq, rank, algorithm, status);
        mine.contributions = contributions.min(u16::MAX as usize) as u16;
        let payload = &payload[..payload.len().min(PIGGYBACK_MAX_BYTES)];
        // One buffer, never reallocated once posted: a slot per rank (this rank's slot
        // holds the outgoing header and payload). `wait` keeps it while a request may use
        // it.
        let mut keep = Self::take_slots(guard, size);
        {
            let out = &mut bytemuck_bytes_mut(&mut keep)[rank * SLOT_BYTES..];
            out[..HEADER_BYTES].copy_from_slice(&mine.encode());
            out[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
        }
        let base = keep.as_mut_ptr().cast::<u8>();
        let t = tag(op.seq, phase::HEADER);
        let mut requests = Vec::with_capacity(2 * size);
        let posted = (|| {
            for peer in (0..size).filter(|&p| p != rank) {
                // SAFETY: slot `peer` of `keep` (SLOT_BYTES) is written only by this
                // receive, slot `rank` is only read by the sends (HEADER_BYTES + payload
                // bytes, inside it); `keep` is not reallocated and outlives the requests
                // (`wait` and `abandon` keep it with them on a fault).
                unsafe {
                    requests.push(self.mpi.irecv(
                        base.add(peer * SLOT_BYTES),
                        SLOT_BYTES,
                        peer,
                        t,
                    )?);
                    requests.push(self.mpi.isend(
                        base.add(rank * SLOT_BYTES),
                        HEADER_BYTES + payload.len(),
                        peer,
                        t,
                    )?);
                }
            }
            Ok(())
        })();
        if let Err(e) = posted {
            return Err(self.abandon(guard, requests, keep, e));
        }
        let keep = self.wait(guard, requests, keep, op, self.deadline())?;
        guard.state.slots = keep;
        let bytes: &[u8] = bytemuck_bytes(&guard.state.slots);
        let mut all = Vec::with_capacity(size);
        for r in 0..size {
            if r == rank {
                all.push(mine.clone());
                continue;
            }
            let at = r * SLOT_BYTES;
            let h = Header::decode(&bytes[at..at + HEADER_BYTES]).ok_or_else(|| {
                Error::CollectiveMismatch {
                    call: op.seq,
                    rank: r,
                    this_rank: rank,
                    ours: mine.describe(),
                    theirs: "a message that is no tributary header".into(),
                }
            })?;
            all.push(h);
        }
        check_headers(rank, &mine, &all, Describe(&op.desc))?;
        Ok(all)
    }

    /// The header exchange of a transfer between its two ranks. `payload` (at most
    /// [`PIGGYBACK_MAX_BYTES`], empty for none: the sender's data) travels in this rank's
    /// header message; the peer's arrives in slot 0 ([`Network::payload`]).
    fn transfer_headers(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        status: Status,
        payload: &[u8],
    ) -> Result<()> {
        let rank = self.rank();
        let (from, to) = op.desc.route.unwrap_or((rank, rank));
        let peer = if from == rank { to } else { from };
        let mine = Header::new(&op.desc, op.seq, rank, CrossRankAlgorithm::Direct, status);
        let payload = &payload[..payload.len().min(PIGGYBACK_MAX_BYTES)];
        let mut keep = Self::take_slots(guard, 2);
        {
            let out = &mut bytemuck_bytes_mut(&mut keep)[SLOT_BYTES..];
            out[..HEADER_BYTES].copy_from_slice(&mine.encode());
            out[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
        }
        let base = keep.as_mut_ptr().cast::<u8>();
        let t = tag(op.seq, phase::TRANSFER_HEADER);
        let mut requests = Vec::with_capacity(2);
        let posted = (|| {
            // SAFETY: `keep` holds two slots of SLOT_BYTES and is not reallocated; the
            // first receives, the second holds the outgoing header and payload; `wait` and
            // `abandon` keep it while requests may use it.
            unsafe {
                requests.push(self.mpi.irecv(base, SLOT_BYTES, peer, t)?);
                requests.push(self.mpi.isend(
                    base.add(SLOT_BYTES),
                    HEADER_BYTES + payload.len(),
                    peer,
                    t,
                )?);
            }
            Ok(())
        })();
        if let Err(e) = posted {
            return Err(self.abandon(guard, requests, keep, e));
        }
        let keep = self.wait(guard, requests, keep, op, self.deadline())?;
        guard.state.slots = keep;
        let theirs = Header::decode(&bytemuck_bytes(&guard.state.slots)[..HEADER_BYTES])
            .ok_or_else(|| Error::CollectiveMismatch {
                call: op.seq,
                rank: peer,
                this_rank: rank,
                ours: mine.describe(),
                theirs: "a message that is no tributary header".into(),
            })?;
        let mut all = vec![mine.clone(), mine.clone()];
        all[if rank == from { 1 } else { 0 }] = theirs;
        let me = if rank == from { 0 } else { 1 };
        check_headers(me, &mine, &all, Describe(&op.desc)).map_err(|e| match e {
            Error::CollectiveMismatch {
                call, ours, theirs, ..
            } => Error::CollectiveMismatch {
                call,
                rank: peer,
                this_rank: rank,
                ours,
                theirs,
            },
            Error::RankInputFailed {
                call, operation, ..
            } => Error::RankInputFailed {
                rank: peer,
                call,
                operation,
            },
            e => e,
        })
    }
}

/// An operation's description, formatted only when an error names it (not on every
/// header check).
struct Describe<'a>(&'a OpDesc);

impl std::fmt::Display for Describe<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

/// The worker's exclusive access to the execution state.
pub(crate) struct ExecGuard<'a> {
    state: MutexGuard<'a, ExecState>,
}

/// The wire bytes of an all-reduce of `desc`.
pub(super) fn wire_bytes(desc: &OpDesc) -> usize {
    Wire::of(desc.dtype).map_or(0, |w| w.size()) * desc.elements() as usize
}

pub(super) fn bytemuck_bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

pub(super) fn bytemuck_bytes_mut<T: bytemuck::Pod>(v: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}
