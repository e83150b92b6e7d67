//! The magics-only kernel driven in process by [`crate::testing::TestFrontend`]: the rules
//! every frontend relies on, and what a peer without the key cannot do.

use super::run;
use crate::testing::{connection, Received, TestFrontend};
use serde_json::json;
use std::io::Write;
use std::time::Duration;

async fn start() -> (tempfile::TempDir, TestFrontend) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let info = connection(dir.path());
    let served = info.clone();
    tokio::spawn(async move {
        if let Err(e) = run(served).await {
            panic!("the kernel stopped: {e:#}");
        }
    });
    let frontend = TestFrontend::connect(&info).await;
    (dir, frontend)
}

fn of_type<'a>(msgs: &'a [Received], t: &str) -> Vec<&'a Received> {
    msgs.iter().filter(|m| m.msg_type == t).collect()
}

fn states(msgs: &[Received]) -> Vec<String> {
    of_type(msgs, "status")
        .iter()
        .map(|m| {
            m.content["execution_state"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_one_busy_idle_pair_and_cells_one_count_each() {
    let (_dir, mut fe) = start().await;
    let cases = [
        ("%echo one", json!({}), Some(1)),
        ("%echo two\n%echo three", json!({}), Some(2)),
        ("%echo quiet", json!({"silent": true}), None),
        ("%echo unstored", json!({"store_history": false}), Some(2)),
        ("%echo four", json!({}), Some(3)),
    ];
    for (code, extra, count) in cases {
        let id = fe.execute(code, extra.clone()).await;
        let reply = fe.reply(&id).await;
        let iopub = fe.iopub_until_idle(&id).await;
        assert_eq!(reply.msg_type, "execute_reply");
        assert_eq!(reply.content["status"], "ok", "{code}");
        assert_eq!(states(&iopub), ["busy", "idle"], "{code}: {iopub:?}");
        let inputs = of_type(&iopub, "execute_input");
        let silent = extra["silent"] == true;
        assert_eq!(inputs.len(), usize::from(!silent), "{code}");
        if let Some(count) = count {
            assert_eq!(reply.content["execution_count"], count, "{code}");
        }
        let streams = of_type(&iopub, "stream");
        assert_eq!(
            streams.is_empty(),
            silent,
            "{code}: silent cells show nothing"
        );
    }
    // A request that is not a cell: a pair too, and no execute_input.
    let id = fe.send_shell("kernel_info_request", json!({})).await;
    fe.reply(&id).await;
    assert_eq!(states(&fe.iopub_until_idle(&id).await), ["busy", "idle"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_cell_replies_with_its_error_and_the_next_one_runs() {
    let (_dir, mut fe) = start().await;
    let id = fe.execute("%nosuch", json!({})).await;
    let reply = fe.reply(&id).await;
    assert_eq!(reply.content["status"], "error");
    assert_eq!(reply.content["ename"], "UsageError");
    let iopub = fe.iopub_until_idle(&id).await;
    assert_eq!(of_type(&iopub, "error").len(), 1);
    let id = fe.execute("%echo after", json!({})).await;
    assert_eq!(fe.reply(&id).await.content["execution_count"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_request_is_dropped() {
    let (_dir, mut fe) = start().await;
    let (frames, id) = fe.request(
        "execute_request",
        json!({"code": "%echo once", "silent": false, "store_history": true,
               "user_expressions": {}, "allow_stdin": false}),
    );
    use zeromq::SocketSend;
    fe.shell.send(frames.clone()).await.expect("send");
    assert_eq!(fe.reply(&id).await.content["execution_count"], 1);
    fe.shell.send(frames).await.expect("send again");
    assert!(
        fe.no_reply_within(Duration::from_millis(500)).await,
        "the replay was answered"
    );
    let id = fe.execute("%echo next", json!({})).await;
    assert_eq!(fe.reply(&id).await.content["execution_count"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_announcing_a_huge_frame_is_dropped_and_the_kernel_serves_on() {
    let (dir, mut fe) = start().await;
    let shell = dir.path().join("k-1");
    let mut greeting = vec![0xffu8];
    greeting.extend([0; 8]);
    greeting.extend([0x7f, 3, 0]);
    greeting.extend(b"NULL");
    greeting.extend([0; 16 + 1 + 31]);
    assert_eq!(greeting.len(), 64);
    let mut peer = std::os::unix::net::UnixStream::connect(&shell).expect("connect");
    peer.write_all(&greeting).expect("greeting");
    let mut frame = vec![0x02u8];
    frame.extend((1u64 << 62).to_be_bytes());
    peer.write_all(&frame).expect("frame header");
    peer.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 4096];
    let dropped = loop {
        use std::io::Read;
        match peer.read(&mut buf) {
            Ok(0) | Err(_) => break true,
            Ok(_) => continue, // the kernel's own greeting
        }
    };
    assert!(dropped, "the peer was not disconnected");
    let id = fe.execute("%echo still here", json!({})).await;
    assert_eq!(fe.reply(&id).await.content["status"], "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_on_control_ends_a_running_magic_at_once() {
    let (_dir, mut fe) = start().await;
    let id = fe.execute("%gpumem --watch 0.2", json!({})).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    fe.send_control("interrupt_request", json!({})).await;
    let reply = fe.reply(&id).await;
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(reply.content["status"], "error");
    assert_eq!(reply.content["ename"], "KeyboardInterrupt");
    assert_eq!(states(&fe.iopub_until_idle(&id).await), ["busy", "idle"]);
}
