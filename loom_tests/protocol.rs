//! Models of the protocol (DESIGN.md §3) driving real streams: every rule, on the real
//! `DeviceState` and `HostTable`, with buffers as loom cells (see `world.rs`). Each model
//! is a small program issued in program order by the main thread; it must end with the
//! values sequential execution gives, and loom must find no unordered pair of accesses
//! to the same memory in any interleaving.
//!
//! Each model explores one window (`World::begin_window` .. `end_window`): the set-up
//! before it (linking, with the memsets of new buffers, and earlier work the window does
//! not race with) completes first, and the final reads after it run in one interleaving
//! per explored prefix. Every access in all three parts is still checked by loom.

use std::sync::Arc as StdArc;

use tributary::{
    kernels::{add_merge, copy, fill, scale},
    Error, HostedKind, MemoryMode, MergeBufferUse, Sharing, TensorNode,
};

use crate::{
    harness::{run_model, windowed},
    world::{boom, node, World, FAILING_KERNEL},
};

fn shared() -> MemoryMode {
    MemoryMode::OnDevice(Sharing::SharedCrossStreams)
}

/// Rule 1, RAW: a routine on stream 1 reading a shared node waits for its writer on
/// stream 0 (and for the memset that created the buffer).
#[test]
fn raw_across_streams() {
    run_model("protocol::raw_across_streams", windowed(Some(3)), || {
        let mut w = World::new(&[2]);
        let x = node("x", shared());
        let y = node("y", MemoryMode::on_device());
        let a = w.context(0, 0);
        let b = w.context(0, 1);
        let write = w.link(&a, fill(&x, 7.0).unwrap());
        let read = w.link(&b, copy(&y, &x).unwrap());
        w.begin_window();
        w.schedule(&write).unwrap();
        w.schedule(&read).unwrap();
        w.end_window();
        assert_eq!(w.read(read.context(), &y).unwrap(), [7]);
        w.shutdown();
    });
}

/// Rule 1, WAR: an overwrite on stream 0 waits for a pending reader on stream 1.
#[test]
fn war_across_streams() {
    run_model("protocol::war_across_streams", windowed(Some(3)), || {
        let mut w = World::new(&[2]);
        let x = node("x", shared());
        let y = node("y", MemoryMode::on_device());
        let a = w.context(0, 0);
        let b = w.context(0, 1);
        let init = w.link(&a, fill(&x, 1.0).unwrap());
        let overwrite = w.link(init.context(), fill(&x, 2.0).unwrap());
        let read = w.link(&b, copy(&y, &x).unwrap());
        w.schedule(&init).unwrap();
        w.begin_window();
        w.schedule(&read).unwrap();
        w.schedule(&overwrite).unwrap();
        w.end_window();
        assert_eq!(w.read(read.context(), &y).unwrap(), [1]);
        assert_eq!(w.read(overwrite.context(), &x).unwrap(), [2]);
        w.shutdown();
    });
}

/// Rule 1 (and 2), WAW: writes of one shared buffer from two streams land in program
/// order. Stream 0 owns `x` and writes it; stream 1 uploads the host value into the same
/// buffer (twice: at `init_from_host`, and after stream 0's kernel).
#[test]
fn waw_across_streams() {
    run_model("protocol::waw_across_streams", windowed(Some(3)), || {
        let mut w = World::new(&[2]);
        let x = node(
            "x",
            MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::SharedCrossStreams)),
        );
        let a = w.context(0, 0);
        let b = w.context(0, 1);
        let write = w.link(&a, fill(&x, 5.0).unwrap());
        let b = w.init_from_host(&b, &x, &[9]);
        w.begin_window();
        w.schedule(&write).unwrap();
        w.upload(&b, &x);
        w.end_window();
        assert_eq!(w.read(&b, &x).unwrap(), [9]);
        w.shutdown();
    });
}

/// Rule 2, host write: a host write waits for a pending upload that reads the host
/// array (the upload sees the old value), and the next device read of the node uploads
/// the new value first.
#[test]
fn host_write_vs_pending_upload() {
    run_model(
        "protocol::host_write_vs_pending_upload",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[1]);
            let h = node("h", MemoryMode::Hosted(HostedKind::Volatile));
            let y = node("y", MemoryMode::on_device());
            let c = w.context(0, 0);
            let c = w.init_from_host(&c, &h, &[1]);
            let r = w.link(&c, copy(&y, &h).unwrap());
            w.begin_window();
            w.upload(&c, &h); // an upload of 1, pending
            w.host_write(&h, &[2]); // must wait for that upload
            w.schedule(&r).unwrap(); // h lags: re-uploaded before the copy
            w.end_window();
            assert_eq!(w.read(r.context(), &y).unwrap(), [2]);
            w.shutdown();
        },
    );
}

/// Rule 2, host read: a host read after a device write transfers the device value and
/// waits for that transfer; a host write then waits for the transfer into the host array,
/// and a device read after it sees the host value.
#[test]
fn host_read_vs_device_write() {
    run_model(
        "protocol::host_read_vs_device_write",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[1]);
            let v = node("v", MemoryMode::hosted_changed_on_devices());
            let y = node("y", MemoryMode::on_device());
            let c = w.context(0, 0);
            let c = w.init_from_host(&c, &v, &[1]);
            let set = w.link(&c, fill(&v, 2.0).unwrap());
            let r = w.link(set.context(), scale(&y, &v, 3.0).unwrap());
            w.begin_window();
            w.schedule(&set).unwrap();
            assert_eq!(w.host_read(&v).unwrap(), [2]);
            w.host_write(&v, &[5]);
            w.schedule(&r).unwrap();
            w.end_window();
            assert_eq!(w.read(r.context(), &y).unwrap(), [15]);
            w.shutdown();
        },
    );
}

/// Rule 3: a device-to-device copy waits for the source's last write, and a later write
/// of the source (on the source device) waits for the copy to have read it.
#[test]
fn d2d_copy_then_overwrite_source() {
    run_model(
        "protocol::d2d_copy_then_overwrite_source",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[1, 1]);
            let x = node("x", MemoryMode::on_device());
            let src = w.context(0, 0);
            let dst = w.context(1, 0);
            let set3 = w.link(&src, fill(&x, 3.0).unwrap());
            let set4 = w.link(set3.context(), fill(&x, 4.0).unwrap());
            let dst = w.link(&dst, fill(&x, 0.0).unwrap());
            w.begin_window();
            w.schedule(&set3).unwrap();
            w.device_to_device(&x, set3.context(), dst.context(), MergeBufferUse::No)
                .unwrap()
                .expect("a real copy");
            w.schedule(&set4).unwrap(); // must wait for the copy to read x
            w.end_window();
            assert_eq!(w.read(dst.context(), &x).unwrap(), [3]);
            assert_eq!(w.read(set4.context(), &x).unwrap(), [4]);
            w.shutdown();
        },
    );
}

/// Rules 3 and 4: two successive producers (two contexts of device 1) deliver `g` into
/// the merge buffer of device 0's stream with `Copy`; each delivery waits for its
/// producer and for the previous consumer of the merge buffer, and re-running the first
/// producer waits for its delivery to have read it.
#[test]
fn merge_copy_reuse_two_producers() {
    run_model(
        "protocol::merge_copy_reuse_two_producers",
        windowed(Some(2)),
        || {
            let mut w = World::new(&[1, 1]);
            let g = node("g", MemoryMode::on_device());
            let c0 = w.context(0, 0);
            let c1 = w.context(1, 0);
            let c2 = w.context(1, 0);
            let p1 = w.link(&c1, fill(&g, 2.0).unwrap());
            let p2 = w.link(&c2, fill(&g, 3.0).unwrap());
            let base = w.link(&c0, fill(&g, 1.0).unwrap());
            let merge = w.link(base.context(), add_merge(&g).unwrap());
            w.schedule(&base).unwrap();
            w.schedule(&p1).unwrap();
            w.schedule(&p2).unwrap();
            w.begin_window();
            w.device_to_device(&g, p1.context(), merge.context(), MergeBufferUse::Copy)
                .unwrap();
            w.schedule(&merge).unwrap(); // g = 1 + 2
            w.schedule(&p1).unwrap(); // overwrites p1's g: waits for the delivery above
            w.device_to_device(&g, p2.context(), merge.context(), MergeBufferUse::Copy)
                .unwrap();
            w.schedule(&merge).unwrap(); // g = 3 + 3
            w.end_window();
            assert_eq!(w.read(merge.context(), &g).unwrap(), [6]);
            w.shutdown();
        },
    );
}

/// Rule 4: a consumer is refused at schedule time unless the merge buffer holds the node
/// it expects; a larger node grows the merge buffer, and the old buffer is released only
/// after its consumer is done.
#[test]
fn merge_buffer_holds_the_expected_node() {
    run_model(
        "protocol::merge_buffer_holds_the_expected_node",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[1, 1]);
            let g = node("g", MemoryMode::on_device());
            let h = TensorNode::new("h", tributary::DType::F32, [2])
                .with_mode(MemoryMode::on_device())
                .unwrap();
            let c0 = w.context(0, 0);
            let c1 = w.context(1, 0);
            let pg = w.link(&c1, fill(&g, 2.0).unwrap());
            let ph = w.link(pg.context(), fill(&h, 5.0).unwrap());
            let base = w.link(&c0, fill(&g, 1.0).unwrap());
            let merge = w.link(base.context(), add_merge(&g).unwrap());
            w.schedule(&base).unwrap();
            assert!(
                World::is_mismatch(&w.schedule(&merge)),
                "empty merge buffer"
            );
            w.schedule(&pg).unwrap();
            w.schedule(&ph).unwrap();
            w.begin_window();
            w.device_to_device(&g, pg.context(), merge.context(), MergeBufferUse::Copy)
                .unwrap();
            w.schedule(&merge).unwrap(); // g = 1 + 2
                                         // h is twice as large: the merge buffer grows, the old one is retired once
                                         // the consumer above is done (a later allocation on device 0 releases it).
            w.device_to_device(&h, ph.context(), base.context(), MergeBufferUse::Copy)
                .unwrap();
            let z = node("z", MemoryMode::on_device());
            w.link(&c0, fill(&z, 0.0).unwrap());
            w.end_window();
            assert!(
                World::is_mismatch(&w.schedule(&merge)),
                "the merge buffer holds h, not g"
            );
            assert_eq!(w.read(merge.context(), &g).unwrap(), [3]);
            w.shutdown();
        },
    );
}

/// Rule 3 with `StreamingFor`: the consumer reads the source buffer in place, after its
/// last write on the other device, and a later write of the source waits for the
/// consumer.
#[test]
fn streaming_for_then_overwrite_source() {
    run_model(
        "protocol::streaming_for_then_overwrite_source",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[1, 1]);
            let g = node("g", MemoryMode::on_device());
            let c0 = w.context(0, 0);
            let c1 = w.context(1, 0);
            let src = w.link(&c1, fill(&g, 5.0).unwrap());
            let src_over = w.link(src.context(), fill(&g, 100.0).unwrap());
            let base = w.link(&c0, fill(&g, 1.0).unwrap());
            let merge = w.link(base.context(), add_merge(&g).unwrap());
            w.schedule(&base).unwrap();
            w.begin_window();
            w.schedule(&src).unwrap();
            w.device_to_device(
                &g,
                src.context(),
                merge.context(),
                MergeBufferUse::StreamingFor(merge.clone()),
            )
            .unwrap();
            w.schedule(&src_over).unwrap(); // must wait for the streaming consumer
            w.end_window();
            assert_eq!(w.read(merge.context(), &g).unwrap(), [6]);
            w.shutdown();
        },
    );
}

/// Rule 5: finalizing a context whose buffer another stream is still reading (a copy
/// into that stream's context) defers the free; a new allocation on the first stream
/// cannot take the range until the reader is done (stream-ordered reuse is only for the
/// stream that runs every pending use).
#[test]
fn free_while_read_then_reuse() {
    run_model(
        "protocol::free_while_read_then_reuse",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[2]);
            let x = node("x", MemoryMode::on_device());
            let q = node("q", MemoryMode::on_device());
            let a = w.context(0, 0);
            let b = w.context(0, 1);
            let set = w.link(&a, fill(&x, 3.0).unwrap());
            let dst = w.link(&b, fill(&x, 0.0).unwrap());
            w.schedule(&set).unwrap();
            w.begin_window();
            w.device_to_device(&x, set.context(), dst.context(), MergeBufferUse::No)
                .unwrap()
                .expect("a real copy");
            w.finalize(set.context());
            let reuse = w.link(&a, fill(&q, 9.0).unwrap());
            w.schedule(&reuse).unwrap();
            w.end_window();
            assert_eq!(w.read(dst.context(), &x).unwrap(), [3]);
            assert_eq!(w.read(reuse.context(), &q).unwrap(), [9]);
            w.shutdown();
        },
    );
}

/// Rule 6: a failing kernel fails its event with the root cause, a dependent on another
/// stream fails with the same root cause without running, unrelated work and the system
/// keep working, and overwriting the node heals it.
#[test]
fn failure_fails_dependents_with_root_cause() {
    run_model(
        "protocol::failure_fails_dependents_with_root_cause",
        windowed(Some(3)),
        || {
            let mut w = World::new(&[2]);
            let x = node("x", shared());
            let y = node("y", MemoryMode::on_device());
            let a = w.context(0, 0);
            let b = w.context(0, 1);
            let fails = w.link(&a, boom(&x));
            let dependent = w.link(&b, copy(&y, &x).unwrap());
            w.begin_window();
            let ev_fail = w.schedule(&fails).unwrap();
            let ev_dep = w.schedule(&dependent).unwrap();
            let dep_result = ev_dep.wait();
            w.end_window();
            let root = match ev_fail.wait() {
                Err(Error::Failed(root)) => root,
                other => panic!("the failing kernel reported {other:?}"),
            };
            assert_eq!(root.operation, FAILING_KERNEL);
            assert_eq!(root.seq, ev_fail.seq());
            match dep_result {
                Err(Error::Failed(f)) => assert!(StdArc::ptr_eq(&f, &root), "{f}"),
                other => panic!("the dependent reported {other:?}"),
            }
            // Reading y fails with the same root cause too.
            match w.read(dependent.context(), &y) {
                Err(Error::Failed(f)) => assert!(StdArc::ptr_eq(&f, &root), "{f}"),
                other => panic!("reading y gave {other:?}"),
            }
            // Overwriting x heals it.
            let heal = w.link(fails.context(), fill(&x, 3.0).unwrap());
            w.schedule(&heal).unwrap();
            w.schedule(&dependent).unwrap();
            assert_eq!(w.read(dependent.context(), &y).unwrap(), [3]);
            w.shutdown();
        },
    );
}
