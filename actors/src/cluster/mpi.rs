//! The one place that calls MPI: initialisation, the cluster's communicator, non-blocking
//! requests and the wait that gives up at a deadline.
//!
//! It makes raw calls through `mpi::ffi`, not rsmpi's safe API. The cluster hands MPI
//! pointers into pool memory, polls requests against deadlines, and abandons those a dead
//! rank will never complete. rsmpi's scoped requests borrow Rust buffers for a lexical scope
//! and panic when dropped unfinished. rsmpi still provides the bindings and the portable
//! `RSMPI_*` handles.
//!
//! MPI runs with `MPI_THREAD_SERIALIZED`, and [`Mpi`] is `Send + Sync` on that contract.
//! DESIGN.md §9, "Network transfers are stream work", says which thread calls MPI when.

use std::{
    ffi::{c_int, c_void},
    time::{Duration, Instant},
};

use mpi::ffi;
use smallvec::SmallVec;
use tributary::{Error, Result};

/// Polls of a wait that found nothing done before it yields the core between polls (and
/// reads the clock for the deadline): about the time of a one-way latency on shared memory.
const SPIN_POLLS: u32 = 64;

/// The cluster's communicator (a duplicate of `MPI_COMM_WORLD` that returns errors).
pub(crate) struct Mpi {
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
}

// SAFETY: MPI handles are plain values of the MPI library; the library is initialised with
// `MPI_THREAD_SERIALIZED`, and the cluster makes its calls from one thread at a time (module
// docs): the creating thread, then the network stream's worker, then the shutting-down
// thread after the stream drained. Moving or sharing the handle between those threads is
// what SERIALIZED allows.
unsafe impl Send for Mpi {}
// SAFETY: as for `Send`: no two threads call MPI through it at the same time.
unsafe impl Sync for Mpi {}

/// An MPI function's return code as a result. Inlined, its error path apart: it follows
/// every MPI call, and as a call it was 1% of a replayed Task Bench timestep.
#[inline]
fn check(function: &str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(mpi_error(function, code))
    }
}

/// The error of an MPI function that returned `code`, with the library's text for it.
#[cold]
#[inline(never)]
fn mpi_error(function: &str, code: c_int) -> Error {
    let mut text = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `text` holds MPI_MAX_ERROR_STRING bytes as the function requires; `len` is a
    // valid out-pointer.
    let ok = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) };
    let message = if ok == 0 {
        String::from_utf8_lossy(&text[..len.clamp(0, text.len() as c_int) as usize]).into_owned()
    } else {
        "no text for this code".to_string()
    };
    Error::Mpi {
        function: function.to_string(),
        code,
        message,
    }
}

impl Mpi {
    /// Initialises MPI (`MPI_THREAD_SERIALIZED`) and duplicates the world communicator with
    /// `MPI_ERRORS_RETURN`. MPI already initialised (by the application or an earlier
    /// cluster of this process), or finalised, is [`Error::InvalidConfig`].
    pub(crate) fn init() -> Result<Mpi> {
        let (mut initialized, mut finalized): (c_int, c_int) = (0, 0);
        // SAFETY: out-pointers to locals; both may be called before MPI_Init.
        unsafe {
            check("MPI_Initialized", ffi::MPI_Initialized(&mut initialized))?;
            check("MPI_Finalized", ffi::MPI_Finalized(&mut finalized))?;
        }
        if initialized != 0 || finalized != 0 {
            return Err(Error::InvalidConfig {
                setting: "cluster".into(),
                value: if finalized != 0 {
                    "MPI finalised"
                } else {
                    "MPI initialised"
                }
                .into(),
                reason: "one cluster per process: the cluster initialises MPI itself, and MPI \
                         cannot be initialised again after it was finalised"
                    .into(),
            });
        }
        let mut provided: c_int = 0;
        // SAFETY: MPI is not initialised (checked above); null argc/argv are allowed.
        unsafe {
            check(
                "MPI_Init_thread",
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    ffi::RSMPI_THREAD_SERIALIZED,
                    &mut provided,
                ),
            )?;
        }
        // SAFETY: reading the library's constant.
        if provided < unsafe { ffi::RSMPI_THREAD_SERIALIZED } {
            // SAFETY: MPI is initialised; nothing else uses it yet.
            unsafe { ffi::MPI_Finalize() };
            return Err(Error::InvalidConfig {
                setting: "MPI thread level".into(),
                value: provided.to_string(),
                reason: "the cluster needs MPI_THREAD_SERIALIZED".into(),
            });
        }
        // SAFETY: MPI is initialised; `comm` is an out-pointer; the world communicator and
        // the error handler are the library's constants.
        unsafe {
            let mut comm = ffi::RSMPI_COMM_NULL;
            check(
                "MPI_Comm_dup",
                ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm),
            )?;
            check(
                "MPI_Comm_set_errhandler",
                ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
            )?;
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            check("MPI_Comm_rank", ffi::MPI_Comm_rank(comm, &mut rank))?;
            check("MPI_Comm_size", ffi::MPI_Comm_size(comm, &mut size))?;
            Ok(Mpi {
                comm,
                rank: rank as usize,
                size: size as usize,
            })
        }
    }

    /// This process's rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The raw communicator, for code that runs its own MPI calls on the network stream.
    pub(crate) fn raw(&self) -> ffi::MPI_Comm {
        self.comm
    }

    /// Every rank's value of a `u64` (blocking; used once, while the cluster starts).
    pub(crate) fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>> {
        let mut all = vec![0u64; self.size];
        // SAFETY: one u64 sent, `size` u64 received into `all`, which holds that many.
        unsafe {
            check(
                "MPI_Allgather",
                ffi::MPI_Allgather(
                    (&value as *const u64).cast(),
                    1,
                    ffi::RSMPI_UINT64_T,
                    all.as_mut_ptr().cast(),
                    1,
                    ffi::RSMPI_UINT64_T,
                    self.comm,
                ),
            )?;
        }
        Ok(all)
    }

    /// Posts a send of `len` bytes at `buf` to `dest`.
    ///
    /// # Safety
    ///
    /// `buf..buf+len` must stay readable until the request completes, or, if it is
    /// abandoned, until [`Mpi::finalize`] (MPI may read it during any later MPI call).
    pub(crate) unsafe fn isend(
        &self,
        buf: *const u8,
        len: usize,
        dest: usize,
        tag: i32,
    ) -> Result<Request> {
        let count = c_int::try_from(len).map_err(|_| too_large(len))?;
        // SAFETY: reading the library's constant.
        let mut raw = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller keeps the buffer valid (above); `raw` is an out-pointer.
        unsafe {
            check(
                "MPI_Isend",
                ffi::MPI_Isend(
                    buf.cast::<c_void>(),
                    count,
                    ffi::RSMPI_UINT8_T,
                    dest as c_int,
                    tag,
                    self.comm,
                    &mut raw,
                ),
            )?;
        }
        Ok(Request {
            raw,
            peer: dest,
            receive: false,
        })
    }

    /// Posts a receive of `len` bytes into `buf` from `src`.
    ///
    /// # Safety
    ///
    /// `buf..buf+len` must stay writable, and unused by anything else, until the request
    /// completes, or, if it is abandoned, until [`Mpi::finalize`].
    pub(crate) unsafe fn irecv(
        &self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    ) -> Result<Request> {
        let count = c_int::try_from(len).map_err(|_| too_large(len))?;
        // SAFETY: reading the library's constant.
        let mut raw = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller keeps the buffer valid and exclusive (above).
        unsafe {
            check(
                "MPI_Irecv",
                ffi::MPI_Irecv(
                    buf.cast::<c_void>(),
                    count,
                    ffi::RSMPI_UINT8_T,
                    src as c_int,
                    tag,
                    self.comm,
                    &mut raw,
                ),
            )?;
        }
        Ok(Request {
            raw,
            peer: src,
            receive: true,
        })
    }

    /// Posts `MPI_Iallreduce` (sum) of `count` elements from `send` into `recv`.
    ///
    /// # Safety
    ///
    /// As for [`Mpi::isend`] for `send` and [`Mpi::irecv`] for `recv`; the two do not overlap.
    pub(crate) unsafe fn iallreduce_sum(
        &self,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        f64_elements: bool,
    ) -> Result<Request> {
        let n = c_int::try_from(count).map_err(|_| too_large(count))?;
        // SAFETY: reading the library's constant.
        let mut raw = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller keeps both buffers valid (above); the datatype and the op are
        // the library's constants.
        unsafe {
            let dtype = if f64_elements {
                ffi::RSMPI_DOUBLE
            } else {
                ffi::RSMPI_FLOAT
            };
            check(
                "MPI_Iallreduce",
                ffi::MPI_Iallreduce(
                    send.cast::<c_void>(),
                    recv.cast::<c_void>(),
                    n,
                    dtype,
                    ffi::RSMPI_SUM,
                    self.comm,
                    &mut raw,
                ),
            )?;
        }
        Ok(Request {
            raw,
            // A collective: no single peer to name when it stalls.
            peer: usize::MAX,
            receive: true,
        })
    }

    /// Waits until every request in `requests` completed, polling ([`SPIN_POLLS`] polls, then
    /// a yield of the core between polls); gives up at `deadline` with [`Stalled`], naming
    /// the lowest rank a pending receive waits for (or a pending send's destination).
    /// Completed requests become null; pending ones stay in the list.
    pub(crate) fn wait_all(
        &self,
        requests: &mut [Request],
        deadline: Instant,
    ) -> std::result::Result<(), WaitError> {
        self.wait_for(requests, &mut [], deadline, Until::All)
    }

    /// [`Mpi::wait_all`] of `watched`, completing what of `others` completes meanwhile (the
    /// same polls): a later wait for `others` then usually finds them done and polls no more.
    pub(crate) fn wait_all_with(
        &self,
        watched: &mut [Request],
        others: &mut [Request],
        deadline: Instant,
    ) -> std::result::Result<(), WaitError> {
        self.wait_for(watched, others, deadline, Until::All)
    }

    /// [`Mpi::wait_all_with`] until at least one of the pending `watched` requests completed
    /// (or none is pending): the caller finds which with [`Request::is_done`].
    pub(crate) fn wait_any_with(
        &self,
        watched: &mut [Request],
        others: &mut [Request],
        deadline: Instant,
    ) -> std::result::Result<(), WaitError> {
        self.wait_for(watched, others, deadline, Until::Any)
    }

    /// Polls `watched` and `others` together (one `MPI_Testsome` over both) until `until`
    /// holds for `watched`; `others` only complete along the way.
    fn wait_for(
        &self,
        watched: &mut [Request],
        others: &mut [Request],
        deadline: Instant,
        until: Until,
    ) -> std::result::Result<(), WaitError> {
        let pending = |r: &[Request]| r.iter().filter(|r| !r.is_done()).count();
        // Requests that completed before (null) count as done.
        let mut left = pending(watched);
        if left == 0 {
            // Nothing to wait for: no poll (the common end of an exchange whose sends
            // completed while its headers were awaited).
            return Ok(());
        }
        let n = watched.len();
        // SAFETY: reading the library's constant.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        // Inline up to 8 requests (a collective on 4 ranks, a transfer): no allocation. A
        // request is done when its handle is null: MPI_Testsome nulls those it completes.
        let mut raw: SmallVec<[ffi::MPI_Request; 8]> = SmallVec::new();
        // Two loops, not a chained iterator (its per-element branch was measurable here).
        raw.extend(watched.iter().map(|r| r.raw));
        raw.extend(others.iter().map(|r| r.raw));
        let mut indices: SmallVec<[c_int; 8]> = smallvec::smallvec![0; raw.len()];
        let mut idle_polls = 0u32;
        let result = loop {
            if left == 0 {
                break Ok(());
            }
            let mut outcount: c_int = 0;
            // SAFETY: `raw` holds `raw.len()` request handles (completed ones are null, which
            // MPI_Testsome skips); `indices` holds as many slots; statuses are ignored.
            let code = unsafe {
                ffi::MPI_Testsome(
                    raw.len() as c_int,
                    raw.as_mut_ptr(),
                    &mut outcount,
                    indices.as_mut_ptr(),
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            if let Err(e) = check("MPI_Testsome", code) {
                break Err(WaitError::Mpi(e));
            }
            // MPI_UNDEFINED (negative): no active request left.
            if outcount < 0 {
                break Ok(());
            }
            let completed = indices.get(..outcount as usize).unwrap_or(&[]);
            if completed.iter().any(|&i| (i as usize) < n) {
                left = raw[..n].iter().filter(|&&r| r != null).count();
                if until == Until::Any {
                    break Ok(());
                }
                idle_polls = 0;
                continue;
            }
            // Spin briefly without reading the clock (a deadline is seconds away; reading it
            // on every poll was 4% of the network worker's samples), then read it once per
            // yield of the core: with more ranks than cores the rank this one waits for
            // may need it.
            idle_polls += 1;
            if idle_polls <= SPIN_POLLS {
                std::hint::spin_loop();
                continue;
            }
            if Instant::now() >= deadline {
                let stalled = |receive: bool| {
                    watched
                        .iter()
                        .zip(&raw)
                        .filter(|(r, &h)| h != null && r.receive == receive)
                        .map(|(r, _)| r.peer)
                        .min()
                };
                let peer = stalled(true).or_else(|| stalled(false));
                break Err(WaitError::Stalled(Stalled {
                    peer: peer.filter(|&p| p != usize::MAX),
                }));
            }
            std::thread::yield_now();
        };
        let (mine, theirs) = raw.split_at(n.min(raw.len()));
        for (r, &h) in watched.iter_mut().zip(mine) {
            r.raw = h;
        }
        for (r, &h) in others.iter_mut().zip(theirs) {
            r.raw = h;
        }
        result
    }

    /// Ends MPI (`MPI_Finalize`). Requests abandoned after a fault may still be progressed
    /// here: their buffers must be alive (the cluster keeps its pools and staging until after).
    pub(crate) fn finalize(&self) {
        let mut comm = self.comm;
        // SAFETY: called once, by the cluster's shutdown, after the network stream drained
        // (no other thread calls MPI). Freeing the duplicate first is the tidy order; a
        // failure there changes nothing for the finalisation.
        unsafe {
            let _ = ffi::MPI_Comm_free(&mut comm);
            ffi::MPI_Finalize();
        }
    }
}

fn too_large(len: usize) -> Error {
    Error::InvalidSize {
        node: "network message".into(),
        reason: format!(
            "{len} units do not fit one MPI message (at most {})",
            c_int::MAX
        ),
    }
}

/// A posted non-blocking operation.
pub(crate) struct Request {
    raw: ffi::MPI_Request,
    /// The rank it sends to or receives from (`usize::MAX` for a collective).
    peer: usize,
    receive: bool,
}

impl Request {
    /// Whether it completed (a wait made it null).
    pub(crate) fn is_done(&self) -> bool {
        // SAFETY: reading the library's constant.
        self.raw == unsafe { ffi::RSMPI_REQUEST_NULL }
    }
}

// SAFETY: a request handle is a value of the MPI library, used under the serialized
// contract of `Mpi` (module docs).
unsafe impl Send for Request {}

/// When [`Mpi::wait_for`] returns.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Until {
    /// Every watched request completed.
    All,
    /// At least one pending watched request completed.
    Any,
}

/// Why [`Mpi::wait_all`] gave up.
pub(crate) enum WaitError {
    /// The deadline passed with requests pending.
    Stalled(Stalled),
    /// MPI returned an error.
    Mpi(Error),
}

/// The deadline passed; `peer` is the rank a pending request waits for, if one does.
pub(crate) struct Stalled {
    pub(crate) peer: Option<usize>,
}

/// The default deadline for one network operation to hear from every rank it needs.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);
