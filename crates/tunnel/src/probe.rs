//! Readiness check: `GET /api/status` with the token, through the forward,
//! so "ready" means the whole path (listener, SSH channel, Jupyter) works.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::exit::{Exit, HasExit};
use crate::token::Token;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("Jupyter did not answer /api/status through the tunnel within {}s (last: {last})", waited.as_secs())]
    Timeout { waited: Duration, last: LastTry },
    #[error("Jupyter rejected the token (HTTP {0}); another server may be using the port")]
    Rejected(u16),
}

/// What the last try got, for the timeout's message.
#[derive(Debug, thiserror::Error)]
pub enum LastTry {
    /// An answer other than 200, 401 or 403.
    #[error("HTTP {0}")]
    Status(u16),
    #[error(transparent)]
    Failed(#[from] StatusError),
    #[error("no answer")]
    NoAnswer,
}

/// Why one `/api/status` request got no status code.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("connection closed before a response")]
    Closed,
    #[error("oversized response")]
    Oversized,
    /// The first line of what came back (quoted, so control bytes show escaped).
    #[error("not an HTTP response: {0:?}")]
    NotHttp(String),
}

impl HasExit for ProbeError {
    fn exit(&self) -> Exit {
        match self {
            ProbeError::Timeout { .. } => Exit::Timeout,
            ProbeError::Rejected(_) => Exit::JupyterFailed,
        }
    }
}

/// One request; returns the HTTP status code.
async fn status_once(port: u16, base_url: &str, token: &Token) -> Result<u16, StatusError> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    let req = format!(
        "GET {base_url}api/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
         Authorization: token {}\r\nConnection: close\r\n\r\n",
        token.expose()
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    // The status line is all we need.
    while !buf.windows(2).any(|w| w == b"\r\n") {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(StatusError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 64 * 1024 {
            return Err(StatusError::Oversized);
        }
    }
    let line = String::from_utf8_lossy(&buf);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| StatusError::NotHttp(line.lines().next().unwrap_or_default().to_string()))
}

/// Poll until HTTP 200, a rejection, or `timeout`.
pub async fn wait_ready(
    port: u16,
    base_url: &str,
    token: &Token,
    timeout: Duration,
) -> Result<(), ProbeError> {
    let start = Instant::now();
    let mut delay = Duration::from_millis(20);
    let mut last = LastTry::NoAnswer;
    loop {
        let per_try = timeout
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(1));
        match tokio::time::timeout(per_try, status_once(port, base_url, token)).await {
            Ok(Ok(200)) => return Ok(()),
            Ok(Ok(code @ (401 | 403))) => return Err(ProbeError::Rejected(code)),
            Ok(Ok(code)) => last = LastTry::Status(code),
            Ok(Err(e)) => last = e.into(),
            // A try is only cut off by the overall deadline, often with a
            // millisecond left on a slow machine: keep what the previous
            // try got, which says more than "no answer".
            Err(_) => {}
        }
        tracing::debug!("/api/status: {last}");
        if start.elapsed() >= timeout {
            return Err(ProbeError::Timeout {
                waited: timeout,
                last,
            });
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(250));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// The timeout says what the last try got. (A second, so that a loaded
    /// machine still completes a try: CI under Wine once had only one.)
    #[tokio::test]
    async fn the_timeout_says_what_came_back() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let _ = s.write_all(b"garbage\r\n").await;
            }
        });
        let token = Token::from_saved("t".into());
        let err = wait_ready(port, "/", &token, Duration::from_millis(1000))
            .await
            .expect_err("not Jupyter");
        assert_eq!(
            err.to_string(),
            "Jupyter did not answer /api/status through the tunnel within 1s \
             (last: not an HTTP response: \"garbage\")"
        );
        assert_eq!(LastTry::Status(502).to_string(), "HTTP 502");
        assert_eq!(LastTry::NoAnswer.to_string(), "no answer");
    }

    /// A server on loopback that answers its first connection with `first`
    /// (if any) and holds every connection open without another word.
    async fn answer_once_then_hold(first: Option<&'static [u8]>) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            let mut first = first;
            while let Ok((mut s, _)) = listener.accept().await {
                if let Some(bytes) = first.take() {
                    let _ = s.write_all(bytes).await;
                }
                held.push(s);
            }
        });
        port
    }

    /// A try cut off by the deadline does not hide what an earlier try got
    /// (on a slow machine the last try may have a millisecond left).
    #[tokio::test]
    async fn a_try_cut_off_by_the_deadline_keeps_the_earlier_answer() {
        let port = answer_once_then_hold(Some(b"garbage\r\n")).await;
        let token = Token::from_saved("t".into());
        let err = wait_ready(port, "/", &token, Duration::from_millis(1000))
            .await
            .expect_err("not Jupyter");
        assert!(
            err.to_string()
                .ends_with("(last: not an HTTP response: \"garbage\")"),
            "{err}"
        );
    }

    /// A server that accepts and never answers is "no answer".
    #[tokio::test]
    async fn silence_is_no_answer() {
        let port = answer_once_then_hold(None).await;
        let token = Token::from_saved("t".into());
        let err = wait_ready(port, "/", &token, Duration::from_millis(200))
            .await
            .expect_err("silent");
        assert!(err.to_string().ends_with("(last: no answer)"), "{err}");
    }

    #[test]
    fn last_try_texts() {
        assert_eq!(
            LastTry::from(StatusError::Closed).to_string(),
            "connection closed before a response"
        );
    }
}
