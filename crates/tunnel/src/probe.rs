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
    Timeout { waited: Duration, last: String },
    #[error("Jupyter rejected the token (HTTP {0}); another server may be using the port")]
    Rejected(u16),
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
async fn status_once(port: u16, base_url: &str, token: &Token) -> Result<u16, String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let req = format!(
        "GET {base_url}api/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
         Authorization: token {}\r\nConnection: close\r\n\r\n",
        token.expose()
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    // The status line is all we need.
    while !buf.windows(2).any(|w| w == b"\r\n") {
        let n = s.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed before a response".into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 64 * 1024 {
            return Err("oversized response".into());
        }
    }
    let line = String::from_utf8_lossy(&buf);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP response: {:?}", line.lines().next()))
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
    loop {
        let per_try = timeout
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(1));
        let last = match tokio::time::timeout(per_try, status_once(port, base_url, token)).await {
            Ok(Ok(200)) => return Ok(()),
            Ok(Ok(code @ (401 | 403))) => return Err(ProbeError::Rejected(code)),
            Ok(Ok(code)) => format!("HTTP {code}"),
            Ok(Err(e)) => e,
            Err(_) => "no answer".into(),
        };
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
