// A stream queue is started only with `unsafe`: its caller promises that the plans it gets
// are the protocol's and that nothing else completes its timeline.
use tributary::{
    backend::{cpu::CpuBackend, Backend},
    DeviceId, StreamId, Timeline,
};

fn main() {
    let backend = CpuBackend::new(DeviceId(0), 1);
    let stream = StreamId { device: DeviceId(0), index: 0 };
    let _queue = backend.start_stream(stream, Timeline::new(stream));
}
