// Operations reach a device only through the system's dispatcher, at one point of the
// program order; a pending event is decided only by the device that plans its operation.
// User code can reach neither: it cannot post behind the system's back, nor decide a
// ticket it was handed.
use tributary::pending::PendingEvent;

fn main() {
    let sys = tributary_actors::System::builder().spawn().unwrap();
    let _dispatcher = sys.dispatcher();
    let timeline = tributary::Timeline::new(tributary::StreamId {
        device: tributary::DeviceId(0),
        index: 0,
    });
    let (_pending, _promise) = PendingEvent::new(timeline);
}
