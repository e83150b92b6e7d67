//! The remote launcher as every flow of `up` uses it: wait for `ready`,
//! reattach, stop.

use std::time::Duration;

use super::{interruptible, UpError};
use crate::cli::UpArgs;
use crate::config::Target;
use crate::connect::Handle;
use crate::platform::Interrupts;
use crate::remote::{self, Event, LaunchSpec, Launcher, RemoteError};
use crate::state::StateFile;
use crate::token::Token;

/// Port Jupyter tries first on the remote (it moves on when taken).
const PORT_HINT: u16 = 8888;
/// How long to wait for the remote to confirm it cleaned up.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// A reattach answers in well under this (it only reads a few files).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(20);
/// After an `error` event, how long the launcher's log tail may take.
const LOG_GRACE: Duration = Duration::from_secs(5);

/// What `up` is attached to on the remote.
pub(super) struct Remote {
    pub launcher: Launcher,
    pub token: Token,
    pub runtime_dir: Option<String>,
    pub port: u16,
    pub base_url: String,
}

impl Remote {
    /// Wait for `launcher` (just started, or reattached) to report Jupyter
    /// ready; the server it runs, which `token` opens.
    pub async fn ready(
        mut launcher: Launcher,
        token: Token,
        state: &mut StateFile,
        signals: &mut Interrupts,
        deadline: tokio::time::Instant,
        timeout_secs: u64,
    ) -> Result<Remote, UpError> {
        let (port, base_url) =
            wait_ready(&mut launcher, state, signals, deadline, timeout_secs).await?;
        Ok(Remote {
            launcher,
            token,
            runtime_dir: state.state.remote_runtime_dir.clone(),
            port,
            base_url,
        })
    }
}

/// What the launcher is asked to start, from the command line (`slurm`: the
/// step key when Jupyter runs as a job step).
pub(super) fn launch_spec(args: &UpArgs, slurm: Option<String>) -> LaunchSpec {
    LaunchSpec {
        app: args.app,
        env: args.remote.env.clone(),
        init: args.remote.init.clone(),
        dir: args.dir.clone(),
        port_hint: args.port.unwrap_or(PORT_HINT),
        linger_secs: args.linger,
        timeout_secs: args.timeout,
        slurm,
    }
}

/// Attach to a lingering (or detached) server and wait for its `ready`.
pub(super) async fn reattach(
    handle: &Handle,
    runtime_dir: &str,
    token: Token,
    state: &mut StateFile,
    signals: &mut Interrupts,
) -> Result<Remote, UpError> {
    let launcher = Launcher::attach(handle, runtime_dir).await?;
    state.state.remote_runtime_dir = Some(runtime_dir.to_string());
    let deadline = tokio::time::Instant::now() + ATTACH_TIMEOUT;
    Remote::ready(
        launcher,
        token,
        state,
        signals,
        deadline,
        ATTACH_TIMEOUT.as_secs(),
    )
    .await
}

/// How far the remote got when `up` timed out: what the timeout's message points to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stalled {
    /// Nothing came back: the shell sshd started never ran tunnel's launcher.
    BeforeLauncher,
    /// The launcher ran; the login shell it starts, --init, --env or Jupyter's start did not
    /// finish (Jupyter's own start is bounded on the remote too, whose error names it).
    InSetup,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stalled::BeforeLauncher => {
                "the remote shell never ran tunnel's launcher, so a command in its startup \
                 files (~/.bashrc for bash) may be waiting for input or for a lock (a stale \
                 lock of `pyenv rehash` waits 60s); `tunnel doctor` shows how far a login gets"
            }
            Stalled::InSetup => {
                "the launcher ran, but its login shell's startup files (~/.profile, \
                 ~/.bash_profile), --init, --env or Jupyter's start did not finish; `tunnel \
                 doctor` checks each step before Jupyter, and a slow start needs a larger \
                 --timeout"
            }
        })
    }
}

/// Read launcher events until Jupyter is ready; the port and base URL.
async fn wait_ready(
    launcher: &mut Launcher,
    state: &mut StateFile,
    signals: &mut Interrupts,
    deadline: tokio::time::Instant,
    timeout_secs: u64,
) -> Result<(u16, String), UpError> {
    let mut stalled = Stalled::BeforeLauncher;
    loop {
        let ev = tokio::select! {
            ev = launcher.events.recv() => ev.unwrap_or(Event::Closed),
            sig = signals.recv() => return Err(UpError::Interrupted(sig)),
            _ = tokio::time::sleep_until(deadline) => {
                return Err(UpError::Timeout { secs: timeout_secs, stalled })
            }
        };
        match ev {
            Event::Runtime(d) => {
                tracing::debug!("remote runtime dir {d}");
                state.state.remote_runtime_dir = Some(d);
                stalled = Stalled::InSetup;
            }
            Event::Root => {
                tracing::warn!("the remote user is root: starting Jupyter with --allow-root")
            }
            Event::Env(e) => tracing::debug!("remote environment: {e}"),
            Event::Pid(p) => state.state.remote_pid = Some(p),
            Event::Ready { port, base_url } => return Ok((port, base_url)),
            Event::Exited(_) | Event::Log(_) | Event::Stopped | Event::Kept | Event::Check(_) => {}
            ended => return Err(launcher_failed(launcher, ended).await),
        }
    }
}

/// Why the launcher ended before `ready`: its `error`, or how it died, with
/// the log lines that came with it.
async fn launcher_failed(launcher: &mut Launcher, ev: Event) -> UpError {
    match ev {
        Event::Error { kind, message } => {
            let log = collect_log(launcher).await;
            remote::error_from(&kind, message, log).into()
        }
        Event::Status(status) => {
            let mut log = collect_log(launcher).await;
            if log.is_empty() {
                // Failed before the launcher ran (srun's own error, say).
                log = launcher.stderr_tail();
            }
            RemoteError::Ended {
                status: Some(status),
                log,
            }
            .into()
        }
        Event::Signal(how) => {
            let log = collect_log(launcher).await;
            tracing::debug!("launcher killed by SIG{how}");
            RemoteError::Ended { status: None, log }.into()
        }
        _ => RemoteError::Ended {
            status: None,
            log: launcher.stderr_tail(),
        }
        .into(),
    }
}

/// After an `error` line the launcher prints its log tail and exits.
async fn collect_log(launcher: &mut Launcher) -> Vec<String> {
    let mut log = Vec::new();
    let deadline = tokio::time::Instant::now() + LOG_GRACE;
    loop {
        match tokio::time::timeout_at(deadline, launcher.events.recv()).await {
            Ok(Some(Event::Log(l))) => log.push(l),
            Ok(Some(Event::Closed)) | Ok(None) | Err(_) => return log,
            Ok(Some(_)) => {}
        }
    }
}

/// Ask the remote to stop Jupyter and wait for it to confirm.
pub(super) async fn stop_remote(
    launcher: &mut Launcher,
    target: &Target,
    signals: &mut Interrupts,
    linger: u64,
) {
    if let Err(e) = launcher.send_stop().await {
        tracing::debug!("cannot send stop: {e}");
        return;
    }
    let host = &target.alias;
    let confirmed = async {
        loop {
            match launcher.events.recv().await {
                Some(Event::Stopped) => return true,
                Some(Event::Closed) | None => return false,
                Some(_) => {}
            }
        }
    };
    match interruptible(signals, tokio::time::timeout(STOP_TIMEOUT, confirmed)).await {
        Ok(Ok(true)) => {
            tracing::info!("stopped jupyter on {host} and removed its runtime directory")
        }
        Ok(Ok(false)) => tracing::debug!("remote session closed while stopping"),
        Ok(Err(_)) => tracing::warn!(
            "jupyter on {host} did not confirm it stopped within {}s; it stops itself after \
             {linger}s",
            STOP_TIMEOUT.as_secs()
        ),
        Err(e) => {
            let sig = match e {
                UpError::Interrupted(sig) => sig,
                _ => "a signal",
            };
            tracing::warn!(
                "{sig} again: not waiting; jupyter on {host} stops itself after {linger}s"
            )
        }
    }
}
