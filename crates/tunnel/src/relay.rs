//! One relay for many connections (`tunnel up --slurm` where ssh to the
//! job's node is closed): a single job step on the node (`slurm::relay_wrapper`,
//! a small Python program) carries every forwarded connection over its
//! stdin/stdout, multiplexed, through one exec channel on the login session.
//! A job step and an SSH channel per browser connection cost about 0.3 s
//! each and pile up steps in the job; one relay costs that once.
//!
//! Frames, both ways: a type byte, the connection id (u32, big-endian), the
//! payload length (u32, big-endian), the payload.
//! - `O` (to the relay): connect connection `id` to Jupyter.
//! - `D`: bytes of connection `id`.
//! - `E`: that side will send no more (a half-close, passed on as one).
//! - `C`: connection `id` is gone (closed, reset, or could not connect).
//!
//! The relay starts with the first connection and again after it ended (the
//! step failed, say); its stderr (srun's, Python's) is logged when it ends.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use russh::ChannelMsg;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::connect::Handle;
use crate::remote;

pub const OPEN: u8 = b'O';
pub const DATA: u8 = b'D';
pub const EOF: u8 = b'E';
pub const CLOSE: u8 = b'C';
const HEADER: usize = 9;
/// The most one frame carries; both ends read in chunks of this.
pub const CHUNK: usize = 64 * 1024;
/// A larger length means the stream is not ours (a profile's chatter on
/// stdout, say): the relay is abandoned rather than misread.
const MAX_PAYLOAD: usize = 4 * CHUNK;
/// Frames queued per connection and towards the relay: bounded, so a slow
/// reader pushes back instead of filling memory.
const QUEUE: usize = 64;
/// stderr lines kept for the message when the relay ends.
const STDERR_TAIL: usize = 10;

/// Why one connection through the relay failed (logged, at debug level).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The relay step could not be started over the login session.
    #[error(transparent)]
    Start(russh::Error),
    #[error("the relay has ended")]
    Ended,
    /// The local connection failed.
    #[error(transparent)]
    Local(#[from] std::io::Error),
}

/// One frame, encoded.
pub fn frame(kind: u8, id: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.push(kind);
    f.extend_from_slice(&id.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Splits a byte stream into frames, whatever the chunking.
#[derive(Default)]
pub struct Parser {
    buf: Vec<u8>,
}

impl Parser {
    /// The frames completed by `data`; `Err` on a length no relay sends.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<(u8, u32, Vec<u8>)>, usize> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        let mut at = 0;
        while self.buf.len() - at >= HEADER {
            let h = &self.buf[at..at + HEADER];
            let id = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
            let len = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) as usize;
            if len > MAX_PAYLOAD {
                return Err(len);
            }
            if self.buf.len() - at < HEADER + len {
                break;
            }
            out.push((h[0], id, self.buf[at + HEADER..at + HEADER + len].to_vec()));
            at += HEADER + len;
        }
        self.buf.drain(..at);
        Ok(out)
    }
}

/// What the relay says about one connection.
enum Inbound {
    Data(Vec<u8>),
    Eof,
}

/// The relay for a tunnel: started on first use, restarted after it ended.
#[derive(Debug)]
pub struct Relay {
    /// Run by `/bin/sh` on the login node: starts the relay step.
    script: String,
    current: tokio::sync::Mutex<Option<Arc<Mux>>>,
}

impl Relay {
    pub fn new(script: String) -> Relay {
        Relay {
            script,
            current: tokio::sync::Mutex::new(None),
        }
    }

    /// The running relay, started over `handle` if there is none.
    async fn mux(&self, handle: &Handle) -> Result<Arc<Mux>, russh::Error> {
        let mut current = self.current.lock().await;
        if let Some(m) = current
            .as_ref()
            .filter(|m| !m.ended.load(Ordering::Relaxed))
        {
            return Ok(m.clone());
        }
        let m = Mux::start(handle, &self.script).await?;
        *current = Some(m.clone());
        Ok(m)
    }

    /// Carry one local connection through the relay until both sides closed.
    pub async fn forward(&self, tcp: TcpStream, handle: &Handle) -> Result<(), RelayError> {
        let mux = self.mux(handle).await.map_err(|e| {
            tracing::warn!("cannot start a relay to Jupyter: {e}");
            RelayError::Start(e)
        })?;
        let (id, inbound) = mux.register().ok_or(RelayError::Ended)?;
        let result = mux.carry(id, tcp, inbound).await;
        mux.deregister(id);
        let _ = mux.frames.send(frame(CLOSE, id, &[])).await;
        result
    }
}

/// One running relay step.
#[derive(Debug)]
struct Mux {
    /// Encoded frames towards the relay (one writer keeps them whole).
    frames: mpsc::Sender<Vec<u8>>,
    conns: Mutex<HashMap<u32, mpsc::Sender<Inbound>>>,
    next_id: AtomicU32,
    ended: AtomicBool,
}

impl std::fmt::Debug for Inbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Inbound::Data(d) => write!(f, "Data({} B)", d.len()),
            Inbound::Eof => write!(f, "Eof"),
        }
    }
}

impl Mux {
    async fn start(handle: &Handle, script: &str) -> Result<Arc<Mux>, russh::Error> {
        let channel = handle.channel_open_session().await?;
        channel.exec(true, remote::EXEC_COMMAND).await?;
        let (reader, writer) = channel.split();
        writer.data(remote::escape_line(script).as_bytes()).await?;
        let (frames, mut outgoing) = mpsc::channel::<Vec<u8>>(QUEUE);
        let mux = Arc::new(Mux {
            frames,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(1),
            ended: AtomicBool::new(false),
        });
        tracing::debug!("relay step started");
        let w = mux.clone();
        tokio::spawn(async move {
            while let Some(f) = outgoing.recv().await {
                if let Err(e) = writer.data(&f[..]).await {
                    tracing::debug!("relay: cannot write: {e}");
                    break;
                }
            }
            w.end();
        });
        tokio::spawn(mux.clone().read(reader));
        Ok(mux)
    }

    /// Dispatch the relay's frames to their connections until it ends.
    async fn read(self: Arc<Self>, mut reader: russh::ChannelReadHalf) {
        let mut parser = Parser::default();
        let mut stderr: VecDeque<String> = VecDeque::new();
        let mut status = None;
        while let Some(msg) = reader.wait().await {
            match msg {
                ChannelMsg::Data { data } => match parser.feed(&data) {
                    Ok(frames) => {
                        for (kind, id, payload) in frames {
                            self.dispatch(kind, id, payload).await;
                        }
                    }
                    Err(len) => {
                        tracing::warn!("the relay sent a frame of {len} bytes: not a relay");
                        break;
                    }
                },
                ChannelMsg::ExtendedData { data, .. } => {
                    for line in String::from_utf8_lossy(&data).lines() {
                        tracing::debug!("relay stderr: {line}");
                        if stderr.len() == STDERR_TAIL {
                            stderr.pop_front();
                        }
                        stderr.push_back(line.to_string());
                    }
                }
                ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
                ChannelMsg::Close => break,
                _ => {}
            }
        }
        self.end();
        if status.is_some_and(|s| s != 0) || !stderr.is_empty() {
            let said: Vec<String> = stderr.into_iter().collect();
            tracing::warn!(
                "the relay step ended (exit status {}){}{}",
                status.map_or("unknown".into(), |s| s.to_string()),
                if said.is_empty() { "" } else { ":\n  " },
                said.join("\n  ")
            );
        } else {
            tracing::debug!("relay step ended");
        }
    }

    async fn dispatch(&self, kind: u8, id: u32, payload: Vec<u8>) {
        let inbound = match kind {
            DATA => Inbound::Data(payload),
            EOF => Inbound::Eof,
            // Dropping the sender ends the connection.
            CLOSE => {
                self.deregister(id);
                return;
            }
            other => {
                tracing::debug!("relay: unknown frame {other:#x} for connection {id}");
                return;
            }
        };
        let sender = self.conns.lock().ok().and_then(|c| c.get(&id).cloned());
        if let Some(s) = sender {
            let _ = s.send(inbound).await;
        }
    }

    /// The relay is gone: every connection it carried ends.
    fn end(&self) {
        self.ended.store(true, Ordering::Relaxed);
        if let Ok(mut c) = self.conns.lock() {
            c.clear();
        }
    }

    fn register(&self) -> Option<(u32, mpsc::Receiver<Inbound>)> {
        if self.ended.load(Ordering::Relaxed) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(QUEUE);
        self.conns.lock().ok()?.insert(id, tx);
        Some((id, rx))
    }

    fn deregister(&self, id: u32) {
        if let Ok(mut c) = self.conns.lock() {
            c.remove(&id);
        }
    }

    /// Copy both ways between `tcp` and the relay's connection `id`,
    /// passing half-closes on, until both sides are done or either is gone.
    async fn carry(
        &self,
        id: u32,
        tcp: TcpStream,
        mut inbound: mpsc::Receiver<Inbound>,
    ) -> Result<(), RelayError> {
        let gone = |_| RelayError::Ended;
        self.frames.send(frame(OPEN, id, &[])).await.map_err(gone)?;
        let (mut rd, mut wr) = tcp.into_split();
        let mut buf = vec![0u8; CHUNK];
        let (mut up_done, mut down_done) = (false, false);
        while !(up_done && down_done) {
            tokio::select! {
                n = rd.read(&mut buf), if !up_done => match n {
                    Ok(0) => {
                        up_done = true;
                        self.frames.send(frame(EOF, id, &[])).await.map_err(gone)?;
                    }
                    Ok(n) => self.frames.send(frame(DATA, id, &buf[..n])).await.map_err(gone)?,
                    Err(e) => return Err(e.into()),
                },
                msg = inbound.recv(), if !down_done => match msg {
                    Some(Inbound::Data(d)) => wr.write_all(&d).await?,
                    Some(Inbound::Eof) => {
                        down_done = true;
                        let _ = wr.shutdown().await;
                    }
                    None => return Ok(()), // closed by Jupyter's side, or the relay ended
                },
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(unix)]
    use std::process::Stdio;
    #[cfg(unix)]
    use tokio::net::TcpListener;

    /// The real relay program (`slurm::RELAY_PY`) under a local python3,
    /// against a stand-in for Jupyter that answers each connection's whole
    /// request, upper-cased, after the client's half-close.
    // Runs the node's end (python3 on a Linux node) locally.
    #[cfg(unix)]
    #[tokio::test]
    async fn the_python_relay_speaks_these_frames() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut req = Vec::new();
                    let _ = s.read_to_end(&mut req).await;
                    let _ = s.write_all(&req.to_ascii_uppercase()).await;
                });
            }
        });
        let mut child = tokio::process::Command::new("python3")
            .args(["-c", crate::slurm::RELAY_PY, &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs");
        let mut stdin = child.stdin.take().expect("stdin");
        let mut stdout = child.stdout.take().expect("stdout");
        let big = vec![b'x'; 3 * CHUNK + 5];
        let mut out = Vec::new();
        for (id, body) in [(1u32, &b"hello"[..]), (2, &big[..])] {
            out.extend(frame(OPEN, id, &[]));
            for c in body.chunks(CHUNK) {
                out.extend(frame(DATA, id, c));
            }
            out.extend(frame(DATA, 99, b"for nobody")); // unknown: ignored
            out.extend(frame(EOF, id, &[]));
        }
        stdin.write_all(&out).await.expect("write");
        let mut parser = Parser::default();
        let mut got: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut ended = Vec::new();
        let mut buf = vec![0u8; CHUNK];
        while ended.len() < 2 {
            let n = tokio::time::timeout(std::time::Duration::from_secs(20), stdout.read(&mut buf))
                .await
                .expect("the relay answers")
                .expect("read");
            assert!(n > 0, "the relay exited early");
            for (kind, id, payload) in parser.feed(&buf[..n]).expect("frames") {
                match kind {
                    DATA => got.entry(id).or_default().extend(payload),
                    EOF => ended.push(id),
                    other => panic!("unexpected frame {other} for {id}"),
                }
            }
        }
        assert_eq!(got[&1], b"HELLO");
        assert_eq!(got[&2], big.to_ascii_uppercase());
        stdin
            .write_all(&[frame(CLOSE, 1, &[]), frame(CLOSE, 2, &[])].concat())
            .await
            .expect("write");
        drop(stdin); // the tunnel is gone: the relay ends
        let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
            .await
            .expect("exits")
            .expect("status");
        assert!(status.success(), "{status:?}");
    }

    #[test]
    fn frames_round_trip_whatever_the_chunking() {
        let mut stream = frame(OPEN, 1, &[]);
        stream.extend(frame(DATA, 7, b"hello"));
        stream.extend(frame(EOF, u32::MAX, &[]));
        let big = vec![0xabu8; CHUNK];
        stream.extend(frame(DATA, 2, &big));
        for step in [1, 2, 8, 9, 10, 1000, stream.len()] {
            let mut p = Parser::default();
            let mut got = Vec::new();
            for chunk in stream.chunks(step) {
                got.extend(p.feed(chunk).expect("valid frames"));
            }
            assert_eq!(
                got,
                vec![
                    (OPEN, 1, vec![]),
                    (DATA, 7, b"hello".to_vec()),
                    (EOF, u32::MAX, vec![]),
                    (DATA, 2, big.clone()),
                ],
                "chunks of {step}"
            );
        }
        // Text on the stream (a login profile's banner) is not a frame.
        let mut p = Parser::default();
        assert!(p.feed(b"Welcome to the cluster!\n").is_err());
    }
}
