//! The network stream's side: what runs when a network operation's routine runs, and the
//! state that keeps the ranks in step.
//!
//! Every network operation's kernel runs [`Network::execute`] on the network stream's worker.
//! It takes its entry from the issue queue, exchanges headers, then moves the data, polled
//! against the deadline. Small payloads travel in their header's message (one message per
//! peer instead of two: [`PIGGYBACK_MAX_BYTES`]); nothing received is used before the
//! headers agree. An entry still queued with a failed event had its kernel skipped.
//! The next kernel first sends that entry's header with [`Status::InputFailed`], and
//! [`Network::flush`] does the same at shutdown. A sendrecv's kernel runs two queued
//! transfers at once, and an exchange any number ([`Network::execute_group`],
//! [`Network::transfer_parts`]).
//! `network/wire.rs` holds what each operation sends and receives once the ranks agreed.
//! See DESIGN.md §9, "Issue order and failed inputs", "Faults" and "Sendrecv and exchange".

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

pub(crate) use wire::{check_dtype, View};

use smallvec::{smallvec, SmallVec};

use super::{
    header::{
        agrees, check_headers, check_peer, CrossRankAlgorithm, Header, OpDesc, OpKind, Status,
        HEADER_BYTES,
    },
    mpi::{Mpi, Request, WaitError},
    reduce::Wire,
};

/// Payloads of at most this many bytes travel in their header's message: a `Direct`
/// all-reduce's wire input, and a transfer's data. One message per peer then carries both
/// (cut into frames, [`FRAME_BYTES`]), where a header exchange and then the data cost two
/// one-way latencies and, above Open MPI's eager limit, a rendezvous. Every receive is
/// posted with room for a whole frame, so a message is taken whole even by a rank that
/// expected a header alone (a mismatch, reported as such, never a truncation). The
/// receiver uses the payload only once the headers agree: whether one travels, and how many
/// frames it takes, is decided from the compared fields (algorithm, element count, dtype),
/// so agreeing ranks decide alike. 64 KiB, the largest wire size the `Auto` algorithm sends
/// `Direct` by default: up to it, seventeen eager frames measured faster than a header
/// exchange and then one message of the data (in place on 2 ranks, 0.95x `MPI_Allreduce`
/// at 32 KiB and 0.82x at 64 KiB against 0.76x and 0.71x with a 16 KiB limit; BENCHMARKS.md,
/// "Header messages in eager frames"). Each rank keeps a slot of this size per rank.
pub(crate) const PIGGYBACK_MAX_BYTES: usize = 64 * 1024;

/// The largest message of a header exchange. A header with its payload is cut into frames
/// of this many bytes, sent back to back under one tag (MPI keeps their order), because
/// Open MPI's shared-memory transport (`btl vader`) sends a message of up to its eager
/// limit (4 KiB by default, its own match header included: 4,040 bytes of data, measured)
/// in one copy through its queue, and a larger one by a rendezvous (a request, a
/// `process_vm_readv` of the sender's memory, an acknowledgement) that cost ~2.5 µs more
/// per message here: a raw `MPI_Send`/`MPI_Recv` round trip of 4,040 bytes took 1.6 µs, of
/// 4,048 bytes 7.2 µs (BENCHMARKS.md, "Header messages in eager frames"). Every transport
/// that has an eager path takes messages of this size on it (TCP: 64 KiB; UCX on shared
/// memory: 8 KiB). A constant, not a setting: ranks that cut frames differently would
/// agree on the headers and still misplace each other's payloads.
pub(crate) const FRAME_BYTES: usize = 4032;

/// The bytes of one rank's message slot: a header, then room for a payload, in whole frames.
pub(crate) const SLOT_BYTES: usize =
    (HEADER_BYTES + PIGGYBACK_MAX_BYTES).div_ceil(FRAME_BYTES) * FRAME_BYTES;
const SLOT_WORDS: usize = SLOT_BYTES / 8;

/// Each part's result of an exchange, in issue order.
pub(crate) type Results = SmallVec<[Result<()>; 4]>;

/// The entries of one exchange's transfers, in issue order: inline up to four (both
/// neighbours' sends and receives).
pub(crate) type IssuedGroup = SmallVec<[Arc<Issued>; 4]>;

/// The requests of one wait: inline up to 8 (a header exchange on 4 ranks, a transfer's
/// frames), no allocation on a routine's start-to-post path.
pub(crate) type Requests = smallvec::SmallVec<[Request; 8]>;

/// The cluster's network settings that every rank must share (they decide the algorithm).
#[derive(Clone, Debug)]
pub(crate) struct NetworkConfig {
    pub(crate) deadline: Duration,
    pub(crate) algorithm: CrossRankAlgorithm,
    pub(crate) direct_max_bytes: usize,
    pub(crate) chunk_bytes: usize,
}

/// What follows this rank's header in its header message.
#[derive(Clone, Copy)]
pub(super) enum Payload<'a> {
    /// No payload: the header alone.
    None,
    /// These bytes (at most [`PIGGYBACK_MAX_BYTES`]), in memory that outlives every request abandoned at a fault: the part
    /// that shares the first frame with the header is copied into the slot, the other frames
    /// are sent from here (no copy of the rest). Made by [`Payload::kept`].
    Kept(&'a [u8]),
    /// As many bytes as the operation's payload holds, which no receiver reads: a rank whose
    /// input failed still sends every frame the others posted a receive for (a frame left
    /// unreceived would be taken by a later operation whose tag wraps onto this one's).
    Unread(usize),
}

impl<'a> Payload<'a> {
    /// A payload whose frames after the first are sent from `bytes` itself.
    ///
    /// # Safety
    ///
    /// `bytes` must stay readable until the requests of the exchange complete or, if a fault
    /// abandons them, until MPI is finalized: a kernel's view into pool memory (the pools
    /// outlive `MPI_Finalize`, module docs of `cluster`), or a vector the network stream
    /// keeps with its abandoned buffers.
    pub(super) unsafe fn kept(bytes: &'a [u8]) -> Payload<'a> {
        Payload::Kept(bytes)
    }

    fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Kept(b) => b.len(),
            Payload::Unread(n) => *n,
        }
        .min(PIGGYBACK_MAX_BYTES)
    }
}

/// One peer's side of a header exchange ([`Network::exchange_slots`]): this rank's header
/// message, from slot `own` (its header, then `payload`), to `peer`, and that peer's header
/// and `expected` payload bytes into slot `slot`, under tag `tag`.
#[derive(Clone, Copy)]
struct Leg<'p> {
    peer: usize,
    slot: usize,
    own: usize,
    tag: i32,
    payload: Payload<'p>,
    expected: usize,
}

/// Every rank's header of a collective (index = rank): inline up to 4 ranks.
pub(super) type Headers = SmallVec<[Header; 4]>;

/// The legs of one exchange: inline up to one per peer of an 8-rank cluster.
type Legs<'p> = SmallVec<[Leg<'p>; 8]>;

/// One transfer of an exchange as this rank runs it ([`Network::transfer_parts`]):
/// its entry, the status its header carries, what travels with it, the payload bytes
/// expected with the peer's header, and its data that does not travel with the header.
/// One list of these per exchange, not one list per field (each list's pushes and drop
/// were measurable on a replayed Task Bench timestep).
pub(super) struct ExchangePart<'a> {
    pub(super) op: &'a Issued,
    pub(super) status: Status,
    pub(super) payload: Payload<'a>,
    pub(super) expected: usize,
    pub(super) data: Option<DataLeg>,
    /// Why this rank's own view of it could not be used, if it could not (its status
    /// says so to the peer).
    pub(super) failed: Option<String>,
}

/// The data of a transfer that does not travel with its header: a request
/// [`Network::transfer_parts`] posts once the part's headers agreed.
pub(super) enum DataLeg {
    Send {
        ptr: *const u8,
        len: usize,
        peer: usize,
        tag: i32,
    },
    Recv {
        ptr: *mut u8,
        len: usize,
        peer: usize,
        tag: i32,
    },
}

impl DataLeg {
    /// A send of `bytes` to `peer` under `tag`.
    ///
    /// # Safety
    ///
    /// `bytes` must stay readable and unwritten until the exchange's requests complete or,
    /// if a fault abandons them, until MPI is finalized (a kernel's view into pool memory,
    /// module docs of `cluster`), and no receive of the exchange may write them.
    pub(super) unsafe fn send(bytes: &[u8], peer: usize, tag: i32) -> DataLeg {
        DataLeg::Send {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            peer,
            tag,
        }
    }

    /// A receive into `bytes` from `peer` under `tag`.
    ///
    /// # Safety
    ///
    /// As [`DataLeg::send`], and nothing else may read or write `bytes` meanwhile.
    pub(super) unsafe fn recv(bytes: &mut [u8], peer: usize, tag: i32) -> DataLeg {
        DataLeg::Recv {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            peer,
            tag,
        }
    }
}

impl ExchangePart<'_> {
    /// The other rank of the transfer.
    fn peer(&self, rank: usize) -> usize {
        match self.op.desc.route {
            Some((from, to)) if from == rank => to,
            Some((from, _)) => from,
            None => rank,
        }
    }
}

/// The frames a header with `payload` bytes after it takes.
fn frames(payload: usize) -> usize {
    (HEADER_BYTES + payload.min(PIGGYBACK_MAX_BYTES)).div_ceil(FRAME_BYTES)
}

/// One network operation, from its issue to its completion.
pub(crate) struct Issued {
    pub(crate) seq: u64,
    pub(crate) desc: OpDesc,
    /// How many contributions this rank adds (its contexts; all-reduce only).
    pub(crate) contributions: usize,
    /// This transfer and the next entry of the queue are one routine's (a sendrecv's or an
    /// exchange's): they run, and are caught up, together ([`Network::execute_group`]).
    pub(crate) fused: bool,
    /// The ticket of its routine, set right after it was scheduled (the host does not wait
    /// for the device's decision); unset for a replayed operation.
    scheduled: OnceLock<Ticket>,
    /// Of a replayed operation: its replay's ticket, which it shares with the replay's other
    /// network operations, and how many operations before that ticket's its own is.
    replayed: Option<(ReplayTicket, u64)>,
    /// The typed error it failed with on the network stream, if it did.
    pub(crate) error: OnceLock<Error>,
}

/// The ticket of one replay's part on the network stream, shared by the network operations
/// that replay queued ([`Issued::ticket`]): set once, when the replay returned (one
/// set and one ticket per replay, not one per operation: a tenth of a replayed Task Bench
/// timestep's host instructions were those sets, clones and drops).
pub(crate) type ReplayTicket = Arc<OnceLock<Ticket>>;

/// Replay tickets kept for the next replays ([`ReplayTickets`]).
const SPARE_REPLAY_TICKETS: usize = 64;

/// The [`ReplayTicket`]s of the last replays, oldest first, each taken again by a later
/// replay once no operation holds it any more, so that replaying allocates none in steady
/// state.
#[derive(Default)]
pub(crate) struct ReplayTickets {
    kept: VecDeque<ReplayTicket>,
}

impl ReplayTickets {
    /// An unset ticket for the next replay: the oldest kept one if nothing else holds it
    /// (its replay's operations finished: replays finish in order), else a new one, kept
    /// if there is room. A held one is passed over and looked at again after the others,
    /// so that one a caller keeps for long (in an operation's `ClusterTicket`) does not
    /// stop the next from being taken.
    pub(crate) fn next(&mut self) -> ReplayTicket {
        for _ in 0..self.kept.len().min(2) {
            let Some(mut oldest) = self.kept.pop_front() else {
                break;
            };
            let free = match Arc::get_mut(&mut oldest) {
                // The only holder: no operation reads it any more.
                Some(cell) => {
                    cell.take();
                    true
                }
                None => false,
            };
            self.kept.push_back(oldest.clone());
            if free {
                return oldest;
            }
        }
        let fresh = ReplayTicket::default();
        if self.kept.len() < SPARE_REPLAY_TICKETS {
            self.kept.push_back(fresh.clone());
        }
        fresh
    }
}

/// How a network operation's event is known: a ticket, and how many operations before
/// that ticket's on its stream the operation's own is (0 for a scheduled routine's; a
/// replay runs a stream's operations under consecutive sequence numbers).
#[derive(Clone, Copy)]
pub(crate) struct EntryTicket<'a> {
    ticket: &'a Ticket,
    back: u64,
}

impl EntryTicket<'_> {
    /// Its event, once its device decided it (or the error that refused it).
    pub(crate) fn event(&self) -> Result<Event> {
        let last = self.ticket.event()?;
        if self.back == 0 {
            return Ok(last);
        }
        last.before(self.back).ok_or_else(|| {
            Error::Internal(format!(
                "a replayed network operation {} before {last:?}, its stream's last",
                self.back
            ))
        })
    }

    /// Waits for its event.
    pub(crate) fn wait(&self) -> Result<()> {
        self.event()?.wait()
    }

    /// [`EntryTicket::never_runs`] if its device decided it already, `None` while
    /// undecided. Never waits, and makes no event (the network stream's worker asks this
    /// of the front entry before every operation it runs).
    fn try_never_runs(&self) -> Option<bool> {
        let status = self.ticket.try_status_before(self.back);
        status.map(|s| !matches!(s, Ok(EventStatus::Pending | EventStatus::Done)))
    }

    /// Whether the operation's kernel will never run: its event failed, or its device
    /// refused it.
    fn never_runs(decided: Result<Event>) -> bool {
        match decided {
            Ok(e) => matches!(e.status(), EventStatus::Failed(_)),
            Err(_) => true,
        }
    }
}

impl Issued {
    /// Its ticket, once set: its routine was scheduled, or its replay returned.
    pub(crate) fn ticket(&self) -> Option<EntryTicket<'_>> {
        match &self.replayed {
            Some((last, back)) => last.get().map(|ticket| EntryTicket {
                ticket,
                back: *back,
            }),
            None => self
                .scheduled
                .get()
                .map(|ticket| EntryTicket { ticket, back: 0 }),
        }
    }

    /// Sets the ticket of its routine, right after the routine was scheduled.
    pub(crate) fn set_scheduled(&self, ticket: Ticket) {
        let _ = self.scheduled.set(ticket);
    }

    /// `(typed error or event error)`: what a waiter should see for this operation.
    pub(crate) fn outcome(&self, event_result: Result<()>) -> Result<()> {
        match (event_result, self.error.get()) {
            (Ok(()), _) => Ok(()),
            (Err(_), Some(typed)) => Err(typed.clone()),
            (Err(e), None) => Err(e),
        }
    }
}

/// Finished entries the issue queue keeps for the next operations (more are freed).
const SPARE_ENTRIES: usize = 1024;

#[derive(Default)]
struct IssueState {
    queue: VecDeque<Arc<Issued>>,
    /// Entries the network stream finished ([`Network::give_back`]): the next operation
    /// issued takes the last one if nothing else holds it any more (`Arc::get_mut`: its
    /// ticket was dropped), so that issuing and replaying allocate no entry in steady
    /// state, and the worker frees none (an entry was allocated on the host thread and
    /// freed on the worker's, every operation).
    spare: Vec<Arc<Issued>>,
    next_collective: u64,
    /// Next sequence number of a transfer to / from each rank.
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl IssueState {
    /// `entry` in the entry given back last ([`Network::give_back`]) if nothing else holds
    /// it any more, else in a new one.
    fn entry(&mut self, entry: Issued) -> Arc<Issued> {
        match self.spare.pop() {
            Some(mut kept) => match Arc::get_mut(&mut kept) {
                // The only holder: no ticket, queue or kernel can read it any more.
                Some(old) => {
                    *old = entry;
                    kept
                }
                // Its ticket is still held: left to its last holder to free.
                None => Arc::new(entry),
            },
            None => Arc::new(entry),
        }
    }
}

/// What only the network stream's worker touches.
struct ExecState {
    /// The fault that broke the cluster (every later operation fails with it).
    broken: Option<Error>,
    /// Receive buffers (f64 words: aligned for every element type).
    staging: Vec<f64>,
    /// The message slots of the last header exchange (one per rank for a collective, two
    /// per transfer: [`SLOT_BYTES`] each; as many as the largest exchange so far took),
    /// kept for the next: the payloads that came with the headers are read from here.
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
        self.issue_with(desc, contributions, false)
    }

    /// The transfers of an exchange (a sendrecv's two, or more), issued back to back as one
    /// routine's (each but the last marked `fused`): their kernel takes them all
    /// ([`Network::execute_group`]).
    pub(crate) fn issue_group(&self, descs: &[OpDesc]) -> IssuedGroup {
        let mut st = lock(&self.issue);
        let n = descs.len();
        descs
            .iter()
            .enumerate()
            .map(|(i, d)| Self::push_issued(&mut st, self.rank(), d.clone(), 0, i + 1 < n, None))
            .collect()
    }

    /// Each of `ops` (description, contributions, [`Issued::fused`], its replay's ticket and
    /// its place before that ticket's, for a replayed one) as [`Network::issue_with`], under one acquisition of the issue queue's lock:
    /// a replayed step re-issues its network operations so (the network stream's worker
    /// takes entries from the front of the same queue).
    pub(crate) fn issue_all<'a>(
        &self,
        ops: impl IntoIterator<Item = (&'a OpDesc, usize, bool, Option<(ReplayTicket, u64)>)>,
    ) -> IssuedGroup {
        let mut st = lock(&self.issue);
        ops.into_iter()
            .map(|(desc, contributions, fused, replayed)| {
                let desc = desc.clone();
                Self::push_issued(&mut st, self.rank(), desc, contributions, fused, replayed)
            })
            .collect()
    }

    /// [`Network::issue`], `fused` as [`Issued::fused`] (a replay re-issues a captured
    /// sendrecv's entries so).
    pub(crate) fn issue_with(
        &self,
        desc: OpDesc,
        contributions: usize,
        fused: bool,
    ) -> Arc<Issued> {
        let mut st = lock(&self.issue);
        Self::push_issued(&mut st, self.rank(), desc, contributions, fused, None)
    }

    fn push_issued(
        st: &mut IssueState,
        rank: usize,
        desc: OpDesc,
        contributions: usize,
        fused: bool,
        replayed: Option<(ReplayTicket, u64)>,
    ) -> Arc<Issued> {
        let seq = match (desc.kind, desc.route) {
            (OpKind::Transfer, Some((from, to))) => {
                let (counters, peer) = if from == rank {
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
        let entry = Issued {
            seq,
            desc,
            contributions,
            fused,
            scheduled: OnceLock::new(),
            replayed,
            error: OnceLock::new(),
        };
        let issued = st.entry(entry);
        st.queue.push_back(issued.clone());
        issued
    }

    /// Keeps `finished` entries (their kernels recorded their results) for the next
    /// operations issued ([`IssueState::spare`]), up to [`SPARE_ENTRIES`].
    fn give_back(&self, finished: impl IntoIterator<Item = Arc<Issued>>) {
        let mut st = lock(&self.issue);
        for mut op in finished {
            // A replayed operation nothing else holds lets go of its replay's ticket now,
            // not when its entry is issued again (which may be never, deep in the spares):
            // that replay's ticket is then free for a later replay ([`ReplayTickets`]).
            if let Some(entry) = Arc::get_mut(&mut op) {
                entry.replayed = None;
            }
            if st.spare.len() < SPARE_ENTRIES {
                st.spare.push(op);
            }
        }
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

    /// [`Network::retract`] of operations the host issued last, in `issued` order (the
    /// newest last): each is taken back newest first.
    pub(crate) fn retract_all(&self, issued: &[Arc<Issued>]) {
        for op in issued.iter().rev() {
            self.retract(op);
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
            let mut st = lock(&self.issue);
            let Some(first) = st.queue.front() else {
                return (skipped, None);
            };
            // Its device decided it before the running kernel's operation, issued after it
            // (one device decides both, in issue order), so its decision is known: read here
            // under the lock, in one acquisition (a routine's start-to-post path runs through
            // here). A decision not visible yet is waited for outside the lock.
            // Its ticket may not be set yet: the host sets it right after its call posted
            // the routine, and the routine's kernel (or a later one of the same call) may
            // run first, the host thread preempted. Then too it is waited for outside the
            // lock: taken for one that runs, a skipped send would be run by the kernel of
            // the receive after it (`cluster_steps::a_failed_input_in_a_replay_...`, on a
            // rank bound to one core).
            let never_runs = match first.ticket() {
                None if mutant!("cluster_ticket_unset_runs") => Some(false),
                None => None,
                Some(t) => t.try_never_runs(),
            };
            let never_runs = match never_runs {
                Some(known) => known,
                None => {
                    let first = first.clone();
                    drop(st);
                    let known = self
                        .ticket_of(&first)
                        .is_some_and(|t| EntryTicket::never_runs(t.event()));
                    st = lock(&self.issue);
                    if !st.queue.front().is_some_and(|f| Arc::ptr_eq(f, &first)) {
                        // Not expected (only this thread takes from the front), but then
                        // the decision read is not the front's: look again.
                        continue;
                    }
                    known
                }
            };
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

    /// The ticket of `op`, waiting for the host to set it: the host sets it right after
    /// the call that issued `op` posted its routine, so a kernel running at or after `op`
    /// finds it set within moments (the wait yields the core, which the host may need).
    /// `None` past the deadline (a host thread that died in between); `op` is then taken
    /// for one that runs, as its kernel's own run would take it.
    fn ticket_of<'a>(&self, op: &'a Issued) -> Option<EntryTicket<'a>> {
        let deadline = self.deadline();
        loop {
            if let Some(t) = op.ticket() {
                return Some(t);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::yield_now();
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
        self.catch_up_all(&mut guard, &skipped);
        let Some(me) = me else {
            return Err("a network routine ran that the cluster did not issue".into());
        };
        let result = match self.refused(&guard) {
            Some(e) => Err(e),
            None => body(self, &mut guard, &me),
        };
        let recorded = Self::record(&mut guard, &me, result);
        drop(guard);
        self.give_back([me]);
        recorded
    }

    /// [`Network::execute`] for the kernel of an exchange (a sendrecv, or more), which runs
    /// the transfers [`Network::issue_group`] queued together: takes them all, runs `body`
    /// on them (in issue order; it gives each one's result in the list it is handed), and
    /// records each one's result on it (the kernel fails if any did).
    pub(crate) fn execute_group(
        &self,
        body: impl FnOnce(&Network, &mut ExecGuard<'_>, &[Arc<Issued>], &mut Results),
    ) -> std::result::Result<(), String> {
        let (skipped, first) = self.front(true);
        let mut guard = ExecGuard {
            state: lock(&self.exec),
        };
        self.catch_up_all(&mut guard, &skipped);
        let mut group = IssuedGroup::new();
        let mut next = first;
        // The later entries are the same routine's, pushed right after the first under one
        // acquisition of the queue's lock: they run (this is their kernel), so nothing is
        // skipped before them and their decisions need no look.
        while let Some(op) = next.take() {
            next = if op.fused {
                lock(&self.issue).queue.pop_front()
            } else {
                None
            };
            group.push(op);
        }
        if group.last().is_none_or(|op| op.fused) {
            return Err("an exchange routine ran that the cluster did not issue as one".into());
        }
        let mut results = Results::new();
        match self.refused(&guard) {
            Some(e) => results.extend(group.iter().map(|_| Err(e.clone()))),
            None => body(self, &mut guard, &group, &mut results),
        }
        let mut outcome = Ok(());
        for (i, op) in group.iter().enumerate() {
            // Taken by index, not drained (the drain's moves were measurable).
            let result = match results.get_mut(i) {
                Some(r) => std::mem::replace(r, Ok(())),
                None => Err(Error::Internal(
                    "an exchange part without its result".into(),
                )),
            };
            let recorded = Self::record(&mut guard, op, result);
            outcome = outcome.and(recorded);
        }
        drop(guard);
        self.give_back(group);
        outcome
    }

    /// Why no operation runs now (the cluster is shut down or broken), if so.
    fn refused(&self, guard: &ExecGuard<'_>) -> Option<Error> {
        if self.closed.load(Ordering::Acquire) {
            Some(Error::ShutDown("the cluster is shut down".into()))
        } else {
            guard.state.broken.clone()
        }
    }

    /// Records `result` on `me` (its typed error), breaking the cluster on a fault; the
    /// kernel's result.
    fn record(
        guard: &mut ExecGuard<'_>,
        me: &Issued,
        result: Result<()>,
    ) -> std::result::Result<(), String> {
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

    /// Catches up `skipped` in order: an exchange's entries together
    /// ([`Network::catch_up_group`]), every other one alone.
    fn catch_up_all(&self, guard: &mut ExecGuard<'_>, skipped: &[Arc<Issued>]) {
        let mut i = 0;
        while i < skipped.len() {
            let mut end = i;
            while skipped[end].fused && end + 1 < skipped.len() {
                end += 1;
            }
            if end > i {
                self.catch_up_group(guard, &skipped[i..=end]);
            } else {
                self.catch_up(guard, &skipped[i]);
            }
            i = end + 1;
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
        // Every frame its payload would have taken, unread, so that every receive the others
        // posted is matched (the mutant sends the header alone).
        let frames_of = |bytes: usize| {
            if mutant!("cluster_unread_frames") {
                0
            } else {
                bytes
            }
        };
        let result = match skipped.desc.kind {
            OpKind::AllReduce | OpKind::Barrier => {
                let bytes = frames_of(self.piggyback_bytes(&skipped.desc, algorithm));
                let unread = Payload::Unread(bytes);
                self.exchange_headers(guard, skipped, algorithm, Status::InputFailed, 0, unread)
                    .map(|_| ())
            }
            OpKind::Transfer => {
                let (sent, expected) = self.transfer_payloads(&skipped.desc);
                let sent = frames_of(sent);
                self.transfer_headers(
                    guard,
                    skipped,
                    Status::InputFailed,
                    Payload::Unread(sent),
                    expected,
                )
            }
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

    /// Sends the headers of an exchange whose kernel was skipped (an input failed here): all
    /// its parts' exchanges posted together, as the kernel would have posted them (one after
    /// the other, a ring of sendrecvs whose inputs all failed would wait on itself).
    fn catch_up_group(&self, guard: &mut ExecGuard<'_>, ops: &[Arc<Issued>]) {
        if guard.state.broken.is_some()
            || self.closed.load(Ordering::Acquire)
            || mutant!("cluster_catch_up")
        {
            return;
        }
        let parts: SmallVec<[ExchangePart<'_>; 4]> =
            ops.iter().map(|op| self.failed_part(op)).collect();
        // Only a fault matters (this rank's own operations failed already).
        let mut results = Results::new();
        if let Err(e) = self.transfer_parts(guard, &parts, &mut results) {
            if breaks_cluster(&e) {
                guard.state.broken = Some(e);
            }
        }
    }

    /// A skipped exchange's part: its header with `InputFailed` and every frame its payload
    /// would have taken, unread (the mutant `cluster_unread_frames`: the header alone).
    fn failed_part<'a>(&self, op: &'a Issued) -> ExchangePart<'a> {
        let (sent, expected) = self.transfer_payloads(&op.desc);
        let sent = if mutant!("cluster_unread_frames") {
            0
        } else {
            sent
        };
        ExchangePart {
            op,
            status: Status::InputFailed,
            payload: Payload::Unread(sent),
            expected,
            data: None,
            failed: None,
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
        self.catch_up_all(&mut guard, &skipped);
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
        requests: &mut Requests,
        keep: Vec<f64>,
        op: &Issued,
        deadline: Instant,
    ) -> Result<Vec<f64>> {
        match self.mpi.wait_all(requests, deadline) {
            Ok(()) => Ok(keep),
            Err(e) => Err(self.abandon(guard, requests, keep, self.fault(op, e))),
        }
    }

    /// The typed fault of a wait for `op` that gave up.
    fn fault(&self, op: &Issued, e: WaitError) -> Error {
        match e {
            WaitError::Mpi(e) => e,
            WaitError::Stalled(s) => Error::RankUnreachable {
                rank: s.peer.unwrap_or(usize::MAX),
                call: op.seq,
                operation: op.desc.describe(),
                waited: self.config.deadline,
            },
        }
    }

    /// The error of a failed post: the requests already posted are abandoned with `keep`.
    fn abandon(
        &self,
        guard: &mut ExecGuard<'_>,
        requests: &mut Requests,
        keep: Vec<f64>,
        e: Error,
    ) -> Error {
        let requests = requests.drain(..).collect();
        guard.state.abandoned.push((requests, keep));
        e
    }

    /// The message slots of an exchange with `count` slots (at least: the slots of the
    /// largest exchange so far), taken from the guard (given back by the exchange once no
    /// request uses them). Never shortened: an exchange that takes more slots than the last
    /// (a transfer's four after a collective's two) would otherwise zero a slot's 67 KiB
    /// again, every time the two alternate.
    fn take_slots(guard: &mut ExecGuard<'_>, count: usize) -> Vec<f64> {
        let mut slots = std::mem::take(&mut guard.state.slots);
        if slots.len() < count * SLOT_WORDS {
            slots.resize(count * SLOT_WORDS, 0.0);
        }
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

    /// Copies the payload that came with slot `slot`'s header in the last exchange into
    /// `out` (as many bytes).
    pub(super) fn copy_payload(guard: &ExecGuard<'_>, slot: usize, out: &mut [u8]) -> Result<()> {
        let payload = Self::payload(guard, slot, out.len());
        if payload.len() != out.len() {
            return Err(Error::Internal(format!(
                "a payload of {} bytes where {} were expected",
                payload.len(),
                out.len()
            )));
        }
        out.copy_from_slice(payload);
        Ok(())
    }

    /// The payload bytes rank by rank of a collective header exchange (every rank sends as
    /// many as it receives from each other): a `Direct` all-reduce's wire input of at most
    /// [`PIGGYBACK_MAX_BYTES`] on more than one rank, else none. Decided from fields the
    /// headers compare.
    pub(super) fn piggyback_bytes(&self, desc: &OpDesc, algorithm: CrossRankAlgorithm) -> usize {
        let bytes = wire_bytes(desc);
        let travels = desc.kind == OpKind::AllReduce
            && self.size() > 1
            && matches!(algorithm, CrossRankAlgorithm::Direct)
            && bytes <= PIGGYBACK_MAX_BYTES;
        if travels {
            bytes
        } else {
            0
        }
    }

    /// `(sent, expected)`: the payload bytes this rank sends with its header of the transfer
    /// `desc`, and those it receives with the peer's: the data, from the sender, when it is
    /// at most [`PIGGYBACK_MAX_BYTES`] (decided from the element count and dtype, which the
    /// headers compare).
    pub(super) fn transfer_payloads(&self, desc: &OpDesc) -> (usize, usize) {
        let bytes = transfer_bytes(desc);
        let piggyback = if bytes <= PIGGYBACK_MAX_BYTES {
            bytes
        } else {
            0
        };
        match desc.route {
            Some((from, _)) if from == self.rank() => (piggyback, 0),
            _ => (0, piggyback),
        }
    }

    /// Every rank's header of a collective (index = rank), after checking them against
    /// this rank's: a mismatch or a failed input elsewhere is an error here too. `payload`
    /// travels in this rank's header message; the others' (as many bytes: a collective's
    /// payloads have one size) arrive in the guard's slots ([`Network::payload`]).
    fn exchange_headers(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        algorithm: CrossRankAlgorithm,
        status: Status,
        contributions: usize,
        payload: Payload<'_>,
    ) -> Result<Headers> {
        let (rank, size) = (self.rank(), self.size());
        let mut mine = Header::new(&op.desc, op.seq, rank, algorithm, status);
        mine.contributions = contributions.min(u16::MAX as usize) as u16;
        // One slot per rank; this rank's holds the outgoing header and payload.
        let mut keep = Self::take_slots(guard, size);
        write_slot(&mut keep, rank, &mine.encode(), payload);
        let t = tag(op.seq, phase::HEADER);
        let legs: Legs<'_> = (0..size)
            .filter(|&p| p != rank)
            .map(|p| Leg {
                peer: p,
                slot: p,
                own: rank,
                tag: t,
                payload,
                expected: payload.len(),
            })
            .collect();
        self.exchange_slots(guard, op, (keep, size), &legs, |heads| {
            let mut all = Headers::with_capacity(size);
            for (r, bytes) in heads.iter().enumerate() {
                if r == rank {
                    all.push(mine.clone());
                    continue;
                }
                let h = Header::decode(bytes).ok_or_else(|| Error::CollectiveMismatch {
                    call: op.seq,
                    rank: r,
                    this_rank: rank,
                    ours: mine.describe(),
                    theirs: "a message that is no tributary header".into(),
                })?;
                all.push(h);
            }
            check_headers(rank, &mine, &all, Describe(&op.desc))?;
            Ok(all)
        })
    }

    /// The header exchange of a transfer between its two ranks. `payload` (the sender's
    /// data, or nothing) travels in this rank's header message; the peer's `expected` bytes
    /// arrive in slot 0 ([`Network::payload`]).
    fn transfer_headers(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        status: Status,
        payload: Payload<'_>,
        expected: usize,
    ) -> Result<()> {
        let rank = self.rank();
        let (from, to) = op.desc.route.unwrap_or((rank, rank));
        let peer = if from == rank { to } else { from };
        let mine = Header::new(&op.desc, op.seq, rank, CrossRankAlgorithm::Direct, status).encode();
        // Slot 0 receives, slot 1 holds the outgoing header and payload.
        let mut keep = Self::take_slots(guard, 2);
        write_slot(&mut keep, 1, &mine, payload);
        let leg = Leg {
            peer,
            slot: 0,
            own: 1,
            tag: tag(op.seq, phase::TRANSFER_HEADER),
            payload,
            expected,
        };
        self.exchange_slots(guard, op, (keep, 2), &[leg], |heads| {
            self.check_transfer(op, &mine, &heads[0])
        })
    }

    /// The transfers of an exchange ([`Network::issue_group`], in issue order), their
    /// header messages posted together: each part's header message (and
    /// payload) to its peer and the peer's into a slot of its own (slots `2i` and `2i + 1`
    /// for part `i`). Then part by part, in issue order: wait for the peer's first frame,
    /// check its header, and post the part's data that does not travel with the header
    /// ([`ExchangePart::data`]) if it agreed. Last, every remaining frame and the data are waited for
    /// together. Part by part, because a peer may run the two transfers as a `recv` and
    /// then a `send` (the same transfers, one routine each): its second header leaves only
    /// once its first transfer's data arrived, so the first part's data must not wait for
    /// the second part's header. The parts are in issue order, which both ranks of a pair
    /// share (the transfer from the lower rank first, [`crate::cluster::Cluster::sendrecv`]),
    /// so even where two parts' tags coincide each rank posts, and MPI matches, the first
    /// part's messages before the second's. `Err` is a fault that stops the cluster (every
    /// part fails with it); otherwise `results` holds each part's own check (a failed input
    /// on the other side fails that part alone), in issue order.
    pub(super) fn transfer_parts(
        &self,
        guard: &mut ExecGuard<'_>,
        parts: &[ExchangePart<'_>],
        results: &mut Results,
    ) -> Result<()> {
        results.clear();
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let rank = self.rank();
        let deadline = self.deadline();
        // Pushed where they stay (collected, each list was moved out of its builder: a
        // copy of several hundred bytes per exchange). This rank's headers as encoded: the
        // peers' are checked against these bytes ([`Network::check_transfer`]).
        let mut mine: SmallVec<[[u8; HEADER_BYTES]; 4]> = SmallVec::new();
        let mut keep = Self::take_slots(guard, 2 * parts.len());
        let mut legs: Legs<'_> = SmallVec::new();
        for (i, p) in parts.iter().enumerate() {
            let header = Header::new(
                &p.op.desc,
                p.op.seq,
                rank,
                CrossRankAlgorithm::Direct,
                p.status,
            )
            .encode();
            write_slot(&mut keep, 2 * i + 1, &header, p.payload);
            mine.push(header);
            legs.push(Leg {
                peer: p.peer(rank),
                slot: 2 * i,
                own: 2 * i + 1,
                tag: tag(p.op.seq, phase::TRANSFER_HEADER),
                payload: p.payload,
                expected: p.expected,
            });
        }
        // The mutant posts each part's messages only once the part before finished.
        let sequential = mutant!("cluster_sendrecv_sequential");
        let n = parts.len();
        let (mut heads, mut waiting) = (Requests::new(), Requests::new());
        results.extend((0..n).map(|_| Ok(())));
        // From a whole inline buffer (a constant store), not filled to `n` (a `memset` call
        // per exchange).
        let mut checked: SmallVec<[bool; 4]> = SmallVec::from_buf([false; 4]);
        checked.resize(n, false);
        let mut posted_legs = 0;
        while checked.iter().any(|c| !c) {
            if posted_legs == 0 || (sequential && posted_legs < n && checked[posted_legs - 1]) {
                let legs = if sequential {
                    &legs[posted_legs..=posted_legs]
                } else {
                    &legs[..]
                };
                // SAFETY: `keep` is neither moved, reallocated nor touched until the
                // requests complete (the waits below) or are abandoned with it, but for the
                // header bytes of a slot whose first frame's receive completed.
                let posted = unsafe { self.post_legs(&mut keep, legs, &mut heads, &mut waiting) };
                posted_legs += legs.len();
                if let Err(e) = posted {
                    waiting.append(&mut heads);
                    return Err(self.abandon(guard, &mut waiting, keep, e));
                }
            }
            // Whichever peer's header arrives first is checked first: a part must not wait
            // for another part's header to post its data (that header may leave only once
            // this part's data arrived, from a peer running one transfer after the other).
            // The sends and later frames complete in the same polls, so the final wait
            // for them usually finds them done.
            if let Err(e) = self.mpi.wait_any_with(&mut heads, &mut waiting, deadline) {
                let stalled = heads.iter().position(|h| !h.is_done()).unwrap_or(0);
                let fault = self.fault(parts.get(stalled).map_or(first.op, |p| p.op), e);
                waiting.append(&mut heads);
                return Err(self.abandon(guard, &mut waiting, keep, fault));
            }
            let base = keep.as_mut_ptr().cast::<u8>();
            for i in 0..heads.len() {
                if checked[i] {
                    continue;
                }
                if !heads[i].is_done() {
                    // The mutant checks the parts in issue order only.
                    if mutant!("cluster_exchange_heads_in_order") {
                        break;
                    }
                    continue;
                }
                checked[i] = true;
                let mut theirs = [0u8; HEADER_BYTES];
                // SAFETY: slot `2i`'s first HEADER_BYTES lie inside `keep` (`2 * n` slots);
                // no request writes them now (their receive completed, and no MPI call runs
                // meanwhile).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        base.add(2 * i * SLOT_BYTES),
                        theirs.as_mut_ptr(),
                        HEADER_BYTES,
                    )
                };
                let check = self.check_transfer(parts[i].op, &mine[i], &theirs);
                if let Err(e) = &check {
                    if breaks_cluster(e) {
                        let e = e.clone();
                        waiting.append(&mut heads);
                        return Err(self.abandon(guard, &mut waiting, keep, e));
                    }
                }
                if let (Ok(()), Some(leg)) = (&check, &parts[i].data) {
                    // SAFETY: the leg's maker promised its memory ([`DataLeg::send`],
                    // [`DataLeg::recv`]).
                    match unsafe { self.post_data(leg) } {
                        Ok(r) => waiting.push(r),
                        Err(e) => {
                            waiting.append(&mut heads);
                            return Err(self.abandon(guard, &mut waiting, keep, e));
                        }
                    }
                }
                if let Err(e) = check {
                    // The others stay the `Ok` they were set to (not rewritten per part).
                    if let Some(r) = results.get_mut(i) {
                        *r = Err(e);
                    }
                }
                if sequential {
                    keep = self.wait(guard, &mut waiting, keep, parts[i].op, deadline)?;
                    waiting.clear();
                }
            }
        }
        guard.state.slots = self.wait(guard, &mut waiting, keep, first.op, deadline)?;
        Ok(())
    }

    /// Posts the request of a [`DataLeg`].
    ///
    /// # Safety
    ///
    /// The leg's memory is as [`DataLeg::send`] and [`DataLeg::recv`] require.
    unsafe fn post_data(&self, leg: &DataLeg) -> Result<Request> {
        // SAFETY: the leg's memory stays valid and untouched until the request completes or
        // is abandoned (this function's contract).
        unsafe {
            match *leg {
                DataLeg::Send {
                    ptr,
                    len,
                    peer,
                    tag,
                } => self.mpi.isend(ptr, len, peer, tag),
                DataLeg::Recv {
                    ptr,
                    len,
                    peer,
                    tag,
                } => self.mpi.irecv(ptr, len, peer, tag),
            }
        }
    }

    /// Checks the peer's header of the transfer `op` (`theirs`, as received) against this
    /// rank's (`mine`, as encoded): a mismatch names the peer, as does a failed input there.
    /// Compared as bytes first; decoded only when they do not agree, to say why.
    fn check_transfer(
        &self,
        op: &Issued,
        mine: &[u8; HEADER_BYTES],
        theirs: &[u8; HEADER_BYTES],
    ) -> Result<()> {
        if agrees(mine, theirs) {
            return Ok(());
        }
        let rank = self.rank();
        let (from, to) = op.desc.route.unwrap_or((rank, rank));
        let peer = if from == rank { to } else { from };
        let Some(mine) = Header::decode(mine) else {
            return Err(Error::Internal(
                "this rank's own transfer header does not decode".into(),
            ));
        };
        let theirs = Header::decode(theirs).ok_or_else(|| Error::CollectiveMismatch {
            call: op.seq,
            rank: peer,
            this_rank: rank,
            ours: mine.describe(),
            theirs: "a message that is no tributary header".into(),
        })?;
        check_peer(rank, &mine, peer, &theirs, Describe(&op.desc))
    }

    /// The messages of a header exchange, one [`Leg`] per peer: this rank's slot `own`
    /// (its header, then `payload`, written there by [`write_slot`]) to the leg's peer, in
    /// frames (those after the first from a [`Payload::Kept`] itself), and that peer's
    /// header and `expected` payload bytes into the leg's slot. Waits for the peers' first
    /// frames, hands the header bytes of the exchange's `slots` (the first of `keep`'s,
    /// which may hold more: index = slot) to `check`, then waits for the
    /// remaining frames. A `check` error that stops the cluster (a mismatch: the peer may
    /// have sent other frames than were posted for) returns without waiting for them; any
    /// other (a failed input elsewhere, whose rank sent every frame) waits for them first,
    /// so nothing of this operation is left for a later one to receive. The slots are kept
    /// for the payload reads ([`Network::payload`]) unless a fault abandoned them. Legs
    /// receive into different slots and send only from slots no leg receives into.
    fn exchange_slots<T>(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        (keep, slots): (Vec<f64>, usize),
        legs: &[Leg<'_>],
        check: impl FnOnce(&[[u8; HEADER_BYTES]]) -> Result<T>,
    ) -> Result<T> {
        let deadline = self.deadline();
        let mut keep = keep;
        // Never past `keep`: the header reads below stay inside it.
        let slots = slots.min(keep.len() * 8 / SLOT_BYTES);
        // SAFETY: `keep` is neither moved, reallocated nor touched until the requests
        // complete (the waits below) or are abandoned with it, but for the header bytes of
        // slots whose first frames' receives completed.
        let (mut heads, mut rest) = (Requests::new(), Requests::new());
        let posted = unsafe { self.post_legs(&mut keep, legs, &mut heads, &mut rest) };
        if let Err(e) = posted {
            heads.append(&mut rest);
            return Err(self.abandon(guard, &mut heads, keep, e));
        }
        let base = keep.as_mut_ptr().cast::<u8>();
        if mutant!("cluster_frames_before_check") {
            // The mutant waits for every frame before the check.
            heads.append(&mut rest);
        }
        if let Err(e) = self.mpi.wait_all_with(&mut heads, &mut rest, deadline) {
            heads.append(&mut rest);
            let fault = self.fault(op, e);
            return Err(self.abandon(guard, &mut heads, keep, fault));
        }
        // Only the first frames are complete (later ones may still be arriving): the headers
        // are copied out through the raw pointer, no reference to the rest of `keep` is made.
        let mut headers: SmallVec<[[u8; HEADER_BYTES]; 4]> = smallvec![[0; HEADER_BYTES]; slots];
        for (s, h) in headers.iter_mut().enumerate() {
            // SAFETY: slot `s`'s first HEADER_BYTES lie inside `keep`; no request writes them
            // now (the first frames' receives completed, and no MPI call runs meanwhile).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    base.add(s * SLOT_BYTES),
                    h.as_mut_ptr(),
                    HEADER_BYTES,
                )
            };
        }
        match check(&headers) {
            Err(e) if breaks_cluster(&e) => Err(self.abandon(guard, &mut rest, keep, e)),
            checked => {
                guard.state.slots = self.wait(guard, &mut rest, keep, op, deadline)?;
                checked
            }
        }
    }

    /// Posts every leg's receives (one per frame expected, into the leg's slot of `keep`)
    /// and sends (its own slot's header and payload, in frames; those after the first from
    /// a [`Payload::Kept`] itself), appending the requests posted to `heads` (each leg's
    /// first frame's receive, in leg order) and `rest` (the others); the error that stopped
    /// the posting, if one did.
    /// Legs must receive into different slots of `keep` and send only from slots no leg
    /// receives into; an exchange that does not is refused before anything is posted.
    ///
    /// # Safety
    ///
    /// `keep` must not be moved, reallocated, read or written until the requests complete or
    /// are abandoned with it, except the header bytes of a slot whose first frame's receive
    /// completed.
    unsafe fn post_legs(
        &self,
        keep: &mut [f64],
        legs: &[Leg<'_>],
        heads: &mut Requests,
        rest: &mut Requests,
    ) -> Result<()> {
        let slots = keep.len() * 8 / SLOT_BYTES;
        let receiving = |s: usize| legs.iter().any(|l| l.slot == s);
        let sound = legs.iter().enumerate().all(|(i, l)| {
            l.slot < slots
                && l.own < slots
                && !receiving(l.own)
                && legs[..i].iter().all(|o| o.slot != l.slot)
        });
        if !sound {
            let e = "a header exchange whose receive slots overlap or lie outside its slots";
            return Err(Error::Internal(e.into()));
        }
        let base = keep.as_mut_ptr().cast::<u8>();
        for leg in legs {
            let (peer, slot, own, t) = (leg.peer, leg.slot, leg.own, leg.tag);
            let sent = leg.payload.len();
            let end = HEADER_BYTES + sent;
            let kept = match leg.payload {
                Payload::Kept(b) => Some(b.as_ptr()),
                _ => None,
            };
            for k in 0..frames(leg.expected) {
                // SAFETY: frame `k` of slot `slot` lies inside `keep` (`slot < slots`,
                // checked above; the slots hold whole frames, [`SLOT_BYTES`]) and is
                // written only by this receive (no two legs receive into one slot); the
                // sends only read own slots, which no leg receives into (checked above).
                // `keep` stays put and untouched until the requests complete or are
                // abandoned with it (this function's contract).
                let r = unsafe {
                    self.mpi.irecv(
                        base.add(slot * SLOT_BYTES + k * FRAME_BYTES),
                        FRAME_BYTES,
                        peer,
                        t,
                    )?
                };
                if k == 0 {
                    heads.push(r);
                } else {
                    rest.push(r);
                }
            }
            for k in 0..frames(sent) {
                // Slot bytes `at..at + len`: payload bytes `at - HEADER_BYTES..` after the
                // first frame.
                let at = k * FRAME_BYTES;
                let len = (end - at).min(FRAME_BYTES);
                let src = match kept {
                    // SAFETY: `at - HEADER_BYTES + len` is at most the payload's length
                    // (`end` is a header and it), so the range lies inside it.
                    Some(payload) if k > 0 => unsafe { payload.add(at - HEADER_BYTES) },
                    // SAFETY: slot `own < slots` holds SLOT_BYTES, `end` is inside it.
                    _ => unsafe { base.add(own * SLOT_BYTES + at) },
                };
                // SAFETY: `src..src + len` is either inside slot `own` (only read while
                // posted; `keep` outlives the requests, as above) or inside a
                // `Payload::Kept`, whose maker promised it outlives them
                // (`Payload::kept`).
                rest.push(unsafe { self.mpi.isend(src, len, peer, t)? });
            }
        }
        Ok(())
    }
}

/// Writes `header` and what of `payload` the exchange sends from the slot into slot `slot`
/// of `slots`: the first frame's part of a [`Payload::Kept`], nothing else (a
/// [`Payload::Unread`]'s bytes are never read).
fn write_slot(slots: &mut [f64], slot: usize, header: &[u8; HEADER_BYTES], payload: Payload<'_>) {
    let out = &mut bytemuck_bytes_mut(slots)[slot * SLOT_BYTES..];
    out[..HEADER_BYTES].copy_from_slice(header);
    let copied = match payload {
        Payload::Kept(b) => &b[..payload.len().min(FRAME_BYTES - HEADER_BYTES)],
        Payload::None | Payload::Unread(_) => &[],
    };
    out[HEADER_BYTES..HEADER_BYTES + copied.len()].copy_from_slice(copied);
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

/// The bytes a transfer of `desc` moves.
pub(super) fn transfer_bytes(desc: &OpDesc) -> usize {
    desc.dtype.size_in_bytes() * desc.elements() as usize
}

pub(super) fn bytemuck_bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

pub(super) fn bytemuck_bytes_mut<T: bytemuck::Pod>(v: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transfer(seq: u64) -> Issued {
        Issued {
            seq,
            desc: OpDesc::new(OpKind::Transfer, "x", &[4], tributary::DType::F32).routed(0, 1),
            contributions: 0,
            fused: false,
            scheduled: OnceLock::new(),
            replayed: None,
            error: OnceLock::new(),
        }
    }

    /// A finished entry nothing else holds is the next one issued: its memory again, with
    /// the new operation in it (nothing of the old one left: its error is gone).
    #[test]
    fn a_finished_entry_nobody_holds_is_issued_again() {
        let mut st = IssueState::default();
        let first = st.entry(transfer(0));
        let _ = first
            .error
            .set(Error::Internal("the first transfer failed".into()));
        let at = Arc::as_ptr(&first);
        st.spare.push(first);
        let second = st.entry(transfer(1));
        assert!(
            std::ptr::eq(Arc::as_ptr(&second), at),
            "a new entry was allocated"
        );
        assert_eq!(second.seq, 1);
        assert!(second.error.get().is_none() && second.ticket().is_none());
        assert!(st.spare.is_empty());
    }

    /// An entry still held (its ticket kept by the host) is never issued again: the new
    /// operation gets an entry of its own, and the held one is left as it was.
    #[test]
    fn a_finished_entry_still_held_is_not_issued_again() {
        let mut st = IssueState::default();
        let first = st.entry(transfer(0));
        let ticket = first.clone();
        st.spare.push(first);
        let second = st.entry(transfer(1));
        assert!(!Arc::ptr_eq(&second, &ticket));
        assert_eq!((ticket.seq, second.seq), (0, 1));
        assert!(st.spare.is_empty(), "the held entry stays with its holder");
    }

    fn refused(why: &str) -> Ticket {
        Ticket::ready(Err(Error::Internal(why.into())))
    }

    /// A replay ticket no operation holds any more is the next replay's, unset again: its
    /// memory again, nothing of the last replay's ticket left.
    #[test]
    fn a_replay_ticket_nobody_holds_is_taken_again() {
        let mut tickets = ReplayTickets::default();
        let first = tickets.next();
        let _ = first.set(refused("the first replay's"));
        let at = Arc::as_ptr(&first);
        drop(first);
        let second = tickets.next();
        assert!(
            std::ptr::eq(Arc::as_ptr(&second), at),
            "a new ticket was made"
        );
        assert!(
            second.get().is_none(),
            "the last replay's ticket is still set"
        );
    }

    /// A replay ticket an operation still holds is never taken by a later replay (that
    /// operation would read the later replay's event), and does not keep the others from
    /// being taken: it is looked at again after them.
    #[test]
    fn a_replay_ticket_still_held_is_not_taken_again() {
        let mut tickets = ReplayTickets::default();
        let held = tickets.next();
        let _ = held.set(refused("the held replay's"));
        let entry = Issued {
            replayed: Some((held.clone(), 0)),
            ..transfer(0)
        };
        drop(held);
        let second = tickets.next();
        assert!(!Arc::ptr_eq(
            &second,
            entry.replayed.as_ref().map(|(t, _)| t).unwrap()
        ));
        drop(second);
        // The held one comes first again and is passed over; the free one is taken.
        let third = tickets.next();
        assert!(third.get().is_none());
        assert!(matches!(
            entry.ticket().map(|t| t.event()),
            Some(Err(Error::Internal(why))) if why == "the held replay's"
        ));
        assert_eq!(
            tickets.kept.len(),
            2,
            "a ticket was made where one was free"
        );
    }

    /// A replayed operation's ticket is its replay's, once the replay set it: none before
    /// (its kernel then waits for it, as for an unset ticket), and the one set after.
    #[test]
    fn a_replayed_operation_reads_its_replays_ticket_once_set() {
        let mut tickets = ReplayTickets::default();
        let last = tickets.next();
        let entry = Issued {
            replayed: Some((last.clone(), 0)),
            ..transfer(0)
        };
        assert!(entry.ticket().is_none());
        let _ = last.set(refused("refused by its device"));
        assert!(entry
            .ticket()
            .is_some_and(|t| t.try_never_runs() == Some(true)));
    }
}
