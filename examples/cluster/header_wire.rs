//! The cluster's header protocol for transfers (DESIGN.md §9, "The SPMD contract and its
//! check"), written by hand on raw MPI: the baseline of a careful engineer who wants the
//! same guarantee as the cluster — each side of a transfer checks the other's description
//! of it before the data is used — without a runtime. `cluster_bench` and
//! `cluster_taskbench` time it beside the plain MPI calls: what separates it from them is
//! the protocol's price; what separates the cluster from it is the runtime's.
//!
//! Each side of a transfer sends a 96-byte header, the sender's followed by the payload, in
//! frames of at most 4,032 bytes (what fits Open MPI's shared-memory eager message), and
//! receives the other side's into frame-sized buffers; every part of a call is posted at
//! once (`MPI_Irecv`, `MPI_Isend`) and waited for with one `MPI_Waitall`; then each header
//! is compared with the one expected. Nothing is allocated per call.

use tributary_actors::cluster::mpi_crate::ffi;

const HEADER: usize = 96;
const FRAME: usize = 4032;

/// One part of a call: the peer, the tag (the same on both sides), and this side's
/// payload when it is the sending side (`None`: this side receives the payload).
pub struct Part<'a> {
    pub peer: i32,
    pub tag: i32,
    pub send: Option<&'a [u8]>,
}

/// The buffers of calls of at most `parts` transfers of `bytes` each.
pub struct HeaderWire {
    /// Per part: the outgoing header and payload.
    out: Vec<Vec<u8>>,
    /// Per part: room for the incoming header and payload, in whole frames.
    inbox: Vec<Vec<u8>>,
    requests: Vec<ffi::MPI_Request>,
    bytes: usize,
}

impl HeaderWire {
    pub fn new(parts: usize, bytes: usize) -> HeaderWire {
        let frames = (HEADER + bytes).div_ceil(FRAME);
        HeaderWire {
            out: vec![vec![0x5a; HEADER + bytes]; parts],
            inbox: vec![vec![0; frames * FRAME]; parts],
            requests: Vec::with_capacity(parts * (frames + 1)),
            bytes,
        }
    }

    /// Runs one call of `parts` (at most the `parts` of [`HeaderWire::new`], each payload
    /// of its `bytes`), `call` written into every header and expected in every peer's:
    /// `Err` names the part whose peer's header disagreed. A receiving part's payload is
    /// then [`HeaderWire::received`].
    ///
    /// # Safety
    ///
    /// `comm` is a live communicator used by this thread alone while this runs (the
    /// cluster's, in `Cluster::with_mpi`), and every peer runs the matching call.
    pub unsafe fn call(
        &mut self,
        comm: ffi::MPI_Comm,
        call: u64,
        parts: &[Part<'_>],
    ) -> Result<(), String> {
        self.requests.clear();
        for (i, part) in parts.iter().enumerate() {
            let out = &mut self.out[i];
            out[..8].copy_from_slice(&call.to_le_bytes());
            let (sent, expected) = match part.send {
                Some(payload) => {
                    // Copied beside the header, as the cluster copies the payload's part
                    // that shares the first frame.
                    out[HEADER..].copy_from_slice(payload);
                    (HEADER + self.bytes, HEADER)
                }
                None => (HEADER, HEADER + self.bytes),
            };
            let (inbox, out) = (self.inbox[i].as_mut_ptr(), out.as_mut_ptr());
            // SAFETY: `inbox[i]` has room for `expected` bytes in whole frames and `out[i]`
            // holds `sent`; both stay put and untouched until the `MPI_Waitall` below;
            // `comm` is as this function requires.
            unsafe {
                post(irecv, inbox, expected, part, comm, &mut self.requests);
                post(isend, out, sent, part, comm, &mut self.requests);
            }
        }
        // SAFETY: every request above is live and its buffer untouched until this returns.
        unsafe {
            ffi::MPI_Waitall(
                self.requests.len() as i32,
                self.requests.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            );
        }
        for (i, part) in parts.iter().enumerate() {
            let theirs = &self.inbox[i];
            if theirs[..8] != call.to_le_bytes() || theirs[8..HEADER] != self.out[i][8..HEADER] {
                return Err(format!(
                    "call {call}: rank {}'s header of part {i} disagrees",
                    part.peer
                ));
            }
        }
        Ok(())
    }

    /// The payload part `i` of the last call received.
    pub fn received(&self, i: usize) -> &[u8] {
        &self.inbox[i][HEADER..HEADER + self.bytes]
    }
}

/// `MPI_Irecv` or `MPI_Isend` of bytes: buffer, bytes, peer, tag, communicator, request.
type Post = unsafe fn(*mut u8, usize, i32, i32, ffi::MPI_Comm, &mut ffi::MPI_Request);

/// Posts `len` bytes at `buf` with `call` in frames of at most [`FRAME`] bytes (a receive
/// is posted with room for a whole frame: `buf` must have it), each request pushed on
/// `requests`.
///
/// # Safety
///
/// As `call` requires of `buf` (frames included) until the requests complete.
unsafe fn post(
    call: Post,
    buf: *mut u8,
    len: usize,
    part: &Part<'_>,
    comm: ffi::MPI_Comm,
    requests: &mut Vec<ffi::MPI_Request>,
) {
    for at in (0..len).step_by(FRAME) {
        // SAFETY: reading the library's constant.
        let mut r = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: frame `at..` of `buf`, as this function requires.
        unsafe {
            call(
                buf.add(at),
                (len - at).min(FRAME),
                part.peer,
                part.tag,
                comm,
                &mut r,
            )
        };
        requests.push(r);
    }
}

/// A receive of a whole frame into `buf` (`len` is the part of the message expected there;
/// the receive takes whatever the peer sent, up to a frame).
///
/// # Safety
///
/// `buf..buf + FRAME` stays writable and untouched until the request completes.
unsafe fn irecv(
    buf: *mut u8,
    _len: usize,
    peer: i32,
    tag: i32,
    comm: ffi::MPI_Comm,
    r: &mut ffi::MPI_Request,
) {
    // SAFETY: as this function requires.
    unsafe {
        ffi::MPI_Irecv(
            buf.cast(),
            FRAME as i32,
            ffi::RSMPI_UINT8_T,
            peer,
            tag,
            comm,
            r,
        )
    };
}

/// A send of `len` bytes from `buf`.
///
/// # Safety
///
/// `buf..buf + len` stays readable and unchanged until the request completes.
unsafe fn isend(
    buf: *mut u8,
    len: usize,
    peer: i32,
    tag: i32,
    comm: ffi::MPI_Comm,
    r: &mut ffi::MPI_Request,
) {
    // SAFETY: as this function requires.
    unsafe {
        ffi::MPI_Isend(
            buf.cast_const().cast(),
            len as i32,
            ffi::RSMPI_UINT8_T,
            peer,
            tag,
            comm,
            r,
        )
    };
}
