//! `tunnel down`, `status` and `ls`: act on tunnels started in other terminals
//! through their state files.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::cli::{DownArgs, LsArgs, StatusArgs};
use crate::config::{self, ConfigError, LocalUser, Sources};
use crate::exit::{Exit, HasExit};
use crate::remote::{Event, Launcher, RemoteError};
use crate::route::{self, RouteError};
use crate::state::{self, Phase, ServerRecord, StateError, TunnelState};

/// `down` waits this long for the tunnel to stop its remote server and exit.
const DOWN_TIMEOUT: Duration = Duration::from_secs(40);

#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error("cannot ask the tunnel process {pid} to stop: {source}")]
    Signal { pid: u32, source: std::io::Error },
    #[error("the tunnel to {host} (pid {pid}) did not stop within {}s", DOWN_TIMEOUT.as_secs())]
    Timeout { host: String, pid: u32 },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Route(Box<RouteError>),
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("jupyter on {host} did not confirm it stopped within {}s", DOWN_TIMEOUT.as_secs())]
    RemoteTimeout { host: String },
}

/// Boxed: it is large, and `status`/`ls` return this type too.
impl From<RouteError> for ManageError {
    fn from(e: RouteError) -> Self {
        ManageError::Route(Box::new(e))
    }
}

impl HasExit for ManageError {
    fn exit(&self) -> Exit {
        match self {
            ManageError::State(e) => e.exit(),
            ManageError::Signal { .. } => Exit::Internal,
            ManageError::Timeout { .. } | ManageError::RemoteTimeout { .. } => Exit::Timeout,
            ManageError::Config(e) => e.exit(),
            ManageError::Route(e) => e.exit(),
            ManageError::Remote(e) => e.exit(),
        }
    }
}

pub async fn down(args: DownArgs) -> Result<(), ManageError> {
    let host = args.host.to_ascii_lowercase();
    let stopped_local = stop_local(&host).await?;
    // A server left running by `up --detach` (perhaps by the process just
    // stopped) is stopped over a fresh connection.
    if let Some(rec) = ServerRecord::load(&host)? {
        return stop_detached(&rec).await;
    }
    match stopped_local {
        Local::Stopped => Ok(()),
        Local::None => Err(StateError::NoTunnel { host, stale: false }.into()),
        Local::Dead => Err(StateError::NoTunnel { host, stale: true }.into()),
    }
}

enum Local {
    Stopped,
    None,
    /// Its process had died; its state file is removed.
    Dead,
}

/// Stop the `up` process for `host`, if one runs.
async fn stop_local(host: &str) -> Result<Local, ManageError> {
    let path = state::path_for(&state::dir()?, host);
    let Some(st) = state::read(&path) else {
        return Ok(Local::None);
    };
    if !state::is_alive(st.pid) {
        let _ = std::fs::remove_file(&path);
        return Ok(Local::Dead);
    }
    tracing::info!("stopping the tunnel to {host} (pid {})", st.pid);
    // The `up` process handles this like Ctrl-C (SIGTERM; on Windows a
    // message on its stop pipe): it stops the remote server (or, with
    // --detach, leaves it running), then exits.
    crate::platform::request_stop(st.pid, st.stop_key.as_deref())
        .await
        .map_err(|source| ManageError::Signal {
            pid: st.pid,
            source,
        })?;
    let start = Instant::now();
    while state::is_alive(st.pid) {
        if start.elapsed() > DOWN_TIMEOUT {
            return Err(ManageError::Timeout {
                host: host.to_string(),
                pid: st.pid,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::info!("the tunnel to {host} is down");
    Ok(Local::Stopped)
}

/// Connect as `up` did, reattach to the detached server and stop it.
async fn stop_detached(rec: &ServerRecord) -> Result<(), ManageError> {
    let local = LocalUser::current()?;
    let sources = Sources::new(rec.config.as_deref(), &local.home);
    let ssh_config = config::load(&sources, &local)?;
    let route = config::resolve_route(&ssh_config, &rec.host, &local, rec.jump.as_deref())?;
    let Some(target) = route.last() else {
        return Err(ConfigError::EmptyHost.into());
    };
    tracing::info!(
        "stopping jupyter left running on {} ({}@{})",
        rec.host,
        target.user,
        target.host_name
    );
    let handle = route::open(&route, false).await?;
    let mut launcher = Launcher::attach(&handle, &rec.remote_runtime_dir).await?;
    let deadline = tokio::time::Instant::now() + DOWN_TIMEOUT;
    let mut sent = false;
    loop {
        let ev = match tokio::time::timeout_at(deadline, launcher.events.recv()).await {
            Ok(ev) => ev.unwrap_or(Event::Closed),
            Err(_) => {
                return Err(ManageError::RemoteTimeout {
                    host: rec.host.clone(),
                })
            }
        };
        match ev {
            Event::Ready { .. } if !sent => {
                launcher.send_stop().await.map_err(RemoteError::Channel)?;
                sent = true;
            }
            Event::Stopped => {
                ServerRecord::remove(&rec.host);
                tracing::info!(
                    "stopped jupyter on {} and removed its runtime directory",
                    rec.host
                );
                break;
            }
            Event::Error { kind, message } if kind == "gone" => {
                ServerRecord::remove(&rec.host);
                tracing::info!("jupyter on {} had already stopped ({message})", rec.host);
                break;
            }
            Event::Error { kind, message } => {
                return Err(crate::remote::error_from(&kind, message, Vec::new()).into())
            }
            Event::Closed => {
                return Err(RemoteError::Ended {
                    status: None,
                    log: Vec::new(),
                }
                .into())
            }
            _ => {}
        }
    }
    let _ = handle
        .disconnect(russh::Disconnect::ByApplication, "", "en")
        .await;
    Ok(())
}

#[derive(Serialize)]
struct Shown<'a> {
    /// Without its stop key (Windows): that is for `down` only.
    #[serde(flatten)]
    state: std::borrow::Cow<'a, TunnelState>,
    alive: bool,
    uptime_secs: u64,
    /// Seconds before the SLURM job's time limit (--slurm, once it runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    slurm_time_left_secs: Option<u64>,
}

fn shown(st: &TunnelState) -> Shown<'_> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let state = match st.stop_key {
        None => std::borrow::Cow::Borrowed(st),
        Some(_) => std::borrow::Cow::Owned(TunnelState {
            stop_key: None,
            ..st.clone()
        }),
    };
    Shown {
        state,
        alive: state::is_alive(st.pid),
        uptime_secs: now.saturating_sub(st.started_at),
        slurm_time_left_secs: st
            .slurm
            .as_ref()
            .and_then(|j| j.ends_at)
            .map(|end| end.saturating_sub(now)),
    }
}

fn phase_text(s: &Shown<'_>) -> &'static str {
    match (s.alive, s.state.phase) {
        (false, _) => "dead",
        (true, Phase::Starting) => "starting",
        (true, Phase::Ready) => "ready",
    }
}

/// `job 12 RUNNING on gpu01, time left 1h59m` / `job 12 PENDING (Resources)`.
fn job_text(job: &state::SlurmJob, time_left: Option<u64>) -> String {
    let mut s = format!("job {} {}", job.job_id, job.state);
    if let Some(r) = &job.reason {
        s.push_str(&format!(" ({r})"));
    }
    if let Some(n) = &job.node {
        s.push_str(&format!(" on {n}"));
    }
    if let Some(left) = time_left {
        s.push_str(&format!(
            ", time left {}",
            crate::slurm::duration_text(left)
        ));
    }
    s
}

fn uptime(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Like `println!`, but a closed stdout (`tunnel ls | head -1`) is not a panic.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

fn print_json<T: Serialize>(v: &T) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => out!("{s}"),
        Err(e) => tracing::error!("cannot encode JSON: {e}"),
    }
}

pub fn status(args: StatusArgs) -> Result<(), ManageError> {
    let all = state::list()?;
    let selected: Vec<&TunnelState> = match &args.host {
        Some(h) => {
            let key = state::key(h);
            let found: Vec<&TunnelState> = all
                .iter()
                .map(|(_, s)| s)
                .filter(|s| state::key(&s.host) == key)
                .collect();
            if found.is_empty() {
                return Err(StateError::NoTunnel {
                    host: h.to_ascii_lowercase(),
                    stale: false,
                }
                .into());
            }
            found
        }
        None => all.iter().map(|(_, s)| s).collect(),
    };
    let shown: Vec<Shown<'_>> = selected.into_iter().map(shown).collect();
    if args.json {
        if args.host.is_some() {
            if let Some(one) = shown.first() {
                print_json(one);
            }
        } else {
            print_json(&shown);
        }
        return Ok(());
    }
    if shown.is_empty() {
        out!("no tunnels");
    }
    for s in &shown {
        let st: &TunnelState = &s.state;
        out!(
            "{}: {}, pid {}, up {}",
            st.host,
            phase_text(s),
            st.pid,
            uptime(s.uptime_secs)
        );
        if let Some(url) = &st.url {
            out!("  url:     {url}  (the token is in the URL `tunnel up` printed)");
        }
        out!(
            "  ssh:     {}@{} port {}",
            st.ssh_user,
            st.ssh_host,
            st.ssh_port
        );
        let mut remote = format!("jupyter {}", st.app.subcommand());
        if let Some(p) = st.remote_port {
            remote.push_str(&format!(" on port {p}"));
        }
        if let Some(p) = st.remote_pid {
            remote.push_str(&format!(", pid {p}"));
        }
        if let Some(d) = &st.remote_runtime_dir {
            remote.push_str(&format!(", runtime dir {d}"));
        }
        if st.slurm.as_ref().is_some_and(|j| j.node.is_none()) {
            remote.push_str(" (starts once the job runs)");
        }
        out!("  remote:  {remote}");
        if let Some(job) = &st.slurm {
            out!("  slurm:   {}", job_text(job, s.slurm_time_left_secs));
        }
    }
    Ok(())
}

pub fn ls(args: LsArgs) -> Result<(), ManageError> {
    let all = state::list()?;
    let shown: Vec<Shown<'_>> = all.iter().map(|(_, s)| shown(s)).collect();
    if args.json {
        print_json(&shown);
        return Ok(());
    }
    if shown.is_empty() {
        out!("no tunnels");
        return Ok(());
    }
    out!(
        "{:<24} {:<9} {:>8} {:>8}  URL",
        "HOST",
        "STATE",
        "PID",
        "UP"
    );
    for s in &shown {
        out!(
            "{:<24} {:<9} {:>8} {:>8}  {}",
            s.state.host,
            phase_text(s),
            s.state.pid,
            uptime(s.uptime_secs),
            s.state.url.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uptime_format() {
        assert_eq!(uptime(5), "5s");
        assert_eq!(uptime(65), "1m05s");
        assert_eq!(uptime(3 * 3600 + 120), "3h02m");
    }
}
