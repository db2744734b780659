// A plan cannot be built with fields.
use tributary::{
    protocol::{Plan, Work},
    DeviceId, Event, StreamId, Timeline,
};

fn main() {
    let stream = StreamId { device: DeviceId(0), index: 0 };
    let event = Event::new(Timeline::new(stream), 1);
    let _plan = Plan { stream, event, deps: Default::default(), work: Work::Marker };
}
