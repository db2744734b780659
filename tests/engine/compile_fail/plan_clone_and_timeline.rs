// A plan cannot be cloned (to submit it twice, or to two queues), and an event's timeline
// (which completes it) is not reachable from outside the crate.
use tributary::{protocol::Plan, Event};

fn twice(plan: Plan) -> (Plan, Plan) {
    (plan.clone(), plan)
}

fn complete(event: &Event) {
    event.timeline().signal(event.seq());
}

fn main() {
    let _ = (twice, complete);
}
