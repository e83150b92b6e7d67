//! `tunnel up`: connect, launch Jupyter, forward, report, wait, clean up.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::auth::{self, AuthError};
use crate::browser::{self, RedirectFile};
use crate::cli::UpArgs;
use crate::config::{self, ConfigError, LocalUser, Sources, Target};
use crate::connect::{self, ConnectError, Handle, HostKeyPolicy};
use crate::exit::{Exit, HasExit};
use crate::forward::{self, ForwardError};
use crate::probe::{self, ProbeError};
use crate::remote::{self, Event, LaunchSpec, Launcher, RemoteError};
use crate::signals::Interrupts;
use crate::state::{Phase, StateError, StateFile, TunnelState};
use crate::token::Token;

/// Port Jupyter tries first on the remote (it moves on when taken).
const PORT_HINT: u16 = 8888;
/// How long to wait for the remote to confirm it cleaned up.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Probe(#[from] ProbeError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("interrupted ({0}) before the tunnel was ready")]
    Interrupted(&'static str),
    #[error("timed out after {0}s waiting for Jupyter on the remote to start")]
    Timeout(u64),
    #[error(
        "the SSH connection to {host} was lost; the remote Jupyter stops itself after \
         {linger}s unless a client returns"
    )]
    ConnectionLost { host: String, linger: u64 },
    #[error("Jupyter on {host} stopped unexpectedly (status {status})")]
    JupyterStopped { host: String, status: String },
    #[error(
        "the launcher on {host} ended unexpectedly ({how}); Jupyter may have been killed with it"
    )]
    LauncherEnded { host: String, how: String },
    #[error("cannot generate a token: {0}")]
    Random(getrandom::Error),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

impl HasExit for UpError {
    fn exit(&self) -> Exit {
        match self {
            UpError::Config(e) => e.exit(),
            UpError::Connect(e) => e.exit(),
            UpError::Auth(e) => e.exit(),
            UpError::Remote(e) => e.exit(),
            UpError::Forward(e) => e.exit(),
            UpError::Probe(e) => e.exit(),
            UpError::State(e) => e.exit(),
            UpError::Interrupted(_) => Exit::Interrupted,
            UpError::Timeout(_) => Exit::Timeout,
            UpError::ConnectionLost { .. } => Exit::ConnectionLost,
            UpError::JupyterStopped { .. } | UpError::LauncherEnded { .. } => Exit::JupyterFailed,
            UpError::Random(_) | UpError::Signals(_) => Exit::Internal,
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub async fn run(args: UpArgs) -> Result<(), UpError> {
    let mut signals = Interrupts::install().map_err(UpError::Signals)?;
    let local = LocalUser::current()?;
    let sources = Sources::new(args.config.as_deref(), &local.home);
    let target = config::resolve(&args.host, &sources, &local)?;
    tracing::debug!("resolved {target:?}");
    let token = Token::generate().map_err(UpError::Random)?;

    let mut state = StateFile::claim(TunnelState {
        host: args.host.to_ascii_lowercase(),
        pid: std::process::id(),
        phase: Phase::Starting,
        ssh_user: target.user.clone(),
        ssh_host: target.host_name.clone(),
        ssh_port: target.port,
        app: args.app,
        started_at: now_secs(),
        local_port: None,
        remote_port: None,
        url: None,
        remote_runtime_dir: None,
        remote_pid: None,
    })?;

    // An explicit --port that is busy must fail before anything starts remotely.
    let early_listener = match args.port {
        Some(p) => Some(forward::bind_exact(p).await?),
        None => None,
    };

    let t0 = Instant::now();
    tracing::info!(
        "connecting to {}@{} port {}",
        target.user,
        target.host_name,
        target.port
    );
    let policy = HostKeyPolicy::for_target(&target, args.accept_new);
    let conn = tokio::select! {
        r = connect::connect(&target, policy) => r?,
        sig = signals.recv() => return Err(UpError::Interrupted(sig)),
    };
    tracing::debug!("connected to {}", conn.peer);
    let mut handle = conn.handle;
    tokio::select! {
        r = auth::authenticate(&mut handle, &target) => r?,
        sig = signals.recv() => return Err(UpError::Interrupted(sig)),
    }
    tracing::debug!("authenticated after {:.2}s", t0.elapsed().as_secs_f64());
    let handle = Arc::new(handle);

    let spec = LaunchSpec {
        app: args.app,
        env: args.env.clone(),
        init: args.init.clone(),
        dir: args.dir.clone(),
        port_hint: args.port.unwrap_or(PORT_HINT),
        linger_secs: args.linger,
        timeout_secs: args.timeout,
    };
    tracing::info!(
        "starting jupyter {} on {}",
        args.app.subcommand(),
        target.alias
    );
    let mut launcher = Launcher::start(&handle, &spec, &token).await?;

    let result = serve(
        &args,
        &target,
        &token,
        &handle,
        &mut launcher,
        &mut state,
        early_listener,
        &mut signals,
        t0,
    )
    .await;
    match &result {
        // Nothing is left on the remote when it reported the failure itself
        // (it cleans up before saying "error") or when the link is gone.
        Err(UpError::Remote(_))
        | Err(UpError::ConnectionLost { .. })
        | Err(UpError::LauncherEnded { .. }) => {}
        _ => stop_remote(&mut launcher, &target, &mut signals, args.linger).await,
    }
    let _ = handle
        .disconnect(russh::Disconnect::ByApplication, "", "en")
        .await;
    result
}

/// Everything between "launcher started" and "time to stop".
#[allow(clippy::too_many_arguments)]
async fn serve(
    args: &UpArgs,
    target: &Target,
    token: &Token,
    handle: &Arc<Handle>,
    launcher: &mut Launcher,
    state: &mut StateFile,
    early_listener: Option<tokio::net::TcpListener>,
    signals: &mut Interrupts,
    t0: Instant,
) -> Result<(), UpError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout + 5);
    let (remote_port, base_url) = loop {
        let ev = tokio::select! {
            ev = launcher.events.recv() => ev.unwrap_or(Event::Closed),
            sig = signals.recv() => return Err(UpError::Interrupted(sig)),
            _ = tokio::time::sleep_until(deadline) => return Err(UpError::Timeout(args.timeout)),
        };
        match ev {
            Event::Runtime(d) => {
                tracing::debug!("remote runtime dir {d}");
                state.state.remote_runtime_dir = Some(d);
            }
            Event::Root => {
                tracing::warn!("the remote user is root: starting Jupyter with --allow-root")
            }
            Event::Env(e) => tracing::debug!("remote environment: {e}"),
            Event::Pid(p) => state.state.remote_pid = Some(p),
            Event::Ready { port, base_url } => break (port, base_url),
            Event::Error { kind, message } => {
                let log = collect_log(launcher).await;
                return Err(remote::error_from(&kind, message, log).into());
            }
            Event::Status(status) => {
                let log = collect_log(launcher).await;
                return Err(RemoteError::Ended {
                    status: Some(status),
                    log,
                }
                .into());
            }
            Event::Closed => {
                return Err(RemoteError::Ended {
                    status: None,
                    log: Vec::new(),
                }
                .into())
            }
            Event::Signal(how) => {
                let log = collect_log(launcher).await;
                tracing::debug!("launcher killed by SIG{how}");
                return Err(RemoteError::Ended { status: None, log }.into());
            }
            Event::Exited(_) | Event::Log(_) | Event::Stopped => {}
        }
    };
    tracing::debug!(
        "jupyter listening on remote port {remote_port} after {:.2}s",
        t0.elapsed().as_secs_f64()
    );

    let listener = match early_listener {
        Some(l) => l,
        None => forward::bind_near(remote_port).await?,
    };
    let local_port = listener
        .local_addr()
        .map_err(|source| ForwardError::Listen {
            port: remote_port,
            source,
        })?
        .port();
    let forwarder = forward::serve(listener, handle.clone(), remote_port);
    let _forwarder = AbortOnDrop(forwarder);

    let remaining = deadline
        .saturating_duration_since(tokio::time::Instant::now())
        .max(Duration::from_secs(1));
    tokio::select! {
        r = probe::wait_ready(local_port, &base_url, token, remaining) => r?,
        sig = signals.recv() => return Err(UpError::Interrupted(sig)),
    }

    let base = format!(
        "http://127.0.0.1:{local_port}{base_url}{}",
        args.app.landing_path()
    );
    let url = format!("{base}?token={}", token.expose());
    state.state.phase = Phase::Ready;
    state.state.local_port = Some(local_port);
    state.state.remote_port = Some(remote_port);
    state.state.url = Some(base.clone());
    state.save()?;

    tracing::info!(
        "ready after {:.1}s: {base} (Ctrl-C or `tunnel down {}` to stop)",
        t0.elapsed().as_secs_f64(),
        state.state.host
    );
    // The one line scripts capture.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{url}");
    let _ = out.flush();
    drop(out);

    let _redirect = if args.no_browser {
        None
    } else {
        match RedirectFile::create(state.dir(), &crate::state::key(&state.state.host), &url) {
            Ok(f) => {
                browser::open(f.path());
                Some(f)
            }
            Err(e) => {
                tracing::warn!("cannot write the browser redirect file: {e}");
                None
            }
        }
    };

    // sshd reports how the launcher ended before closing its channel; a
    // channel that closes without that report went down with the connection.
    let mut launcher_end: Option<String> = None;
    loop {
        let ev = tokio::select! {
            ev = launcher.events.recv() => ev.unwrap_or(Event::Closed),
            sig = signals.recv() => {
                tracing::info!("{sig}: stopping jupyter on {}", target.alias);
                return Ok(());
            }
        };
        match ev {
            // File > Shut Down in the Jupyter UI: a normal way to finish.
            Event::Exited(status) if status == "0" => {
                tracing::info!(
                    "jupyter on {} was shut down; closing the tunnel",
                    target.alias
                );
                return Ok(());
            }
            Event::Exited(status) => {
                return Err(UpError::JupyterStopped {
                    host: target.alias.clone(),
                    status,
                })
            }
            Event::Status(s) => launcher_end = Some(format!("exit status {s}")),
            Event::Signal(s) => launcher_end = Some(format!("killed by SIG{s}")),
            Event::Closed => {
                return Err(match launcher_end {
                    Some(how) => UpError::LauncherEnded {
                        host: target.alias.clone(),
                        how,
                    },
                    None => UpError::ConnectionLost {
                        host: target.alias.clone(),
                        linger: args.linger,
                    },
                })
            }
            other => tracing::debug!("remote: {other:?}"),
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// After an `error` line the launcher prints its log tail and exits.
async fn collect_log(launcher: &mut Launcher) -> Vec<String> {
    let mut log = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(deadline, launcher.events.recv()).await {
            Ok(Some(Event::Log(l))) => log.push(l),
            Ok(Some(Event::Closed)) | Ok(None) | Err(_) => return log,
            Ok(Some(_)) => {}
        }
    }
}

/// Ask the remote to stop Jupyter and wait for it to confirm.
async fn stop_remote(
    launcher: &mut Launcher,
    target: &Target,
    signals: &mut Interrupts,
    linger: u64,
) {
    if let Err(e) = launcher.send_stop().await {
        tracing::debug!("cannot send stop: {e}");
        return;
    }
    let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
    loop {
        tokio::select! {
            ev = tokio::time::timeout_at(deadline, launcher.events.recv()) => match ev {
                Ok(Some(Event::Stopped)) => {
                    tracing::info!("stopped jupyter on {} and removed its runtime directory", target.alias);
                    return;
                }
                Ok(Some(Event::Closed)) | Ok(None) => {
                    tracing::debug!("remote session closed while stopping");
                    return;
                }
                Ok(Some(_)) => {}
                Err(_) => {
                    tracing::warn!(
                        "jupyter on {} did not confirm it stopped within {}s; it stops itself after {linger}s",
                        target.alias,
                        STOP_TIMEOUT.as_secs()
                    );
                    return;
                }
            },
            sig = signals.recv() => {
                tracing::warn!("{sig} again: not waiting; jupyter on {} stops itself after {linger}s", target.alias);
                return;
            }
        }
    }
}
