//! Models of the shim's channel (`src/sync/channel.rs`): the queue that feeds the stream
//! threads of the protocol models' executor (`world.rs`). Its two promises: a receiver
//! blocked on an empty queue is woken by a send, and a receiver whose senders are all
//! gone still gets every message queued before it learns of the disconnection.

use tributary::sync::{channel, thread};

use crate::harness::{builder, run_model};

/// A receiver waiting on an empty queue and a send: the message arrives (no lost
/// wake-up). The sender stays connected until the receiver has it, so that only the send
/// can wake it.
#[test]
fn recv_is_woken_by_send() {
    run_model("channel::recv_is_woken_by_send", builder(None), || {
        let (tx, rx) = channel::unbounded::<u32>();
        let receiver = thread::spawn(move || rx.recv());
        tx.send(7).unwrap();
        assert_eq!(receiver.join().unwrap(), Ok(7));
        drop(tx);
    });
}

/// A sender queues two messages and leaves: the receiver gets both, in order, and only
/// then the disconnection (a worker loop drains its queue before it exits).
#[test]
fn queued_messages_survive_disconnect() {
    run_model(
        "channel::queued_messages_survive_disconnect",
        builder(None),
        || {
            let (tx, rx) = channel::unbounded::<u32>();
            let sender = thread::spawn(move || {
                tx.send(1).unwrap();
                tx.send(2).unwrap();
            });
            assert_eq!(rx.recv(), Ok(1));
            assert_eq!(rx.recv(), Ok(2));
            assert_eq!(rx.recv(), Err(channel::RecvError));
            sender.join().unwrap();
        },
    );
}
