//! `tunnel up`: connect, launch Jupyter, forward, report, wait, clean up.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::auth::AuthError;
use crate::browser::{self, RedirectFile};
use crate::cli::UpArgs;
use crate::config::{self, ConfigError, LocalUser, Sources, Target};
use crate::connect::{ConnectError, Handle};
use crate::exit::{Exit, HasExit};
use crate::forward::{self, ForwardError};
use crate::probe::{self, ProbeError};
use crate::remote::{self, Event, LaunchSpec, Launcher, RemoteError};
use crate::route::{self, RouteError};
use crate::signals::Interrupts;
use crate::slurm::{self, SlurmError, Waited};
use crate::state::{Phase, ServerRecord, SlurmJob, StateError, StateFile, TunnelState};
use crate::token::Token;
use tokio::sync::watch;

/// Port Jupyter tries first on the remote (it moves on when taken).
const PORT_HINT: u16 = 8888;
/// How long to wait for the remote to confirm it cleaned up.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// Reconnect backoff: first retry after this, doubling up to the cap.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_CAP: Duration = Duration::from_secs(4);
/// A reattach answers in well under this (it only reads a few files).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Probe(#[from] ProbeError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Slurm(#[from] SlurmError),
    #[error("interrupted ({0}) before the tunnel was ready")]
    Interrupted(&'static str),
    #[error("timed out after {0}s waiting for Jupyter on the remote to start")]
    Timeout(u64),
    #[error(
        "the SSH connection to {host} was lost and could not be restored within {linger}s \
         ({last}); the remote Jupyter stops itself once nobody returns within {linger}s"
    )]
    ConnectionLost {
        host: String,
        linger: u64,
        last: String,
    },
    #[error("reconnected to {host}, but its Jupyter server is gone: {why}")]
    ServerGone { host: String, why: String },
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
            UpError::Route(e) => e.exit(),
            UpError::Remote(e) => e.exit(),
            UpError::Forward(e) => e.exit(),
            UpError::Probe(e) => e.exit(),
            UpError::State(e) => e.exit(),
            UpError::Slurm(e) => e.exit(),
            UpError::Interrupted(_) => Exit::Interrupted,
            UpError::Timeout(_) => Exit::Timeout,
            UpError::ConnectionLost { .. } => Exit::ConnectionLost,
            UpError::JupyterStopped { .. }
            | UpError::LauncherEnded { .. }
            | UpError::ServerGone { .. } => Exit::JupyterFailed,
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

/// Connect along the route (jump hosts, then the target), checking each
/// host key and authenticating at each hop; Ctrl-C aborts.
async fn open_session(
    route: &[Target],
    accept_new: bool,
    signals: &mut Interrupts,
) -> Result<Arc<Handle>, UpError> {
    let handle = tokio::select! {
        r = route::open(route, accept_new) => r?,
        sig = signals.recv() => return Err(UpError::Interrupted(sig)),
    };
    Ok(Arc::new(handle))
}

/// What `up` is attached to on the remote.
struct Remote {
    launcher: Launcher,
    token: Token,
    runtime_dir: Option<String>,
    port: u16,
    base_url: String,
}

/// What the launcher is asked to start, from the command line (`slurm`: the step key when
/// Jupyter runs as a job step).
fn launch_spec(args: &UpArgs, slurm: Option<String>) -> LaunchSpec {
    LaunchSpec {
        app: args.app,
        env: args.env.clone(),
        init: args.init.clone(),
        dir: args.dir.clone(),
        port_hint: args.port.unwrap_or(PORT_HINT),
        linger_secs: args.linger,
        timeout_secs: args.timeout,
        slurm,
    }
}

pub async fn run(args: UpArgs) -> Result<(), UpError> {
    let mut signals = Interrupts::install().map_err(UpError::Signals)?;
    let local = LocalUser::current()?;
    let sources = Sources::new(args.config.as_deref(), &local.home);
    let ssh_config = config::load(&sources, &local)?;
    let route = config::resolve_route(&ssh_config, &args.host, &local, args.jump.as_deref())?;
    let Some(target) = route.last().cloned() else {
        return Err(ConfigError::EmptyHost.into());
    };
    tracing::debug!("resolved {route:?}");
    let host_key = args.host.to_ascii_lowercase();
    // Bad quoting in --slurm is a usage error: found before connecting.
    let sbatch = args.slurm.as_deref().map(slurm::sbatch_args).transpose()?;

    let mut state = StateFile::claim(TunnelState {
        host: host_key.clone(),
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
        slurm: None,
    })?;
    // Claimed: no other `up` for this host runs, so the record is ours. A
    // job step is never detached, so --slurm never reattaches.
    let detached = match sbatch {
        Some(_) => None,
        None => ServerRecord::load(&host_key)?,
    };

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
    for hop in &route[..route.len() - 1] {
        tracing::info!(
            "  via jump host {}@{} port {}",
            hop.user,
            hop.host_name,
            hop.port
        );
    }
    let handle = open_session(&route, args.accept_new, &mut signals).await?;
    tracing::debug!("authenticated after {:.2}s", t0.elapsed().as_secs_f64());

    if let Some(sbatch) = sbatch {
        let cx = JobContext {
            args: &args,
            target: &target,
            route: &route,
            ssh_config: &ssh_config,
            local: &local,
            login: handle,
        };
        return slurm_up(&cx, &sbatch, &mut state, early_listener, &mut signals, t0).await;
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout + 5);
    let mut remote = None;
    if let Some(rec) = detached {
        match reattach(&handle, &rec.remote_runtime_dir, &mut state, &mut signals).await {
            Ok((launcher, port, base_url)) => {
                tracing::info!(
                    "reattached to the jupyter server left running on {} (remote pid {})",
                    target.alias,
                    state.state.remote_pid.unwrap_or_default()
                );
                remote = Some(Remote {
                    launcher,
                    token: Token::from_saved(rec.token),
                    runtime_dir: Some(rec.remote_runtime_dir),
                    port,
                    base_url,
                });
            }
            Err(UpError::Remote(RemoteError::Gone { message })) => {
                tracing::warn!(
                    "the server left running on {} is gone ({message}); starting a new one",
                    target.alias
                );
                ServerRecord::remove(&host_key);
            }
            Err(e) => return Err(e),
        }
    }
    let mut remote = match remote {
        Some(r) => r,
        None => {
            let token = Token::generate().map_err(UpError::Random)?;
            let spec = launch_spec(&args, None);
            tracing::info!(
                "starting jupyter {} on {}",
                args.app.subcommand(),
                target.alias
            );
            let mut launcher = Launcher::start(&handle, &spec, &token).await?;
            let (port, base_url) = wait_ready(
                &mut launcher,
                &mut state,
                &mut signals,
                deadline,
                args.timeout,
            )
            .await?;
            Remote {
                launcher,
                token,
                runtime_dir: state.state.remote_runtime_dir.clone(),
                port,
                base_url,
            }
        }
    };

    let (session_tx, session_rx) = watch::channel(Some(handle.clone()));
    let mut link = Link {
        args: &args,
        target: &target,
        route: &route,
        handle,
        session: session_tx,
        job: None,
    };
    let result = serve(
        &mut link,
        &mut remote,
        session_rx,
        &mut state,
        early_listener,
        &mut signals,
        deadline,
        t0,
    )
    .await;
    let handle = link.handle.clone();
    let outcome = match result {
        Ok(Finish::Detach) => {
            tracing::info!(
                "left jupyter running on {}: `tunnel up {}` reattaches, `tunnel down {}` stops it",
                target.alias,
                args.host,
                args.host
            );
            remote.launcher.close().await;
            Ok(())
        }
        Ok(Finish::Stop) => {
            stop_remote(&mut remote.launcher, &target, &mut signals, args.linger).await;
            ServerRecord::remove(&host_key);
            Ok(())
        }
        // Nothing is left on the remote when it reported the failure itself
        // (it cleans up before saying "error") or when the link is gone.
        Err(
            e @ (UpError::Remote(_)
            | UpError::ConnectionLost { .. }
            | UpError::LauncherEnded { .. }
            | UpError::ServerGone { .. }),
        ) => Err(e),
        Err(e) => {
            stop_remote(&mut remote.launcher, &target, &mut signals, args.linger).await;
            Err(e)
        }
    };
    let _ = handle
        .disconnect(russh::Disconnect::ByApplication, "", "en")
        .await;
    outcome
}

/// The SSH side of a running tunnel, re-established after a drop.
struct Link<'a> {
    args: &'a UpArgs,
    target: &'a Target,
    /// Jump hosts, then the target.
    route: &'a [Target],
    handle: Arc<Handle>,
    /// Publishes the current session to the forwarder.
    session: watch::Sender<Option<Arc<Handle>>>,
    /// With --slurm: how the forwards reach Jupyter in the job. Any loss
    /// ends the tunnel: a job step cannot be reattached.
    job: Option<JobLink>,
}

/// The way to Jupyter in a SLURM job (`up --slurm`).
struct JobLink {
    /// The session with the job's node, which carries the forwards (the
    /// login session carries the launcher); `None` when ssh to the node is
    /// closed and each connection goes through a relay job step instead.
    node: Option<Arc<Handle>>,
    way: forward::Way,
}

/// How a ready tunnel ends without an error.
enum Finish {
    /// Stop the remote server.
    Stop,
    /// Leave it running (--detach).
    Detach,
}

/// Attach to a lingering (or detached) server and wait for its `ready`.
async fn reattach(
    handle: &Handle,
    runtime_dir: &str,
    state: &mut StateFile,
    signals: &mut Interrupts,
) -> Result<(Launcher, u16, String), UpError> {
    let mut launcher = Launcher::attach(handle, runtime_dir).await?;
    state.state.remote_runtime_dir = Some(runtime_dir.to_string());
    let deadline = tokio::time::Instant::now() + ATTACH_TIMEOUT;
    let (port, base) = wait_ready(
        &mut launcher,
        state,
        signals,
        deadline,
        ATTACH_TIMEOUT.as_secs(),
    )
    .await?;
    Ok((launcher, port, base))
}

/// Read launcher events until Jupyter is ready; the port and base URL.
async fn wait_ready(
    launcher: &mut Launcher,
    state: &mut StateFile,
    signals: &mut Interrupts,
    deadline: tokio::time::Instant,
    timeout_secs: u64,
) -> Result<(u16, String), UpError> {
    loop {
        let ev = tokio::select! {
            ev = launcher.events.recv() => ev.unwrap_or(Event::Closed),
            sig = signals.recv() => return Err(UpError::Interrupted(sig)),
            _ = tokio::time::sleep_until(deadline) => return Err(UpError::Timeout(timeout_secs)),
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
            Event::Ready { port, base_url } => return Ok((port, base_url)),
            Event::Error { kind, message } => {
                let log = collect_log(launcher).await;
                return Err(remote::error_from(&kind, message, log).into());
            }
            Event::Status(status) => {
                let mut log = collect_log(launcher).await;
                if log.is_empty() {
                    // Failed before the launcher ran (srun's own error, say).
                    log = launcher.stderr_tail();
                }
                return Err(RemoteError::Ended {
                    status: Some(status),
                    log,
                }
                .into());
            }
            Event::Closed => {
                return Err(RemoteError::Ended {
                    status: None,
                    log: launcher.stderr_tail(),
                }
                .into())
            }
            Event::Signal(how) => {
                let log = collect_log(launcher).await;
                tracing::debug!("launcher killed by SIG{how}");
                return Err(RemoteError::Ended { status: None, log }.into());
            }
            Event::Exited(_) | Event::Log(_) | Event::Stopped | Event::Kept | Event::Check(_) => {}
        }
    }
}

/// Everything between "Jupyter is ready" and "time to stop".
#[allow(clippy::too_many_arguments)]
async fn serve(
    link: &mut Link<'_>,
    remote: &mut Remote,
    session: forward::Session,
    state: &mut StateFile,
    early_listener: Option<tokio::net::TcpListener>,
    signals: &mut Interrupts,
    deadline: tokio::time::Instant,
    t0: Instant,
) -> Result<Finish, UpError> {
    let args = link.args;
    let target = link.target;
    let remote_port = remote.port;
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
    let way = match &link.job {
        Some(job) => job.way.clone(),
        None => forward::Way::Direct(remote_port),
    };
    let forwarder = forward::serve(listener, session, way);
    let _forwarder = AbortOnDrop(forwarder);

    let remaining = deadline
        .saturating_duration_since(tokio::time::Instant::now())
        .max(Duration::from_secs(1));
    tokio::select! {
        r = probe::wait_ready(local_port, &remote.base_url, &remote.token, remaining) => r?,
        sig = signals.recv() => return Err(UpError::Interrupted(sig)),
    }

    let base = format!(
        "http://127.0.0.1:{local_port}{}{}",
        remote.base_url,
        args.app.landing_path()
    );
    let url = format!("{base}?token={}", remote.token.expose());
    state.state.phase = Phase::Ready;
    state.state.local_port = Some(local_port);
    state.state.remote_port = Some(remote_port);
    state.state.url = Some(base.clone());
    state.save()?;
    if args.detach {
        keep_for_detach(link, remote, state).await?;
    }

    let stop_text = match &state.state.slurm {
        Some(job) => format!("stop and cancel job {}", job.job_id),
        None if args.detach => "detach, leaving Jupyter running".into(),
        None => "stop".into(),
    };
    tracing::info!(
        "ready after {:.1}s: {base} (Ctrl-C or `tunnel down {}` to {stop_text})",
        t0.elapsed().as_secs_f64(),
        state.state.host,
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

    loop {
        let node = link.job.as_ref().and_then(|j| j.node.as_deref());
        match watch_launcher(&mut remote.launcher, signals, node).await {
            Watched::Interrupted(sig) => {
                if args.detach {
                    tracing::info!("{sig}: detaching from jupyter on {}", target.alias);
                    return Ok(Finish::Detach);
                }
                tracing::info!("{sig}: stopping jupyter on {}", target.alias);
                return Ok(Finish::Stop);
            }
            // File > Shut Down in the Jupyter UI: a normal way to finish.
            Watched::Exited(status) if status == "0" => {
                tracing::info!(
                    "jupyter on {} was shut down; closing the tunnel",
                    target.alias
                );
                return Ok(Finish::Stop);
            }
            Watched::Exited(status) => {
                return Err(UpError::JupyterStopped {
                    host: target.alias.clone(),
                    status,
                })
            }
            Watched::LauncherEnded(how) => {
                return Err(UpError::LauncherEnded {
                    host: target.alias.clone(),
                    how,
                })
            }
            Watched::ConnectionLost if link.job.is_some() => {
                let job = state.state.slurm.as_ref().map(|j| j.job_id.clone());
                return Err(SlurmError::ConnectionLost {
                    host: target.alias.clone(),
                    job: job.unwrap_or_default(),
                }
                .into());
            }
            Watched::ConnectionLost => {
                let _ = link.session.send(None);
                let lost_at = Instant::now();
                tracing::warn!(
                    "connection to {} lost; reconnecting (Jupyter waits up to {}s)",
                    target.alias,
                    args.linger
                );
                let runtime_dir = remote.runtime_dir.clone().unwrap_or_default();
                let Some(launcher) = reconnect(link, &runtime_dir, state, signals).await? else {
                    tracing::warn!(
                        "interrupted while reconnecting; jupyter on {} stops itself after {}s",
                        target.alias,
                        args.linger
                    );
                    return Err(UpError::Interrupted("interrupted while reconnecting"));
                };
                remote.launcher = launcher;
                let _ = link.session.send(Some(link.handle.clone()));
                if args.detach {
                    keep_for_detach(link, remote, state).await?;
                }
                tracing::info!(
                    "reconnected to {} after {:.1}s; {base} works again",
                    target.alias,
                    lost_at.elapsed().as_secs_f64()
                );
            }
        }
    }
}

/// --detach: the server outlives this client, which records how to come back.
async fn keep_for_detach(
    link: &Link<'_>,
    remote: &Remote,
    state: &StateFile,
) -> Result<(), UpError> {
    let Some(runtime_dir) = remote.runtime_dir.clone() else {
        return Ok(());
    };
    if let Err(e) = remote.launcher.send_keep().await {
        tracing::warn!("cannot ask the remote to keep jupyter running: {e}");
    }
    ServerRecord {
        host: state.state.host.clone(),
        config: link.args.config.clone(),
        jump: link.args.jump.clone(),
        ssh_user: link.target.user.clone(),
        ssh_host: link.target.host_name.clone(),
        ssh_port: link.target.port,
        app: link.args.app,
        remote_runtime_dir: runtime_dir,
        remote_port: remote.port,
        token: remote.token.expose().to_string(),
        saved_at: now_secs(),
    }
    .save()?;
    Ok(())
}

/// What ended a wait on a ready launcher.
enum Watched {
    Interrupted(&'static str),
    Exited(String),
    LauncherEnded(String),
    ConnectionLost,
}

/// `node`: a second session the tunnel depends on (--slurm's hop to the
/// job's node), whose loss counts as a lost connection.
async fn watch_launcher(
    launcher: &mut Launcher,
    signals: &mut Interrupts,
    node: Option<&Handle>,
) -> Watched {
    // sshd reports how the launcher ended before closing its channel; a
    // channel that closes without that report went down with the connection.
    let mut launcher_end: Option<String> = None;
    loop {
        let ev = tokio::select! {
            ev = launcher.events.recv() => ev.unwrap_or(Event::Closed),
            sig = signals.recv() => return Watched::Interrupted(sig),
            _ = closed(node) => return Watched::ConnectionLost,
        };
        match ev {
            Event::Exited(status) => return Watched::Exited(status),
            Event::Status(s) => launcher_end = Some(format!("exit status {s}")),
            Event::Signal(s) => launcher_end = Some(format!("killed by SIG{s}")),
            Event::Closed => {
                return match launcher_end {
                    Some(how) => Watched::LauncherEnded(how),
                    None => Watched::ConnectionLost,
                }
            }
            other => tracing::debug!("remote: {other:?}"),
        }
    }
}

/// Re-establish the SSH session with backoff and reattach to the server.
/// `None` when interrupted. Gives up once the server has surely stopped
/// (the linger time) or on errors a retry cannot fix (host key, auth).
async fn reconnect(
    link: &mut Link<'_>,
    runtime_dir: &str,
    state: &mut StateFile,
    signals: &mut Interrupts,
) -> Result<Option<Launcher>, UpError> {
    let target = link.target;
    let give_up = Instant::now() + Duration::from_secs(link.args.linger.max(1));
    let mut delay = RETRY_FIRST;
    let mut attempt = 0u32;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = signals.recv() => return Ok(None),
        }
        attempt += 1;
        let last = match open_session(link.route, link.args.accept_new, signals).await {
            Ok(handle) => match reattach(&handle, runtime_dir, state, signals).await {
                Ok((launcher, port, _)) => {
                    if Some(port) != state.state.remote_port {
                        tracing::debug!("the server now reports port {port}");
                    }
                    link.handle = handle;
                    return Ok(Some(launcher));
                }
                Err(UpError::Remote(RemoteError::Gone { message })) => {
                    return Err(UpError::ServerGone {
                        host: target.alias.clone(),
                        why: message,
                    })
                }
                Err(UpError::Interrupted(_)) => return Ok(None),
                Err(e) => e.to_string(),
            },
            Err(UpError::Interrupted(_)) => return Ok(None),
            // A changed host key or refused credentials will not get better.
            Err(UpError::Route(e)) if e.is_permanent() => return Err(UpError::Route(e)),
            Err(e) => e.to_string(),
        };
        tracing::debug!("reconnect attempt {attempt} failed: {last}");
        if Instant::now() + delay >= give_up {
            return Err(UpError::ConnectionLost {
                host: target.alias.clone(),
                linger: link.args.linger,
                last,
            });
        }
        delay = (delay * 2).min(RETRY_CAP);
    }
}

/// Resolves once `handle`'s session has ended (russh notices through its
/// keepalives); never for `None`.
async fn closed(handle: Option<&Handle>) {
    let Some(handle) = handle else {
        return std::future::pending().await;
    };
    while !handle.is_closed() {
        tokio::time::sleep(Duration::from_secs(1)).await;
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

/// How long a fresh connection to the login node may take when the first
/// one is gone and only a `scancel` is left to do.
const CANCEL_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// What `up --slurm` works with: the login node (HOST) and its connection.
struct JobContext<'a> {
    args: &'a UpArgs,
    /// The login node.
    target: &'a Target,
    route: &'a [Target],
    ssh_config: &'a config::SshConfig,
    local: &'a LocalUser,
    login: Arc<Handle>,
}

/// `up --slurm`: submit, wait for the job, run Jupyter in it, serve; then
/// cancel the job whatever happened, so that none is left holding GPUs.
async fn slurm_up(
    cx: &JobContext<'_>,
    sbatch: &[String],
    state: &mut StateFile,
    early_listener: Option<tokio::net::TcpListener>,
    signals: &mut Interrupts,
    t0: Instant,
) -> Result<(), UpError> {
    let host = &cx.target.alias;
    tracing::info!(
        "submitting a job on {host}: sbatch {}",
        slurm::args_text(sbatch)
    );
    let step_key = slurm::step_key().map_err(UpError::Random)?;
    let job = slurm::submit(&cx.login, host, sbatch, &step_key).await?;
    tracing::info!("job {job} submitted; waiting for it to start (Ctrl-C cancels it)");
    state.state.slurm = Some(SlurmJob {
        job_id: job.clone(),
        state: "PENDING".into(),
        reason: None,
        node: None,
        ends_at: None,
    });
    state.save()?;
    let result = in_job(cx, &job, &step_key, state, early_listener, signals, t0).await;
    let result = match result {
        // Jupyter's launcher ended under us: most often the job itself
        // ended (time limit, scancel from elsewhere). Say which.
        Err(e) if !cx.login.is_closed() => match step_end(&e) {
            Some(how) => {
                let seen = match slurm::query(&cx.login, host, &job).await {
                    Ok(Some(st)) => format!("{}; {how}", st.describe()),
                    Ok(None) => format!("squeue no longer lists it; {how}"),
                    Err(q) => format!("{how}; squeue: {q}"),
                };
                Err(SlurmError::Ended {
                    job: job.clone(),
                    how: seen,
                }
                .into())
            }
            None => Err(e),
        },
        other => other,
    };
    cancel_job(cx, &job, signals).await;
    result
}

/// How Jupyter's job step ended, when that is what `e` reports.
fn step_end(e: &UpError) -> Option<String> {
    match e {
        UpError::JupyterStopped { status, .. } => Some(format!("Jupyter exited with {status}")),
        UpError::LauncherEnded { how, .. } => Some(format!("Jupyter's step ended ({how})")),
        _ => None,
    }
}

/// Wait for the job, start Jupyter in it, reach its node and serve.
async fn in_job(
    cx: &JobContext<'_>,
    job: &str,
    step_key: &str,
    state: &mut StateFile,
    early_listener: Option<tokio::net::TcpListener>,
    signals: &mut Interrupts,
    t0: Instant,
) -> Result<(), UpError> {
    let args = cx.args;
    let host = &cx.target.alias;
    let mut save_error = None;
    let waited = slurm::wait_running(&cx.login, host, job, signals, |st| {
        tracing::info!("job {job} {}", st.describe());
        if let Some(rec) = state.state.slurm.as_mut() {
            rec.state = st.state.clone();
            rec.reason = Some(st.reason.clone()).filter(|r| !r.is_empty() && r != "None");
            if st.is_running() {
                rec.node = Some(st.batch_host.clone());
                rec.ends_at = st.time_left.map(|left| now_secs().saturating_add(left));
            }
        }
        if let Err(e) = state.save() {
            save_error = Some(e);
        }
    })
    .await?;
    if let Some(e) = save_error {
        return Err(e.into());
    }
    let running = match waited {
        Waited::Running(st) => st,
        Waited::Interrupted(sig) => {
            tracing::info!("{sig}: cancelling job {job}");
            return Err(UpError::Interrupted(sig));
        }
    };
    let node = running.batch_host;
    if !slurm::valid_node(&node) {
        return Err(SlurmError::Unexpected {
            host: host.clone(),
            command: "squeue",
            answer: format!("batch host {node:?}"),
        }
        .into());
    }

    let token = Token::generate().map_err(UpError::Random)?;
    let spec = launch_spec(args, Some(step_key.to_string()));
    tracing::info!(
        "starting jupyter {} in job {job} on {node}",
        args.app.subcommand()
    );
    let wrapper = slurm::srun_wrapper(job, &node);
    let mut launcher = Launcher::start_via(&cx.login, Some(&wrapper), &spec, &token).await?;

    // While Jupyter starts, open the way to it: ssh to the node through the
    // login node, host key and login checked as for any hop. Where that is
    // closed, each connection goes through a relay job step instead.
    let node_target = config::resolve_node(cx.ssh_config, &node, cx.local, cx.target)?;
    tracing::info!(
        "connecting to {node} ({}@{} port {}) through {host}",
        node_target.user,
        node_target.host_name,
        node_target.port
    );
    let node_handle = tokio::select! {
        r = route::open_through(cx.login.clone(), host, &node_target, args.accept_new) => {
            match r {
                Ok(h) => Some(Arc::new(h)),
                Err(e) => {
                    tracing::warn!(
                        "cannot ssh to {node} through {host}: {e}\n  relaying through job \
                         steps instead (srun on {host}: each new connection takes a moment \
                         longer). If `ssh {node}` works from {host}, a Host block for {node} \
                         in your ssh config can set its HostName, Port, User or keys."
                    );
                    None
                }
            }
        }
        sig = signals.recv() => return Err(UpError::Interrupted(sig)),
    };

    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout + 5);
    let (port, base_url) =
        wait_ready(&mut launcher, state, signals, deadline, args.timeout).await?;
    let mut remote = Remote {
        launcher,
        token,
        runtime_dir: state.state.remote_runtime_dir.clone(),
        port,
        base_url,
    };
    let (forward_session, way) = match &node_handle {
        Some(h) => (h.clone(), forward::Way::Direct(port)),
        None => (
            cx.login.clone(),
            forward::Way::relay(slurm::relay_wrapper(job, &node, port), slurm::relay_max()),
        ),
    };
    let (session_tx, session_rx) = watch::channel(Some(forward_session));
    let mut link = Link {
        args,
        target: &node_target,
        route: cx.route,
        handle: cx.login.clone(),
        session: session_tx,
        job: Some(JobLink {
            node: node_handle.clone(),
            way,
        }),
    };
    let result = serve(
        &mut link,
        &mut remote,
        session_rx,
        state,
        early_listener,
        signals,
        deadline,
        t0,
    )
    .await;
    if let Ok(Finish::Stop | Finish::Detach) = result {
        // A clean stop first (kernels shut down, runtime dir removed); the
        // scancel that follows ends the job.
        stop_remote(&mut remote.launcher, &node_target, signals, 0).await;
    }
    if let Some(h) = node_handle {
        let _ = h
            .disconnect(russh::Disconnect::ByApplication, "", "en")
            .await;
    }
    result.map(|_| ())
}

/// scancel the job and wait for it to leave the queue. Over the login
/// connection if it still stands, else over a fresh one; if even that fails,
/// say how the job ends anyway and how to end it now.
async fn cancel_job(cx: &JobContext<'_>, job: &str, signals: &mut Interrupts) {
    let host = &cx.target.alias;
    let fresh;
    let handle: &Handle = if cx.login.is_closed() {
        let reopen = tokio::time::timeout(
            CANCEL_CONNECT_TIMEOUT,
            route::open(cx.route, cx.args.accept_new),
        );
        match tokio::select! { r = reopen => Some(r), _ = signals.recv() => None } {
            Some(Ok(Ok(h))) => {
                fresh = h;
                &fresh
            }
            other => {
                let why = match other {
                    Some(Ok(Err(e))) => e.to_string(),
                    Some(Err(_)) => "timed out".into(),
                    _ => "interrupted".into(),
                };
                tracing::warn!(
                    "cannot reach {host} to cancel job {job} ({why}); it ends by itself once \
                     Jupyter's step is gone, or run `scancel {job}` on {host}"
                );
                return;
            }
        }
    } else {
        &cx.login
    };
    tokio::select! {
        r = slurm::cancel(handle, host, job) => match r {
            Ok(true) => tracing::info!("cancelled job {job} on {host}; it has left the queue"),
            Ok(false) => tracing::warn!("cancelled job {job} on {host}, but squeue still lists it"),
            Err(e) => tracing::warn!("cannot cancel job {job}: {e}\n  run `scancel {job}` on {host}"),
        },
        sig = signals.recv() => {
            tracing::warn!("{sig} again: not waiting for job {job} to leave the queue");
        }
    }
}
