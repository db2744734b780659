//! End-to-end tests of the actor system, driven through `System` as a host application
//! would. Each test checks data values, not only the absence of errors.

#![cfg(not(tributary_loom))]

use std::time::{Duration, Instant};

use support::{
    all, backend_kind, failing, node, shared, slow_copy_on, slow_fill_on, slow_fill_times,
    zeroed_node, Kind, N,
};
use tributary::{
    backend::{vulkan::VulkanConfig, BackendKind},
    kernels, DType, Error, HostedKind, MemoryMode, MergeBufferUse, Sharing,
};
use tributary_actors::{block_on, StreamConfig, System, SystemConfig};
use tributary_testkit::{for_each_backend, support};

const T: Duration = Duration::from_secs(20);

/// 2 devices x 2 streams on `kind`, or `None` when that backend is not available here.
fn system(kind: Kind, test: &str) -> Option<System> {
    let backend = backend_kind(kind, 2, test)?;
    Some(
        System::builder()
            .cpu_devices(2)
            .backend(backend)
            .streams(StreamConfig::MostParallelStreams(2))
            .spawn()
            .expect("spawn"),
    )
}

for_each_backend!(
    cross_stream_raw_war_waw_on_one_device,
    cross_device_copies_in_all_three_modes,
    lazy_host_transfers_of_hosted_nodes,
    constants_are_shared_by_all_streams,
    finalize_frees_memory_only_after_in_flight_readers,
    panicking_kernel_fails_its_event_and_dependents_not_the_system,
    shutdown_with_work_in_flight_is_bounded_and_reports_abandoned_work,
    misuse_gets_typed_errors_and_the_system_keeps_serving,
    node_messages_and_awaiting_a_stream,
);

fn cross_stream_raw_war_waw_on_one_device(kind: Kind) {
    let Some(sys) = system(kind, "cross_stream_raw_war_waw_on_one_device") else {
        return;
    };
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let a = sys.device(0).stream(0).context().unwrap();
    let b = sys.device(0).stream(1).context().unwrap();
    // RAW: slow writer on stream 0, reader on stream 1.
    let w = a.link(slow_fill_on(kind, &x, 7.0)).unwrap();
    let r = b.link(kernels::copy(&y, &x).unwrap()).unwrap();
    w.schedule().unwrap();
    r.schedule().unwrap();
    assert!(all(&r.context().read::<f32>(&y).unwrap(), 7.0), "RAW");
    // WAR: slow reader on stream 1, then a write on stream 0.
    let y2 = node("y2", MemoryMode::on_device());
    let read = b.link(slow_copy_on(kind, &y2, &x)).unwrap();
    let over = w.context().link(kernels::fill(&x, 2.0).unwrap()).unwrap();
    read.schedule().unwrap();
    over.schedule().unwrap();
    assert!(all(&read.context().read::<f32>(&y2).unwrap(), 7.0), "WAR");
    // WAW: a slow write on stream 0, then an upload into the same buffer on stream 1.
    let h = node(
        "h",
        MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::SharedCrossStreams)),
    );
    let hw = a.link(slow_fill_on(kind, &h, 5.0)).unwrap();
    let hb = b.init_from_host(&h, &vec![9.0f32; N]).unwrap();
    sys.sync().unwrap();
    hw.schedule().unwrap();
    hb.from_host(&h).unwrap();
    assert!(all(&hb.read::<f32>(&h).unwrap(), 9.0), "WAW");
    sys.shutdown().unwrap();
}

fn cross_device_copies_in_all_three_modes(kind: Kind) {
    let Some(sys) = system(kind, "cross_device_copies_in_all_three_modes") else {
        return;
    };
    let g = node("g", MemoryMode::on_device());
    let z = node("z", MemoryMode::on_device());
    let c0 = sys.context(0, 0).unwrap();
    let c1 = sys.context(1, 0).unwrap();
    let src = c1.link(kernels::fill(&g, 5.0).unwrap()).unwrap();
    let src_over = src
        .context()
        .link(kernels::fill(&g, 100.0).unwrap())
        .unwrap();
    let busy = c0.link(slow_fill_on(kind, &z, 1.0)).unwrap();
    let base = busy
        .context()
        .link(kernels::fill(&g, 1.0).unwrap())
        .unwrap();
    let merge = base
        .context()
        .link(kernels::add_merge(&g).unwrap())
        .unwrap();
    // Program order: the copy is issued right after the producer, without waiting.
    src.schedule().unwrap();
    busy.schedule().unwrap();
    base.schedule().unwrap();
    // Copy into the merge buffer, merge: g = 1 + 5.
    sys.device_to_device(&g, &src.context(), &merge.context(), MergeBufferUse::Copy)
        .unwrap();
    merge.schedule().unwrap();
    // Streaming: the consumer reads the source in place: g = 6 + 5; then the source is
    // overwritten, which must wait for the consumer.
    let streamed = sys.device_to_device(
        &g,
        &src.context(),
        &merge.context(),
        MergeBufferUse::StreamingFor(merge.routine().clone()),
    );
    if !kind.streams_across_devices() {
        // Two VkDevices (CUDA contexts of their own without peer access) cannot address
        // each other's memory: refused, so copy instead.
        assert!(
            matches!(streamed, Err(Error::StreamingUnsupported { .. })),
            "{:?}",
            streamed.map(|_| ())
        );
        sys.device_to_device(&g, &src.context(), &merge.context(), MergeBufferUse::Copy)
            .unwrap();
        merge.schedule().unwrap();
    } else {
        streamed.unwrap();
    }
    src_over.schedule().unwrap();
    assert!(all(&merge.context().read::<f32>(&g).unwrap(), 11.0));
    // Plain copy into the node's own buffer: g = 100 on device 0.
    sys.device_to_device(
        &g,
        &src_over.context(),
        &merge.context(),
        MergeBufferUse::No,
    )
    .unwrap();
    assert!(all(&merge.context().read::<f32>(&g).unwrap(), 100.0));
    sys.shutdown().unwrap();
}

fn lazy_host_transfers_of_hosted_nodes(kind: Kind) {
    let Some(sys) = system(kind, "lazy_host_transfers_of_hosted_nodes") else {
        return;
    };
    let w = node("w", MemoryMode::hosted_changed_on_devices());
    let c = sys.context(1, 1).unwrap();
    let c = c.init_from_host(&w, &vec![1.0f32; N]).unwrap();
    let double = kernels::scale_in_place(&w, 2.0).unwrap();
    let double = c.link(double).unwrap();
    double.schedule().unwrap();
    // Host read right after scheduling (no wait): sees the device write.
    assert!(all(&sys.host_read::<f32>(&w).unwrap(), 2.0));
    sys.host_write(&w, &vec![10.0f32; N]).unwrap();
    double.schedule().unwrap();
    assert!(all(&sys.host_read::<f32>(&w).unwrap(), 20.0));
    sys.shutdown().unwrap();
}

fn constants_are_shared_by_all_streams(kind: Kind) {
    let Some(sys) = system(kind, "constants_are_shared_by_all_streams") else {
        return;
    };
    let k = node("k", MemoryMode::Hosted(HostedKind::Constant));
    let (y0, y1) = (
        node("y0", MemoryMode::on_device()),
        node("y1", MemoryMode::on_device()),
    );
    let c0 = sys
        .context(0, 0)
        .unwrap()
        .init_from_host(&k, &vec![4.0f32; N])
        .unwrap();
    let c1 = sys.context(0, 1).unwrap();
    let r0 = c0.link(kernels::copy(&y0, &k).unwrap()).unwrap();
    let r1 = c1.link(kernels::copy(&y1, &k).unwrap()).unwrap();
    assert_eq!(
        r0.context().array(k.id()).unwrap().loc,
        r1.context().array(k.id()).unwrap().loc
    );
    r0.schedule().unwrap();
    r1.schedule().unwrap();
    assert!(all(&r0.context().read::<f32>(&y0).unwrap(), 4.0));
    assert!(all(&r1.context().read::<f32>(&y1).unwrap(), 4.0));
    sys.shutdown().unwrap();
}

fn finalize_frees_memory_only_after_in_flight_readers(kind: Kind) {
    let Some(sys) = system(kind, "finalize_frees_memory_only_after_in_flight_readers") else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let z = node("z", MemoryMode::on_device());
    let q = node("q", MemoryMode::on_device());
    let owner = sys.context(0, 0).unwrap();
    let dst = sys.context(1, 0).unwrap();
    let set = owner.link(kernels::fill(&x, 3.0).unwrap()).unwrap();
    let busy = dst.link(slow_fill_on(kind, &z, 1.0)).unwrap();
    let dst = busy
        .context()
        .link(kernels::fill(&x, 0.0).unwrap())
        .unwrap();
    set.schedule().unwrap();
    busy.schedule().unwrap();
    sys.device_to_device(&x, &set.context(), &dst.context(), MergeBufferUse::No)
        .unwrap();
    set.context().finalize().unwrap();
    let reuse = owner.link(kernels::fill(&q, 9.0).unwrap()).unwrap();
    reuse.schedule().unwrap();
    assert!(all(&dst.context().read::<f32>(&x).unwrap(), 3.0));
    sys.sync().unwrap();
    let stats = sys.memory_stats().unwrap();
    assert_eq!(
        stats[0].live_bytes as usize,
        N * 4,
        "only q is live on d0: {stats:?}"
    );
    assert!(matches!(
        set.schedule().unwrap().wait_timeout(T),
        Err(Error::ContextFinalized { .. })
    ));
    sys.shutdown().unwrap();
}

fn panicking_kernel_fails_its_event_and_dependents_not_the_system(kind: Kind) {
    let Some(sys) = system(
        kind,
        "panicking_kernel_fails_its_event_and_dependents_not_the_system",
    ) else {
        return;
    };
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let u = node("u", MemoryMode::on_device());
    let a = sys.context(0, 0).unwrap();
    let b = sys.context(0, 1).unwrap();
    let boom = failing(kind, "boom", &x, "kernel exploded");
    let boom = a.link(boom).unwrap();
    let dependent = b.link(kernels::copy(&y, &x).unwrap()).unwrap();
    let unrelated = b.link(kernels::fill(&u, 8.0).unwrap()).unwrap();
    let t_boom = boom.schedule().unwrap();
    let t_dep = dependent.schedule().unwrap();
    let t_unrel = unrelated.schedule().unwrap();
    let err = t_boom.wait_timeout(T).unwrap_err();
    let root = err.root_cause().expect("root cause").clone();
    assert!(root.message.contains("kernel exploded"), "{root}");
    let dep = t_dep.wait_timeout(T).unwrap_err();
    assert_eq!(dep.root_cause(), Some(&root));
    t_unrel.wait_timeout(T).unwrap();
    assert!(all(&unrelated.context().read::<f32>(&u).unwrap(), 8.0));
    // The system keeps serving: heal x and read it through the dependent.
    let heal = boom
        .context()
        .link(kernels::fill(&x, 3.0).unwrap())
        .unwrap();
    heal.schedule().unwrap();
    dependent.schedule().unwrap().wait_timeout(T).unwrap();
    assert!(all(&dependent.context().read::<f32>(&y).unwrap(), 3.0));
    sys.shutdown().unwrap();
}

fn shutdown_with_work_in_flight_is_bounded_and_reports_abandoned_work(kind: Kind) {
    let Some(sys) = system(
        kind,
        "shutdown_with_work_in_flight_is_bounded_and_reports_abandoned_work",
    ) else {
        return;
    };
    let x = node("x", MemoryMode::on_device());
    let c = sys.context(0, 0).unwrap();
    // About 300 ms each (5 spinning workgroups on Vulkan).
    let slow = c.link(slow_fill_times(kind, &x, 0.0, 5)).unwrap();
    let tickets: Vec<_> = (0..10).map(|_| slow.schedule().unwrap()).collect();
    // The first completes before the shutdown starts (so some work completed, whatever the
    // machine's load); the other nine need at least 2.7 s, far past the 500 ms deadline
    // (load only makes them slower), so some are abandoned.
    tickets[0].wait_timeout(T).unwrap();
    let start = Instant::now();
    let report = sys.shutdown_within(Duration::from_millis(500)).unwrap();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(3), "shutdown took {took:?}");
    assert!(!report.abandoned.is_empty(), "{report:?}");
    // Every waiter returns: completed work succeeds, abandoned work fails; none hangs.
    let mut ok = 0;
    let mut failed = 0;
    for t in tickets {
        match t.wait_timeout(T) {
            Ok(()) => ok += 1,
            Err(Error::Failed(f)) => {
                assert!(f.message.contains("abandoned"), "{f}");
                failed += 1
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(ok >= 1 && failed >= 1, "ok {ok}, failed {failed}");
    // Later calls fail with a typed error.
    assert!(matches!(sys.context(0, 0), Err(Error::ShutDown(_))));
    assert!(matches!(slow.schedule(), Err(Error::ShutDown(_))));
}

#[test]
fn config_from_toml_and_json_and_async_methods() {
    let toml = r#"
        cpu_devices = 3
        streams = "OnlyDevicesParallel"
        mailbox_capacity = 8
        [pools]
        pool_bytes = 1048576
    "#;
    let cfg = SystemConfig::from_toml_str(toml).unwrap();
    assert_eq!(cfg.cpu_devices, 3);
    assert_eq!(cfg.streams, StreamConfig::OnlyDevicesParallel);
    let json = r#"{"cpu_devices": 1, "streams": {"MostParallelStreams": 3}}"#;
    assert_eq!(
        SystemConfig::from_json_str(json)
            .unwrap()
            .streams
            .streams_per_device(),
        3
    );
    assert!(SystemConfig::from_toml_str("cpu_devices = 'two'").is_err());
    assert!(SystemConfig::from_toml_str("bogus = 1").is_err());
    let vk = SystemConfig::from_toml_str("[backend.Vulkan]\ndevices = 2\n").unwrap();
    assert_eq!(
        vk.backend,
        BackendKind::Vulkan(VulkanConfig::with_devices(2)),
        "a Vulkan backend from TOML"
    );

    let sys = System::from_config(cfg).unwrap();
    assert_eq!(sys.device_count(), 3);
    assert!(matches!(
        sys.context(0, 1),
        Err(Error::NoSuchStream {
            index: 1,
            count: 1,
            ..
        })
    ));
    let w = node("w", MemoryMode::hosted_changed_on_devices());
    let g = zeroed_node("g", MemoryMode::on_device()); // accumulated into
                                                       // Async API from a hand-driven future; the small mailbox exercises back-pressure.
    let total = block_on(async {
        let c = sys.context_async(2, 0).await?;
        let c = sys.init_from_host_async(&c, &w, &vec![2.0f32; N]).await?;
        let r = sys.link_async(&c, kernels::add_into(&g, &w)?).await?;
        let mut last = None;
        for _ in 0..100 {
            last = Some(r.schedule()?);
        }
        if let Some(t) = last {
            t.wait_async().await?;
        }
        sys.read_async::<f32>(r.routine().context(), &g).await
    })
    .unwrap();
    assert!(all(&total, 200.0), "{:?}", &total[..4]);
    let info = sys.debug_info().unwrap();
    assert_eq!(info["devices"].as_array().map(|a| a.len()), Some(3));
    assert!(sys.is_idle().unwrap());
    let report = sys.memory_report().unwrap();
    assert!(report.to_string().contains("d2"));
    sys.shutdown().unwrap();
}

fn misuse_gets_typed_errors_and_the_system_keeps_serving(kind: Kind) {
    let Some(sys) = system(
        kind,
        "misuse_gets_typed_errors_and_the_system_keeps_serving",
    ) else {
        return;
    };
    let x = node("x", shared());
    let g = node("g", MemoryMode::on_device());
    let a = sys.context(0, 0).unwrap();
    let b = sys.context(0, 1).unwrap();
    let w = a.link(kernels::fill(&x, 1.0).unwrap()).unwrap();
    assert!(matches!(
        b.link(kernels::fill(&x, 2.0).unwrap()),
        Err(Error::SecondWriter { .. })
    ));
    let merge = a.link(kernels::add_merge(&g).unwrap()).unwrap();
    let t = merge.schedule().unwrap();
    assert!(matches!(
        t.wait_timeout(T),
        Err(Error::MergeBufferMismatch { .. })
    ));
    assert!(matches!(
        b.read::<f32>(&g),
        Err(Error::NodeNotInContext { .. })
    ));
    assert!(matches!(
        sys.host_read::<f32>(&g),
        Err(Error::NotHosted { .. })
    ));
    assert!(matches!(
        w.context().read::<f64>(&x),
        Err(Error::DTypeMismatch { .. })
    ));
    w.schedule().unwrap();
    assert!(all(&w.context().read::<f32>(&x).unwrap(), 1.0));
    sys.shutdown().unwrap();
}

fn node_messages_and_awaiting_a_stream(kind: Kind) {
    use tributary_actors::messages::{CreateNode, RefineNode};
    let Some(sys) = system(kind, "node_messages_and_awaiting_a_stream") else {
        return;
    };
    let coordinator = sys.coordinator();
    let x = block_on(coordinator.send(CreateNode {
        label: "x".into(),
        dtype: DType::F32,
        shape: [N].into(),
        mode: MemoryMode::Materialized,
    }))
    .unwrap()
    .unwrap();
    let refined = block_on(coordinator.send(RefineNode {
        node: x.clone(),
        mode: MemoryMode::on_device(),
    }))
    .unwrap()
    .unwrap();
    assert_eq!(refined, MemoryMode::on_device());
    let err = block_on(coordinator.send(RefineNode {
        node: x.clone(),
        mode: MemoryMode::Virtual,
    }))
    .unwrap()
    .unwrap_err();
    assert!(matches!(err, Error::ModeConflict { .. }));
    let c = sys.context(1, 1).unwrap();
    let r = c.link(slow_fill_on(kind, &x, 4.0)).unwrap();
    let t = r.schedule().unwrap();
    sys.await_stream(1, 1).unwrap();
    assert!(t.is_done());
    assert!(all(&r.context().read::<f32>(&x).unwrap(), 4.0));
    assert!(matches!(
        sys.await_stream(1, 7),
        Err(Error::NoSuchStream { index: 7, .. })
    ));
    sys.shutdown().unwrap();
}
