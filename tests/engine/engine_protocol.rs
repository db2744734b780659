//! Engine tests: every rule of DESIGN.md §3 with 2 devices x 2 streams, on every backend
//! present (`cpu::*` always, `vulkan::*` where a driver loads; see
//! `tributary_testkit::support`).
//!
//! Each race test makes the "wrong" interleaving likely by delaying one side with a slow
//! kernel, so removing the rule under test makes the test fail (the mutation check in
//! `loom_tests/` proves the same on the loom models, exhaustively).

#![cfg(not(tributary_loom))]

use std::time::Duration;

use support::{
    all, backend, failing, node, shared, slow_copy_on, slow_fill_on, zeroed_node, Kind, N,
};
use tributary::{
    kernels, memory::PoolConfig, DType, Engine, Error, HostedKind, MemoryMode, MergeBufferUse,
    Sharing, TensorNode,
};
use tributary_testkit::{for_each_backend, support};

/// 2 devices x 2 streams on `kind` with `pools`, or `None` when it is not available here.
fn engine_with(kind: Kind, test: &str, pools: PoolConfig) -> Option<Engine> {
    let b = backend(kind, 2, test)?;
    Some(Engine::with_backend(b, 2, pools).expect("engine"))
}

fn engine(kind: Kind, test: &str) -> Option<Engine> {
    engine_with(kind, test, PoolConfig::default())
}

for_each_backend!(
    raw_across_streams_waits_for_the_writer,
    war_across_streams_waits_for_the_reader,
    waw_across_streams_keeps_program_order,
    device_to_device_copy_then_overwrite_source,
    merge_buffer_copy_and_reuse_by_two_producers,
    merge_buffer_mismatch_is_refused_at_schedule,
    streaming_for_reads_source_in_place_before_it_is_overwritten,
    lazy_host_transfers,
    constants_are_shared_by_all_streams_of_a_device,
    finalize_frees_only_after_in_flight_readers,
    finalize_refuses_a_context_with_live_children,
    panicking_kernel_fails_its_dependents_but_not_the_system,
    second_writer_of_a_shared_node_is_refused,
    bad_input_gets_typed_errors_and_changes_nothing,
    tables_stay_bounded_under_endless_work,
    two_devices_two_streams_pipeline,
    host_write_waits_for_pending_uploads,
    odd_sized_nodes_transfer_and_compute_exactly_their_elements,
    copies_and_reads_of_a_lagging_buffer_see_the_host_write,
    reading_what_only_another_stream_wrote_is_an_error_that_names_the_fix,
);

/// Stream 0 fills `x`, a routine on stream 1 of the same device reads it: under the sharing
/// rules stream 1 has a buffer of its own, which nothing wrote, so the read is refused with
/// `UninitialisedRead` naming the node, the context and the stream that holds a written
/// copy; nothing changes and the device keeps serving. Sharing the node across streams, or
/// declaring it zeroed, are the two ways to mean it.
fn reading_what_only_another_stream_wrote_is_an_error_that_names_the_fix(kind: Kind) {
    let test = "reading_what_only_another_stream_wrote_is_an_error_that_names_the_fix";
    let Some(mut e) = engine(kind, test) else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let y = node("y", MemoryMode::on_device());
    let (s0, s1) = (e.context(0, 0).unwrap(), e.context(0, 1).unwrap());
    let fill = e.link(&s0, kernels::fill(&x, 5.0).unwrap()).unwrap();
    let copy = e.link(&s1, kernels::copy(&y, &x).unwrap()).unwrap();
    e.schedule(&fill).unwrap();
    let before = e.table_sizes();
    match e.schedule(&copy) {
        Err(Error::UninitialisedRead {
            node,
            context,
            stream,
            hint,
            ..
        }) => {
            assert_eq!(node, x.to_string());
            assert_eq!(
                (context, stream),
                (copy.context().id(), copy.context().stream())
            );
            assert!(
                hint.contains("d0s0") && hint.contains("SharedCrossStreams"),
                "{hint}"
            );
        }
        other => panic!("expected UninitialisedRead, got {other:?}"),
    }
    assert_eq!(
        e.table_sizes(),
        before,
        "a refused schedule changed the tables"
    );
    // The copy of a buffer nothing wrote is refused the same way, and so is its source read.
    assert!(matches!(
        e.device_to_device(&x, copy.context(), fill.context(), MergeBufferUse::Copy),
        Err(Error::UninitialisedRead { .. })
    ));
    e.schedule(&fill).unwrap();
    assert!(all(&e.read::<f32>(fill.context(), &x).unwrap(), 5.0));

    // One buffer shared by the device's streams: stream 1 reads what stream 0 wrote.
    let xs = node("xs", shared());
    let ys = node("ys", MemoryMode::on_device());
    let fill_s = e.link(&s0, kernels::fill(&xs, 6.0).unwrap()).unwrap();
    let copy_s = e.link(&s1, kernels::copy(&ys, &xs).unwrap()).unwrap();
    e.schedule(&fill_s).unwrap();
    e.schedule(&copy_s).unwrap();
    assert!(all(&e.read::<f32>(copy_s.context(), &ys).unwrap(), 6.0));

    // Declared zeroed: a fresh buffer reads as zeros.
    let z = zeroed_node("z", MemoryMode::on_device());
    let yz = node("yz", MemoryMode::on_device());
    let copy_z = e.link(&s1, kernels::copy(&yz, &z).unwrap()).unwrap();
    e.schedule(&copy_z).unwrap();
    assert!(all(&e.read::<f32>(copy_z.context(), &yz).unwrap(), 0.0));
    e.sync_all().unwrap();
}

fn raw_across_streams_waits_for_the_writer(kind: Kind) {
    let Some(mut e) = engine(kind, "raw_across_streams_waits_for_the_writer") else {
        return;
    };
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    let w = e.link(&a, slow_fill_on(kind, &x, 7.0)).unwrap();
    let r = e.link(&b, kernels::copy(&y, &x).unwrap()).unwrap();
    assert_eq!(
        w.context().array(x.id()).unwrap().loc,
        r.context().array(x.id()).unwrap().loc,
        "a shared node has one buffer per device"
    );
    e.schedule(&w).unwrap();
    e.schedule(&r).unwrap();
    let got: Vec<f32> = e.read(r.context(), &y).unwrap();
    assert!(all(&got, 7.0), "reader on stream 1 saw {:?}", &got[..4]);
}

fn war_across_streams_waits_for_the_reader(kind: Kind) {
    let Some(mut e) = engine(kind, "war_across_streams_waits_for_the_reader") else {
        return;
    };
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    let init = e.link(&a, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let overwrite = e
        .link(init.context(), kernels::fill(&x, 2.0).unwrap())
        .unwrap();
    let read = e.link(&b, slow_copy_on(kind, &y, &x)).unwrap();
    e.schedule(&init).unwrap();
    e.schedule(&read).unwrap();
    e.schedule(&overwrite).unwrap();
    let got: Vec<f32> = e.read(read.context(), &y).unwrap();
    assert!(
        all(&got, 1.0),
        "the slow reader saw the later write: {:?}",
        &got[..4]
    );
    let x_now: Vec<f32> = e.read(overwrite.context(), &x).unwrap();
    assert!(all(&x_now, 2.0));
}

fn waw_across_streams_keeps_program_order(kind: Kind) {
    let Some(mut e) = engine(kind, "waw_across_streams_keeps_program_order") else {
        return;
    };
    let x = node(
        "x",
        MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::SharedCrossStreams)),
    );
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    // Stream 0 owns x and writes it slowly; then stream 1 uploads the host value into
    // the same buffer. Program order says the upload wins.
    let w = e.link(&a, slow_fill_on(kind, &x, 5.0)).unwrap();
    let b = e.init_from_host(&b, &x, &vec![9.0f32; N]).unwrap();
    e.sync_all().unwrap();
    e.schedule(&w).unwrap();
    e.from_host(&b, &x).unwrap();
    e.sync_all().unwrap();
    let got: Vec<f32> = e.read(&b, &x).unwrap();
    assert!(
        all(&got, 9.0),
        "the earlier slow write landed last: {:?}",
        &got[..4]
    );
}

fn device_to_device_copy_then_overwrite_source(kind: Kind) {
    let Some(mut e) = engine(kind, "device_to_device_copy_then_overwrite_source") else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let z = node("z", MemoryMode::on_device());
    let src = e.context(0, 0).unwrap();
    let dst = e.context(1, 0).unwrap();
    let set3 = e.link(&src, kernels::fill(&x, 3.0).unwrap()).unwrap();
    let set4 = e
        .link(set3.context(), kernels::fill(&x, 4.0).unwrap())
        .unwrap();
    let busy = e.link(&dst, slow_fill_on(kind, &z, 1.0)).unwrap();
    let dst = e
        .link(busy.context(), kernels::fill(&x, 0.0).unwrap())
        .unwrap();
    e.schedule(&set3).unwrap();
    e.schedule(&busy).unwrap(); // delays the copy on the destination stream
    e.device_to_device(&x, set3.context(), dst.context(), MergeBufferUse::No)
        .unwrap()
        .expect("a real copy");
    e.schedule(&set4).unwrap(); // must wait for the copy to read x
    let got: Vec<f32> = e.read(dst.context(), &x).unwrap();
    assert!(
        all(&got, 3.0),
        "the copy read the overwritten source: {:?}",
        &got[..4]
    );
}

fn merge_buffer_copy_and_reuse_by_two_producers(kind: Kind) {
    let Some(mut e) = engine(kind, "merge_buffer_copy_and_reuse_by_two_producers") else {
        return;
    };
    let g = node("g", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let c1 = e.context(1, 0).unwrap();
    let c2 = e.context(1, 1).unwrap();
    let p1 = e.link(&c1, slow_fill_on(kind, &g, 2.0)).unwrap();
    let p2 = e.link(&c2, kernels::fill(&g, 3.0).unwrap()).unwrap();
    let base = e.link(&c0, kernels::fill(&g, 1.0).unwrap()).unwrap();
    let merge = e
        .link(base.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    e.schedule(&base).unwrap();
    e.schedule(&p1).unwrap();
    e.schedule(&p2).unwrap();
    e.device_to_device(&g, p1.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    e.schedule(&merge).unwrap(); // g = 1 + 2
    e.device_to_device(&g, p2.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    e.schedule(&merge).unwrap(); // g = 3 + 3
    let got: Vec<f32> = e.read(merge.context(), &g).unwrap();
    assert!(all(&got, 6.0), "got {:?}", &got[..4]);
}

fn merge_buffer_mismatch_is_refused_at_schedule(kind: Kind) {
    let Some(mut e) = engine(kind, "merge_buffer_mismatch_is_refused_at_schedule") else {
        return;
    };
    let g = node("g", MemoryMode::on_device());
    let h = node("h", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let c1 = e.context(1, 0).unwrap();
    let ph = e.link(&c1, kernels::fill(&h, 1.0).unwrap()).unwrap();
    let base = e.link(&c0, kernels::fill(&g, 1.0).unwrap()).unwrap();
    let merge = e
        .link(base.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    // Nothing in the merge buffer yet.
    assert!(matches!(
        e.schedule(&merge),
        Err(Error::MergeBufferMismatch { .. })
    ));
    e.schedule(&ph).unwrap();
    let hb = e
        .link(base.context(), kernels::fill(&h, 0.0).unwrap())
        .unwrap();
    let _ = hb;
    e.device_to_device(&h, ph.context(), base.context(), MergeBufferUse::Copy)
        .unwrap();
    let err = e.schedule(&merge).unwrap_err();
    assert!(matches!(err, Error::MergeBufferMismatch { .. }), "{err}");
}

fn streaming_for_reads_source_in_place_before_it_is_overwritten(kind: Kind) {
    let Some(mut e) = engine(
        kind,
        "streaming_for_reads_source_in_place_before_it_is_overwritten",
    ) else {
        return;
    };
    let g = node("g", MemoryMode::on_device());
    let z = node("z", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    // Vulkan reads in place only on one device (separate VkDevices share no memory), CUDA
    // only where peer access is on or the devices share a context (the backend says).
    let c1 = if !kind.streams_across_devices() {
        e.context(0, 1).unwrap()
    } else {
        e.context(1, 0).unwrap()
    };
    let src = e.link(&c1, kernels::fill(&g, 5.0).unwrap()).unwrap();
    let src_over = e
        .link(src.context(), kernels::fill(&g, 100.0).unwrap())
        .unwrap();
    let busy = e.link(&c0, slow_fill_on(kind, &z, 1.0)).unwrap();
    let base = e
        .link(busy.context(), kernels::fill(&g, 1.0).unwrap())
        .unwrap();
    let merge = e
        .link(base.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    e.schedule(&src).unwrap();
    e.schedule(&busy).unwrap();
    e.schedule(&base).unwrap();
    e.device_to_device(
        &g,
        src.context(),
        merge.context(),
        MergeBufferUse::StreamingFor(merge.clone()),
    )
    .unwrap();
    e.schedule(&src_over).unwrap(); // must wait for the streaming consumer
    let got: Vec<f32> = e.read(merge.context(), &g).unwrap();
    assert!(all(&got, 6.0), "consumer saw {:?}", &got[..4]);
}

fn lazy_host_transfers(kind: Kind) {
    let Some(mut e) = engine(kind, "lazy_host_transfers") else {
        return;
    };
    let w = node("w", MemoryMode::hosted_changed_on_devices());
    let c = e.context(0, 1).unwrap();
    let c = e.init_from_host(&c, &w, &vec![1.0f32; N]).unwrap();
    let double = kernels::scale_in_place(&w, 2.0).unwrap();
    let double = e.link(&c, double).unwrap();
    e.schedule(&double).unwrap();
    // Host read after a device write transfers the device value first.
    let host: Vec<f32> = e.host_read(&w).unwrap();
    assert!(all(&host, 2.0), "host read saw {:?}", &host[..4]);
    // Host write, then a device read: the device re-uploads before reading.
    e.host_write(&w, &vec![10.0f32; N]).unwrap();
    e.schedule(&double).unwrap();
    let host: Vec<f32> = e.host_read(&w).unwrap();
    assert!(
        all(&host, 20.0),
        "device did not see the host write: {:?}",
        &host[..4]
    );
}

fn constants_are_shared_by_all_streams_of_a_device(kind: Kind) {
    let Some(mut e) = engine(kind, "constants_are_shared_by_all_streams_of_a_device") else {
        return;
    };
    let k = node("k", MemoryMode::Hosted(HostedKind::Constant));
    let y0 = node("y0", MemoryMode::on_device());
    let y1 = node("y1", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let c1 = e.context(0, 1).unwrap();
    let c0 = e.init_from_host(&c0, &k, &vec![4.0f32; N]).unwrap();
    let r0 = e.link(&c0, kernels::copy(&y0, &k).unwrap()).unwrap();
    let r1 = e.link(&c1, kernels::copy(&y1, &k).unwrap()).unwrap();
    assert_eq!(
        r0.context().array(k.id()).unwrap().loc,
        r1.context().array(k.id()).unwrap().loc
    );
    e.schedule(&r0).unwrap();
    e.schedule(&r1).unwrap();
    assert!(all(&e.read::<f32>(r0.context(), &y0).unwrap(), 4.0));
    assert!(all(&e.read::<f32>(r1.context(), &y1).unwrap(), 4.0));
}

fn finalize_frees_only_after_in_flight_readers(kind: Kind) {
    let Some(mut e) = engine(kind, "finalize_frees_only_after_in_flight_readers") else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let z = node("z", MemoryMode::on_device());
    let q = node("q", MemoryMode::on_device());
    let owner = e.context(0, 0).unwrap();
    let dst = e.context(1, 0).unwrap();
    let set = e.link(&owner, kernels::fill(&x, 3.0).unwrap()).unwrap();
    let busy = e.link(&dst, slow_fill_on(kind, &z, 1.0)).unwrap();
    let dst = e
        .link(busy.context(), kernels::fill(&x, 0.0).unwrap())
        .unwrap();
    e.schedule(&set).unwrap();
    e.schedule(&busy).unwrap();
    e.device_to_device(&x, set.context(), dst.context(), MergeBufferUse::No)
        .unwrap();
    let live_before = e.memory_stats()[0].live_bytes;
    e.finalize(set.context()).unwrap();
    // A new allocation on the same device must not reuse x's range while the copy is pending.
    let reuse = e.link(&owner, kernels::fill(&q, 9.0).unwrap()).unwrap();
    e.schedule(&reuse).unwrap();
    let got: Vec<f32> = e.read(dst.context(), &x).unwrap();
    assert!(
        all(&got, 3.0),
        "freed memory was reused under a reader: {:?}",
        &got[..4]
    );
    e.sync_all().unwrap();
    let live_after = e.memory_stats()[0].live_bytes;
    assert!(live_after <= live_before, "{live_after} > {live_before}");
    // The finalized context is gone for good.
    assert!(matches!(
        e.schedule(&set),
        Err(Error::ContextFinalized { .. })
    ));
}

fn finalize_refuses_a_context_with_live_children(kind: Kind) {
    let Some(mut e) = engine(kind, "finalize_refuses_a_context_with_live_children") else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let c = e.context(0, 0).unwrap();
    let r = e.link(&c, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let child = e
        .link(r.context(), kernels::fill(&x, 2.0).unwrap())
        .unwrap();
    assert!(matches!(
        e.finalize(r.context()),
        Err(Error::ContextInUse { children: 1, .. })
    ));
    e.finalize(child.context()).unwrap();
    e.finalize(r.context()).unwrap();
    assert!(matches!(
        e.finalize(r.context()),
        Err(Error::ContextFinalized { .. })
    ));
}

fn panicking_kernel_fails_its_dependents_but_not_the_system(kind: Kind) {
    let Some(mut e) = engine(
        kind,
        "panicking_kernel_fails_its_dependents_but_not_the_system",
    ) else {
        return;
    };
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let u = node("u", MemoryMode::on_device());
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    let boom = failing(kind, "boom", &x, "kernel exploded");
    let boom = e.link(&a, boom).unwrap();
    let dependent = e.link(&b, kernels::copy(&y, &x).unwrap()).unwrap();
    let unrelated = e.link(&b, kernels::fill(&u, 8.0).unwrap()).unwrap();
    let ev_boom = e.schedule(&boom).unwrap();
    let ev_dep = e.schedule(&dependent).unwrap();
    let ev_unrel = e.schedule(&unrelated).unwrap();
    let err = ev_boom.wait_timeout(Duration::from_secs(10)).unwrap_err();
    let root = err.root_cause().expect("a root cause").clone();
    assert!(root.message.contains("kernel exploded"), "{root}");
    let dep_err = ev_dep.wait_timeout(Duration::from_secs(10)).unwrap_err();
    assert_eq!(
        dep_err.root_cause(),
        Some(&root),
        "dependent names the root cause"
    );
    ev_unrel.wait_timeout(Duration::from_secs(10)).unwrap();
    assert!(all(&e.read::<f32>(unrelated.context(), &u).unwrap(), 8.0));
    // Overwriting x heals it: later readers succeed.
    let heal = e
        .link(boom.context(), kernels::fill(&x, 3.0).unwrap())
        .unwrap();
    e.schedule(&heal).unwrap();
    e.schedule(&dependent)
        .unwrap()
        .wait_timeout(Duration::from_secs(10))
        .unwrap();
    assert!(all(&e.read::<f32>(dependent.context(), &y).unwrap(), 3.0));
}

fn second_writer_of_a_shared_node_is_refused(kind: Kind) {
    let Some(mut e) = engine(kind, "second_writer_of_a_shared_node_is_refused") else {
        return;
    };
    let x = node("x", shared());
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    e.link(&a, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let stats = e.memory_stats();
    let err = e.link(&b, kernels::fill(&x, 2.0).unwrap()).unwrap_err();
    assert!(matches!(err, Error::SecondWriter { .. }), "{err}");
    assert_eq!(e.memory_stats()[0].live_bytes, stats[0].live_bytes);
}

fn bad_input_gets_typed_errors_and_changes_nothing(kind: Kind) {
    let pools = PoolConfig {
        limit_bytes: Some(1 << 20),
        pool_bytes: 1 << 16,
        ..Default::default()
    };
    let Some(mut e) = engine_with(
        kind,
        "bad_input_gets_typed_errors_and_changes_nothing",
        pools,
    ) else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let h = node("h", MemoryMode::hosted_changed_on_devices());
    let c = e.context(0, 0).unwrap();
    let before = e.memory_stats();
    // Node not in context.
    assert!(matches!(
        e.read::<f32>(&c, &x),
        Err(Error::NodeNotInContext { .. })
    ));
    // Wrong dtype and size.
    assert!(matches!(
        e.read::<f64>(&c, &x),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        e.init_from_host(&c, &h, &[1.0f32; 3]),
        Err(Error::SizeMismatch { .. })
    ));
    // Not hosted.
    assert!(matches!(
        e.host_write(&x, &[0.0f32; N]),
        Err(Error::NotHosted { .. })
    ));
    // Pool exhausted: a node larger than the device limit.
    let huge = TensorNode::new("huge", DType::F32, [1 << 20]);
    let err = e.link(&c, kernels::fill(&huge, 0.0).unwrap()).unwrap_err();
    assert!(matches!(err, Error::PoolExhausted { .. }), "{err}");
    // Zero-size node.
    let empty = TensorNode::new("empty", DType::F32, [0]);
    assert!(matches!(
        e.link(&c, kernels::fill(&empty, 0.0).unwrap()),
        Err(Error::InvalidSize { .. })
    ));
    // Virtual node.
    let v = node("v", MemoryMode::Virtual);
    assert!(matches!(
        e.link(&c, kernels::fill(&v, 0.0).unwrap()),
        Err(Error::NotMaterialized { .. })
    ));
    // Unknown stream.
    assert!(matches!(
        e.context(0, 9),
        Err(Error::NoSuchStream {
            index: 9,
            count: 2,
            ..
        })
    ));
    let after = e.memory_stats();
    assert_eq!(before[0].live_bytes, after[0].live_bytes);
    assert_eq!(before[0].reserved_bytes, after[0].reserved_bytes);
    // The engine still works.
    let r = e.link(&c, kernels::fill(&x, 1.5).unwrap()).unwrap();
    e.schedule(&r).unwrap();
    assert!(all(&e.read::<f32>(r.context(), &x).unwrap(), 1.5));
}

fn tables_stay_bounded_under_endless_work(kind: Kind) {
    let Some(mut e) = engine(kind, "tables_stay_bounded_under_endless_work") else {
        return;
    };
    let x = node("x", shared());
    let y = zeroed_node("y", MemoryMode::on_device());
    let a = e.context(0, 0).unwrap();
    let b = e.context(0, 1).unwrap();
    let w = e.link(&a, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let r = e.link(&b, kernels::add_into(&y, &x).unwrap()).unwrap();
    let mut max_events = 0;
    for i in 0..20_000 {
        e.schedule(&w).unwrap();
        e.schedule(&r).unwrap();
        if i % 1000 == 0 {
            let (sizes, host) = e.table_sizes();
            max_events = max_events.max(sizes[0].events + host);
        }
    }
    e.sync_all().unwrap();
    let got: Vec<f32> = e.read(r.context(), &y).unwrap();
    assert!(all(&got, 20_000.0), "{:?}", &got[..4]);
    // One writer and at most one reader per stream per buffer.
    assert!(max_events <= 8, "tables grew to {max_events} events");
    let (sizes, _) = e.table_sizes();
    assert!(sizes[0].events <= 4, "{sizes:?}");
}

fn two_devices_two_streams_pipeline(kind: Kind) {
    let Some(mut e) = engine(kind, "two_devices_two_streams_pipeline") else {
        return;
    };
    let w = node("w", MemoryMode::hosted_changed_on_devices());
    let g = node("g", MemoryMode::on_device());
    let ctx0 = e.context(0, 0).unwrap();
    let ctx1 = e.context(1, 1).unwrap();
    let ctx0 = e.init_from_host(&ctx0, &w, &vec![1.0f32; N]).unwrap();
    let ctx1 = e.init_from_host(&ctx1, &w, &vec![1.0f32; N]).unwrap();
    let grad0 = e.link(&ctx0, kernels::scale(&g, &w, 0.5).unwrap()).unwrap();
    let grad1 = e
        .link(&ctx1, kernels::scale(&g, &w, 0.25).unwrap())
        .unwrap();
    let merge = e
        .link(grad0.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    e.schedule(&grad0).unwrap();
    e.schedule(&grad1).unwrap();
    e.device_to_device(&g, grad1.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    let done = e.schedule(&merge).unwrap();
    done.wait().unwrap();
    let g_host: Vec<f32> = e.read(merge.context(), &g).unwrap();
    assert!(all(&g_host, 0.75), "{:?}", &g_host[..4]);
}

fn host_write_waits_for_pending_uploads(kind: Kind) {
    let Some(mut e) = engine(kind, "host_write_waits_for_pending_uploads") else {
        return;
    };
    let h = node("h", MemoryMode::Hosted(HostedKind::Volatile));
    let z = node("z", MemoryMode::on_device());
    let c = e.context(0, 0).unwrap();
    let c = e.init_from_host(&c, &h, &vec![1.0f32; N]).unwrap();
    let busy = e.link(&c, slow_fill_on(kind, &z, 1.0)).unwrap();
    e.schedule(&busy).unwrap(); // the upload below queues behind this
    e.from_host(busy.context(), &h).unwrap();
    // Program order: the upload read the host array before this write. The buffer now
    // lags the write (`read` would show the host's 2s): look at its bytes.
    e.host_write(&h, &vec![2.0f32; N]).unwrap();
    let got: Vec<f32> = e.read_device_raw(busy.context(), &h).unwrap();
    assert!(
        all(&got, 1.0),
        "the pending upload read the later host write: {:?}",
        &got[..4]
    );
}

fn odd_sized_nodes_transfer_and_compute_exactly_their_elements(kind: Kind) {
    let Some(mut e) = engine(
        kind,
        "odd_sized_nodes_transfer_and_compute_exactly_their_elements",
    ) else {
        return;
    };
    let w = TensorNode::new("w", DType::F32, [3])
        .with_mode(MemoryMode::hosted_changed_on_devices())
        .unwrap();
    let g = TensorNode::new("g", DType::F32, [3])
        .with_mode(MemoryMode::on_device())
        .unwrap();
    let c0 = e.context(0, 0).unwrap();
    let c1 = e.context(1, 1).unwrap();
    let c0 = e.init_from_host(&c0, &w, &[1.0f32, 2.0, 3.0]).unwrap();
    let r0 = e.link(&c0, kernels::scale(&g, &w, 2.0).unwrap()).unwrap();
    let r1 = e.link(&c1, kernels::fill(&g, 1.0).unwrap()).unwrap();
    let m = e
        .link(r0.context(), kernels::add_merge(&g).unwrap())
        .unwrap();
    e.schedule(&r0).unwrap();
    e.schedule(&r1).unwrap();
    e.device_to_device(&g, r1.context(), m.context(), MergeBufferUse::Copy)
        .unwrap();
    e.schedule(&m).unwrap();
    assert_eq!(e.read::<f32>(m.context(), &g).unwrap(), vec![3.0, 5.0, 7.0]);
    assert_eq!(e.host_read::<f32>(&w).unwrap(), vec![1.0, 2.0, 3.0]);
}

/// A buffer that lags a host write stands for the host's value: a `read`, a merge-buffer
/// `Copy`, a `StreamingFor` consumer and a copy into a buffer all see the host write, never
/// the stale device bytes (the source is uploaded first); `read_device_raw` shows them.
fn copies_and_reads_of_a_lagging_buffer_see_the_host_write(kind: Kind) {
    let Some(mut e) = engine(
        kind,
        "copies_and_reads_of_a_lagging_buffer_see_the_host_write",
    ) else {
        return;
    };
    let w = node(
        "w",
        MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::PerStream)),
    );
    let src = e.context(0, 0).unwrap();
    let src = e.link(&src, kernels::fill(&w, 1.0).unwrap()).unwrap();
    e.schedule(&src).unwrap();
    let src = src.context().clone();
    let host = |k: f32| vec![k; N];

    e.host_write(&w, &host(3.0)).unwrap();
    let got: Vec<f32> = e.read(&src, &w).unwrap();
    assert!(all(&got, 3.0), "read of a lagging buffer: {:?}", &got[..4]);
    let raw: Vec<f32> = e.read_device_raw(&src, &w).unwrap();
    assert!(all(&raw, 1.0), "the raw view shows the device bytes");

    // Copy into the merge buffer of another device; the consumer's own (fresh) buffer is
    // uploaded too: 3 + 3.
    let d1 = e.context(1, 0).unwrap();
    let merge = e.link(&d1, kernels::add_merge(&w).unwrap()).unwrap();
    e.device_to_device(&w, &src, merge.context(), MergeBufferUse::Copy)
        .unwrap();
    e.schedule(&merge).unwrap();
    let got: Vec<f32> = e.read(merge.context(), &w).unwrap();
    assert!(all(&got, 6.0), "merge-buffer copy: {:?}", &got[..4]);

    // Streamed on the source's device (every backend can read its own memory in place):
    // both the source and the consumer's buffer lag the new write: 5 + 5.
    e.host_write(&w, &host(5.0)).unwrap();
    let s1 = e.context(0, 1).unwrap();
    let streamed = e.link(&s1, kernels::add_merge(&w).unwrap()).unwrap();
    e.device_to_device(
        &w,
        &src,
        streamed.context(),
        MergeBufferUse::StreamingFor(streamed.clone()),
    )
    .unwrap();
    let got: Vec<f32> = e.read(streamed.context(), &w).unwrap();
    assert!(all(&got, 10.0), "streamed consumer: {:?}", &got[..4]);

    // Into the node's own buffer on another device.
    e.host_write(&w, &host(7.0)).unwrap();
    e.device_to_device(&w, &src, merge.context(), MergeBufferUse::No)
        .unwrap();
    let got: Vec<f32> = e.read_device_raw(merge.context(), &w).unwrap();
    assert!(all(&got, 7.0), "copy into a buffer: {:?}", &got[..4]);
    assert_eq!(e.host_read::<f32>(&w).unwrap(), host(7.0));
}
