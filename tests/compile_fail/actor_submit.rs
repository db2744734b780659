// The actor message that carries plans to a stream actor is not public: plans reach a
// stream only from the device actor that made them.
use tributary_actors::messages::Submit;

fn main() {
    let _message = Submit(Vec::new());
}
