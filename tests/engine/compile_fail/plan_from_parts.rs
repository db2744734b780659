// Outside the protocol, a plan is made only with `unsafe` (its contract is the protocol's).
use tributary::{
    protocol::{Plan, Work},
    DeviceId, Event, StreamId, Timeline,
};

fn main() {
    let stream = StreamId { device: DeviceId(0), index: 0 };
    let event = Event::new(Timeline::new(stream), 1);
    let _plan = Plan::from_parts(stream, event, Vec::new(), Work::Marker);
}
