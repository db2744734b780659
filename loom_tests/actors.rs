//! Models of the actor layer across actors (DESIGN.md §4): the real dispatcher and device
//! cores, with two host threads racing where the program allows it (see
//! `actor_world.rs`). Each model checks that every outcome is one some sequential order of
//! the host calls gives (the calls are linearizable), and loom that no two accesses to the
//! same memory are unordered in any interleaving.
//!
//! The mutants they catch: `late_source_read` (the source records the copy's read only
//! after the destination planned it, the shape before issue 16: a write of the source
//! decided in between does not wait for the copy), `d2d_reader` (no read record at all),
//! `host_gate` (an upload on one device not ordered after a download on another),
//! `device_write_gate` (a device write of a hosted node not ordered against a download on
//! another device: a finalize's write-back decided from the wrong newest value) and
//! `inline_no_handoff` (a post that decides on its own thread leaves behind what another
//! thread posted meanwhile), `drive_lost_kick` (a multi-device post decided in rounds on
//! its own thread forgets the answer that would unblock a device), `replay_entry` (a
//! replayed step's entry dependencies on the live tables dropped) and `kick_lost` (a
//! device actor's wake-up flag taken before its waker is registered: a kick in between
//! wakes nobody) and `auto_no_flush` (a call that breaks the automatic replay's period is
//! posted before the calls it holds).
//!
//! **What a window covers.** Where two host threads race, a model's window holds the calls
//! themselves: the posts, the decisions (on the posting threads and the actor thread), and
//! whatever the streams run meanwhile. The waits for the calls' completions come after the
//! window, where they run in one interleaving per explored prefix and loom still checks
//! every access they order (a missing dependency is a causality violation there too). How a
//! waiter meets a signal is the event timeline's own models (`event::*`). Three models
//! waited inside their windows until 2026-11-29, where the waits multiplied the
//! interleavings without reaching a decision that could differ:
//! `inline_posts_race_the_actor` explored 1.2 million at a bound of 2 (about 340 s), now
//! 47,694 at a bound of 3 (13 s); `replay_races_a_schedule_from_another_thread` 254,552 at a
//! bound of 1 (164 s), now 53,797 at 2 (31 s); `copy_races_a_write_of_its_source` 222,836 at
//! 1 (111 s), now 36,500 at 2 (19 s). Every mutant listed above is still caught:
//! `replay_entry` in 37 s (was about 170), the others in under six seconds.

use tributary::{
    collective::{self, ReduceOp, Strategy, Transfer},
    dispatch::{self, answer, AllReduceCall},
    kernels::{add_merge, copy, fill, scale_in_place},
    HostedKind, MemoryMode, MergeBufferUse, Sharing,
};

use crate::{
    actor_world::{
        all_reduce, auto_schedule, capture_copy, device_to_device, host_write, replay, schedule,
        to_host, wait, wait_issued, ActorWorld, Actors,
    },
    harness::{builder, run_model, windowed},
    world::node,
};

/// Issue 16's torn copy: one host thread copies `x` from device 0 to device 1 while
/// another overwrites `x` on device 0. Whatever order the two calls take, the copy
/// delivers a value `x` held (1 or 2) and the overwrite waits for the copy to have read.
#[test]
fn copy_races_a_write_of_its_source() {
    copy_races_a_write_of_its_source_with(
        "actors::copy_races_a_write_of_its_source",
        Actors::Shared,
        Some(2),
    );
}

/// The same race with decisions on the posting threads where they find a device idle
/// (`System`'s default): host threads, not only the actor thread, decide. Every thread
/// then takes many more synchronisation steps, so this one explores the interleavings
/// without preemption (every switch at a blocking point: who gets each device's turn,
/// and in which order the two calls' posts land); with one preemption it runs for more
/// than five minutes.
#[test]
fn copy_races_a_write_of_its_source_deciding_on_posting_threads() {
    copy_races_a_write_of_its_source_with(
        "actors::copy_races_a_write_of_its_source_deciding_on_posting_threads",
        Actors::SharedInline,
        Some(0),
    );
}

/// The same race with the copy against device order (from device 1 to device 0), decided
/// on the posting threads: the copy's post finds both devices idle and decides them in
/// rounds (`inbox::decide_in_rounds`): device 0's destination half waits for device 1's
/// verdict, which the next round acts on, without waking the actor. The mutant
/// `drive_lost_kick` (the verdict's kick noted while the post decides, then forgotten)
/// leaves the destination half undecided: loom reports the deadlock. Without preemption,
/// like the model above (every switch at a blocking point; with one preemption it runs
/// for more than five minutes).
#[test]
fn copy_against_device_order() {
    copy_between(
        "actors::copy_against_device_order",
        Actors::SharedInline,
        Some(0),
        (1, 0),
    );
}

fn copy_races_a_write_of_its_source_with(name: &'static str, actors: Actors, bound: Option<usize>) {
    copy_between(name, actors, bound, (0, 1));
}

/// A copy of `x` from device `from.0` to device `from.1` while another host thread
/// overwrites `x` on the source device.
fn copy_between(name: &'static str, actors: Actors, bound: Option<usize>, from: (usize, usize)) {
    let (src, dst_device) = from;
    run_model(name, windowed(bound), move || {
        let mut w = ActorWorld::new(&[1, 1], actors);
        let x = node("x", MemoryMode::on_device());
        let set1 = w.link(&w.context(src, 0), fill(&x, 1.0).unwrap());
        let set2 = w.link(set1.context(), fill(&x, 2.0).unwrap());
        let dst = w.link(&w.context(dst_device, 0), fill(&x, 0.0).unwrap());
        let d = w.dispatcher();
        wait(&schedule(&d, &set1)).unwrap();
        wait(&schedule(&d, &dst)).unwrap();
        w.begin_window();
        let writer = {
            let (d, set2) = (d.clone(), set2.clone());
            loom::thread::spawn(move || schedule(&d, &set2))
        };
        let copied = device_to_device(&d, &x, set1.context(), dst.context(), MergeBufferUse::No)
            .expect("a copy between two buffers");
        let written = writer.join().unwrap();
        w.end_window();
        wait(&copied).unwrap();
        wait(&written).unwrap();
        let got = w.read(dst.context(), &x);
        assert!(got == [1] || got == [2], "the copy delivered {got:?}");
        assert_eq!(w.read(set2.context(), &x), [2]);
        w.shutdown();
    });
}

/// Issue 18's replay across actors: a captured step (copy `x` from device 0 to device 1)
/// replayed, one operation per device, while another host thread overwrites `x` on device
/// 0. Either order of the two calls is a sequential one: the replayed copy delivers 1 or 2,
/// the overwrite waits for the copy to have read (the replay leaves its remote read in the
/// source's table), and the copy for an overwrite ordered before it (its entry
/// dependency, resolved on the live table: mutant `replay_entry` drops it).
#[test]
fn replay_races_a_schedule_from_another_thread() {
    run_model(
        "actors::replay_races_a_schedule_from_another_thread",
        windowed(Some(2)),
        || {
            let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
            let x = node("x", MemoryMode::on_device());
            let set1 = w.link(&w.context(0, 0), fill(&x, 1.0).unwrap());
            let set2 = w.link(set1.context(), fill(&x, 2.0).unwrap());
            let dst = w.link(&w.context(1, 0), fill(&x, 0.0).unwrap());
            let d = w.dispatcher();
            wait(&schedule(&d, &set1)).unwrap();
            wait(&schedule(&d, &dst)).unwrap();
            let step = capture_copy(&d, &x, set1.context(), dst.context());
            w.begin_window();
            let writer = {
                let (d, set2) = (d.clone(), set2.clone());
                loom::thread::spawn(move || schedule(&d, &set2))
            };
            let replayed = replay(&d, &step);
            let written = writer.join().unwrap();
            w.end_window();
            for p in &replayed {
                wait(p).unwrap();
            }
            wait(&written).unwrap();
            let got = w.read(dst.context(), &x);
            assert!(
                got == [1] || got == [2],
                "the replayed copy delivered {got:?}"
            );
            assert_eq!(w.read(set2.context(), &x), [2]);
            w.shutdown();
        },
    );
}

/// A `StreamingFor` consumer on device 1 reads device 0's `g` in place while another host
/// thread overwrites `g` on device 0: the consumer sees 3 or 5, never a torn or later
/// value, and the overwrite waits for it.
#[test]
fn streaming_consumer_races_a_write_of_its_source() {
    run_model(
        "actors::streaming_consumer_races_a_write_of_its_source",
        windowed(Some(2)),
        || {
            let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
            let g = node("g", MemoryMode::on_device());
            let set3 = w.link(&w.context(0, 0), fill(&g, 3.0).unwrap());
            let set5 = w.link(set3.context(), fill(&g, 5.0).unwrap());
            let acc = w.link(&w.context(1, 0), fill(&g, 10.0).unwrap());
            let consumer = w.link(acc.context(), add_merge(&g).unwrap());
            let d = w.dispatcher();
            wait(&schedule(&d, &set3)).unwrap();
            wait(&schedule(&d, &acc)).unwrap();
            w.begin_window();
            let writer = {
                let (d, set5) = (d.clone(), set5.clone());
                loom::thread::spawn(move || schedule(&d, &set5))
            };
            let streamed = device_to_device(
                &d,
                &g,
                set3.context(),
                consumer.context(),
                MergeBufferUse::StreamingFor(consumer.clone()),
            )
            .expect("a streaming consumer");
            let written = writer.join().unwrap();
            w.end_window();
            wait(&streamed).unwrap();
            wait(&written).unwrap();
            let got = w.read(consumer.context(), &g);
            assert!(got == [13] || got == [15], "the consumer computed {got:?}");
            assert_eq!(w.read(set5.context(), &g), [5]);
            w.shutdown();
        },
    );
}

/// An all-reduce of `g` over devices 0 and 1 (star: device 1's `g` merged into device 0's,
/// then broadcast back) while another host thread overwrites `g` on device 1. Either the
/// overwrite comes first (both end with 1 + 10) or after (device 0 ends with 1 + 2,
/// device 1 with 10): no other outcome, and no race.
#[test]
fn all_reduce_races_a_schedule_on_one_of_its_devices() {
    run_model(
        "actors::all_reduce_races_a_schedule_on_one_of_its_devices",
        windowed(Some(1)),
        || {
            let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
            let g = node("g", MemoryMode::on_device());
            let a = w.link(&w.context(0, 0), fill(&g, 1.0).unwrap());
            let b = w.link(&w.context(1, 0), fill(&g, 2.0).unwrap());
            let over = w.link(b.context(), fill(&g, 10.0).unwrap());
            let merge_a = w.link(a.context(), add_merge(&g).unwrap());
            let merge_b = w.link(b.context(), add_merge(&g).unwrap());
            let d = w.dispatcher();
            wait(&schedule(&d, &a)).unwrap();
            wait(&schedule(&d, &b)).unwrap();
            let call = AllReduceCall {
                steps: collective::plan(2, 1, Strategy::Star, ReduceOp::Sum),
                nodes: vec![g.clone()],
                contexts: vec![a.context().clone(), b.context().clone()],
                merge: vec![vec![merge_a.clone()], vec![merge_b]],
                scale: vec![Vec::new(), Vec::new()],
                transfer: Transfer::Copy,
            };
            w.begin_window();
            let writer = {
                let (d, over) = (d.clone(), over.clone());
                loom::thread::spawn(move || schedule(&d, &over))
            };
            let reduced = all_reduce(&d, &call);
            let written = writer.join().unwrap();
            w.end_window();
            for p in reduced.iter().chain([&written]) {
                wait(p).unwrap();
            }
            let got = (w.read(a.context(), &g), w.read(b.context(), &g));
            assert!(
                got == (vec![11], vec![11]) || got == (vec![3], vec![10]),
                "the all-reduce and the overwrite ended with {got:?}"
            );
            w.shutdown();
        },
    );
}

/// A host write of `w` races device work reading it on two devices (each uploads it if
/// its buffer lags): device 0 reads, then device 1 reads. The host write lands before,
/// between or after them, so the readers see (1, 1), (1, 2) or (2, 2), never (2, 1),
/// and no upload overlaps the write of the host array.
#[test]
fn host_write_races_device_reads_on_two_devices() {
    run_model(
        "actors::host_write_races_device_reads_on_two_devices",
        windowed(Some(1)),
        || {
            let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
            let h = node("h", MemoryMode::Hosted(HostedKind::Volatile));
            let (y0, y1) = (
                node("y0", MemoryMode::on_device()),
                node("y1", MemoryMode::on_device()),
            );
            let c0 = w.init_from_host(&w.context(0, 0), &h, &[1]);
            let c1 = w.init_from_host(&w.context(1, 0), &h, &[1]);
            let r0 = w.link(&c0, copy(&y0, &h).unwrap());
            let r1 = w.link(&c1, copy(&y1, &h).unwrap());
            let d = w.dispatcher();
            w.begin_window();
            let writer = {
                let (d, h) = (d.clone(), h.clone());
                loom::thread::spawn(move || host_write(&d, &h, &[2]))
            };
            let e0 = schedule(&d, &r0);
            let e1 = schedule(&d, &r1);
            writer.join().unwrap();
            w.end_window();
            wait(&e0).unwrap();
            wait(&e1).unwrap();
            let got = (w.read(r0.context(), &y0)[0], w.read(r1.context(), &y1)[0]);
            assert!(
                [(1, 1), (1, 2), (2, 2)].contains(&got),
                "the readers saw {got:?}"
            );
            w.shutdown();
        },
    );
}

/// Host-array order across devices without round trips: device 0 writes `v` and
/// downloads it into the host array; then a routine on device 1, whose buffer of `v` lags
/// a host write, uploads the host array. The upload is gated on a fence of device 0
/// posted with it, so it reads what the download wrote (7), after it completed.
#[test]
fn upload_after_a_download_on_another_device() {
    run_model(
        "actors::upload_after_a_download_on_another_device",
        windowed(Some(2)),
        || {
            let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
            let v = node(
                "v",
                MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::PerStream)),
            );
            let y = node("y", MemoryMode::on_device());
            let c0 = w.init_from_host(&w.context(0, 0), &v, &[1]);
            let c1 = w.init_from_host(&w.context(1, 0), &v, &[1]);
            let set = w.link(&c0, fill(&v, 7.0).unwrap());
            let read = w.link(&c1, copy(&y, &v).unwrap());
            w.host_write(&v, &[5]); // both device buffers lag now
            let d = w.dispatcher();
            w.begin_window();
            schedule(&d, &set);
            to_host(&d, set.context(), &v);
            let e = schedule(&d, &read);
            w.end_window();
            wait(&e).unwrap();
            assert_eq!(w.read(read.context(), &y), [7]);
            w.shutdown();
        },
    );
}

/// A finalize's write-back decides from the device writes before it, wherever they were
/// decided (issue 12's failing random programs): device 1 writes 7 into its own buffer of
/// `v`, device 0 then writes 9 into another, and device 1's context is finalized. Its
/// buffer no longer holds the newest value, so nothing is written back: a routine reading
/// a buffer of `v` that lags the host array reads the host's 5. The finalize is gated on
/// device 0 having decided its write; without that (mutant `device_write_gate`) device 1
/// may decide the finalize first, see its own write as the newest and write 7 back.
#[test]
fn finalize_after_a_write_on_another_device() {
    finalize_and_writes_on_two_devices("actors::finalize_after_a_write_on_another_device", false);
}

/// The converse order: device 1 writes 7, its context is finalized (its buffer holds the
/// newest value: 7 is written back), then device 0 writes 9 into another buffer. The
/// routine reading a lagging buffer reads 7. A write stamped after the finalize but
/// decided before it would make device 1 skip the write-back it owes (mutant
/// `device_write_gate`), and the routine read the host's 5.
#[test]
fn write_on_another_device_after_a_finalize() {
    finalize_and_writes_on_two_devices("actors::write_on_another_device_after_a_finalize", true);
}

fn finalize_and_writes_on_two_devices(name: &'static str, finalize_first: bool) {
    run_model(name, windowed(Some(1)), move || {
        let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
        let v = node(
            "v",
            MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::PerStream)),
        );
        let y = node("y", MemoryMode::on_device());
        // Each writer's context owns its buffer of `v` (linked from a root without it).
        let set7 = w.link(&w.context(1, 0), fill(&v, 7.0).unwrap());
        let set9 = w.link(&w.context(0, 0), fill(&v, 9.0).unwrap());
        let lagging = w.init_from_host(&w.context(0, 0), &v, &[1]);
        let read = w.link(&lagging, copy(&y, &v).unwrap());
        w.host_write(&v, &[5]); // `lagging`'s buffer lags now
        let d = w.dispatcher();
        w.begin_window();
        let e7 = schedule(&d, &set7);
        let finalized = if finalize_first {
            let f = d.finalize(set7.context()).unwrap();
            let e9 = schedule(&d, &set9);
            (f, e9)
        } else {
            let e9 = schedule(&d, &set9);
            (d.finalize(set7.context()).unwrap(), e9)
        };
        let e = schedule(&d, &read);
        w.end_window();
        let (finalize, e9) = finalized;
        dispatch::block_on(answer(finalize)).unwrap();
        wait(&e7).unwrap();
        wait(&e9).unwrap();
        wait(&e).unwrap();
        let expected = if finalize_first { 7 } else { 5 };
        assert_eq!(w.read(read.context(), &y), [expected]);
        w.shutdown();
    });
}

/// A host read of `v` races device writes of `v` on two devices (device 0 writes 7, then
/// device 1 writes 9): it returns the host value at one point of the program order (1
/// before both, 7 between, 9 after), its transfer of the newest device value ordered with
/// the writes, and its read of the host array with the transfer.
#[test]
fn host_read_races_device_writes_on_two_devices() {
    run_model(
        "actors::host_read_races_device_writes_on_two_devices",
        windowed(Some(1)),
        || {
            let mut w = ActorWorld::new(&[1, 1], Actors::Shared);
            let v = node("v", MemoryMode::hosted_changed_on_devices());
            let c0 = w.init_from_host(&w.context(0, 0), &v, &[1]);
            let c1 = w.init_from_host(&w.context(1, 0), &v, &[1]);
            let set7 = w.link(&c0, fill(&v, 7.0).unwrap());
            let set9 = w.link(&c1, fill(&v, 9.0).unwrap());
            let d = w.dispatcher();
            let reader = w.host_reader();
            w.begin_window();
            let host = {
                let v = v.clone();
                loom::thread::spawn(move || reader.read(&v))
            };
            let e7 = schedule(&d, &set7);
            let e9 = schedule(&d, &set9);
            let got = host.join().unwrap();
            w.end_window();
            wait(&e7).unwrap();
            wait(&e9).unwrap();
            assert!(
                [[1], [7], [9]].contains(&[got[0]]),
                "the host read saw {got:?}"
            );
            w.shutdown();
        },
    );
}

/// Two host threads schedule on one idle device at once while its actor thread may be
/// draining (`DeviceTurn`): the poster that finds the device idle decides its batch on its
/// own thread, and hands what was posted meanwhile to the actor. Whoever decides, both
/// operations are decided, once each, in inbox order: both complete and `x` ends with the
/// value of one of them. The mutant `inline_no_handoff` (a poster that decided its batch
/// does not kick the actor for what came meanwhile) strands the second operation: a
/// deadlock loom reports.
#[test]
fn inline_posts_race_the_actor() {
    run_model(
        "actors::inline_posts_race_the_actor",
        windowed(Some(3)),
        || {
            let mut w = ActorWorld::new(&[1], Actors::SharedInline);
            let x = node("x", MemoryMode::on_device());
            let set1 = w.link(&w.context(0, 0), fill(&x, 1.0).unwrap());
            let set2 = w.link(set1.context(), fill(&x, 2.0).unwrap());
            let d = w.dispatcher();
            w.begin_window();
            let other = {
                let (d, set2) = (d.clone(), set2.clone());
                loom::thread::spawn(move || schedule(&d, &set2))
            };
            let first = schedule(&d, &set1);
            let second = other.join().unwrap();
            w.end_window();
            wait(&first).unwrap();
            wait(&second).unwrap();
            let got = w.read(set1.context(), &x);
            assert!(got == [1] || got == [2], "x ended with {got:?}");
            w.shutdown();
        },
    );
}

/// A device actor's wake-up (`src/dispatch/kicks.rs`): two posts kick the actor while the
/// actor polls for kicks. Either the poll sees a kick or a kick wakes the task the poll
/// registered, whose next poll then sees it; a kick is never lost, including one that
/// finds the flag already set and wakes nobody itself (mutant `kick_lost`: the flag taken
/// before the waker is registered, a kick in between wakes nobody and the actor sleeps on
/// work).
#[test]
fn a_kick_racing_a_poll_is_never_lost() {
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Wake, Waker};
    use tributary::dispatch::kicks::Kicks;

    /// The actor's task: counts its wake-ups.
    struct Task(AtomicUsize);

    impl Wake for Task {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    run_model(
        "actors::a_kick_racing_a_poll_is_never_lost",
        builder(None),
        || {
            let kicks = loom::sync::Arc::new(Kicks::new());
            let task = std::sync::Arc::new(Task(AtomicUsize::new(0)));
            let waker = Waker::from(task.clone());
            let posters: Vec<_> = (0..2)
                .map(|_| {
                    let kicks = kicks.clone();
                    loom::thread::spawn(move || kicks.kick())
                })
                .collect();
            // The actor: polls, and polls again whenever it was woken.
            let mut seen = 0;
            let mut polled_after = 0;
            loop {
                let woken = task.0.load(Ordering::SeqCst);
                if kicks
                    .poll_kicked(&mut Context::from_waker(&waker))
                    .is_ready()
                {
                    seen += 1;
                }
                polled_after = polled_after.max(woken);
                if task.0.load(Ordering::SeqCst) == woken {
                    break;
                }
            }
            for p in posters {
                p.join().unwrap();
            }
            // Every wake-up since the last poll is followed by one more poll.
            while task.0.load(Ordering::SeqCst) > polled_after {
                polled_after = task.0.load(Ordering::SeqCst);
                if kicks
                    .poll_kicked(&mut Context::from_waker(&waker))
                    .is_ready()
                {
                    seen += 1;
                }
            }
            assert!(seen >= 1, "two kicks, and the actor never saw one");
            assert!(
                kicks
                    .poll_kicked(&mut Context::from_waker(&waker))
                    .is_pending(),
                "a kick was left unseen by an actor that was not woken for it"
            );
        },
    );
}

/// Issue 31's automatic replay: a period of two schedules (double `x`, fill `y`) and a
/// query is learned and captured, then its first call is held. The thread that issued it starts another
/// host thread, which reads `x` while the first thread issues the period's second call.
/// The read began after the held call returned, so it must see `x` doubled: it breaks the
/// period, and the held call is issued before it (mutant `auto_no_flush` posts the read
/// first: it sees the value before). Whichever comes first, the period's calls run once
/// each, in order.
#[test]
fn a_matched_call_races_a_call_that_breaks_the_period() {
    run_model(
        "actors::a_matched_call_races_a_call_that_breaks_the_period",
        windowed(Some(1)),
        || {
            let mut w = ActorWorld::with_auto_replay(&[1], Actors::Shared);
            let x = node("x", MemoryMode::on_device());
            let y = node("y", MemoryMode::on_device());
            let set = w.link(&w.context(0, 0), fill(&x, 1.0).unwrap());
            let double = w.link(set.context(), scale_in_place(&x, 2.0).unwrap());
            let set_y = w.link(double.context(), fill(&y, 3.0).unwrap());
            let d = w.dispatcher();
            wait(&schedule(&d, &set)).unwrap();
            // The period: double, fill, a query (`quiesce`, a barrier that only observes).
            // Three to recognise it, a fourth captured (its query is the window's): x = 16.
            for k in 0..4 {
                auto_schedule(&d, &double);
                auto_schedule(&d, &set_y);
                if k < 3 {
                    w.quiesce();
                }
            }
            let ctx = set_y.context().clone();
            w.begin_window();
            let held = auto_schedule(&d, &double);
            assert!(
                matches!(held, dispatch::Issued::Held(_)),
                "the period's first call is held"
            );
            let reader = {
                let (r, ctx, x) = (w.reader(), ctx.clone(), x.clone());
                loom::thread::spawn(move || r.read(&ctx, &x))
            };
            let second = auto_schedule(&d, &set_y);
            let seen = reader.join().unwrap();
            wait_issued(&held).unwrap();
            wait_issued(&second).unwrap();
            w.end_window();
            assert_eq!(seen, [32], "a read after the held call saw {seen:?}");
            assert_eq!(w.read(&ctx, &x), [32]);
            assert_eq!(w.read(&ctx, &y), [3]);
            w.shutdown();
        },
    );
}
