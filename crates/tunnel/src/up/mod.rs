//! `tunnel up`: connect, launch Jupyter, forward, report, wait, clean up.
//!
//! - [`plain`]: the usual flow: start Jupyter (or reattach to a detached
//!   one), serve, then stop it or leave it running.
//! - [`serve`]: everything between "Jupyter is ready" and "time to stop":
//!   the forward, the URL, reconnects after a drop, `--detach`.
//! - [`job`]: `--slurm`: submit, wait for the job, Jupyter in a job step on
//!   its node, and the job cancelled whatever happens.
//! - [`launch`]: what every flow does with the remote launcher (start or
//!   reattach and wait for `ready`, stop), and [`interruptible`] for the
//!   waits that Ctrl-C must cut short.

mod job;
mod launch;
pub use launch::Stalled;
mod plain;
mod serve;

use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::auth::AuthError;
use crate::cli::UpArgs;
use crate::config::{self, ConfigError, LocalUser, Sources, SshConfig, Target};
use crate::connect::{ConnectError, Handle};
use crate::exit::{Exit, HasExit};
use crate::forward::{self, ForwardError};
use crate::platform::Interrupts;
use crate::probe::ProbeError;
use crate::remote::RemoteError;
use crate::route::{self, RouteError};
use crate::slurm::{self, SlurmError};
use crate::state::{Phase, ServerRecord, StateError, StateFile, TunnelState};

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
    #[error("timed out after {secs}s waiting for Jupyter on the remote to start: {stalled}")]
    Timeout { secs: u64, stalled: Stalled },
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
            UpError::Timeout { .. } => Exit::Timeout,
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

/// Run `fut` unless a signal (Ctrl-C, SIGTERM, SIGHUP) comes first: then
/// [`UpError::Interrupted`] with its name.
async fn interruptible<F: Future>(signals: &mut Interrupts, fut: F) -> Result<F::Output, UpError> {
    tokio::select! {
        r = fut => Ok(r),
        sig = signals.recv() => Err(UpError::Interrupted(sig)),
    }
}

/// Connect along the route (jump hosts, then the target), checking each
/// host key and authenticating at each hop; Ctrl-C aborts.
async fn open_session(
    route: &[Target],
    accept_new: bool,
    signals: &mut Interrupts,
) -> Result<Arc<Handle>, UpError> {
    let handle = interruptible(signals, route::open(route, accept_new)).await??;
    Ok(Arc::new(handle))
}

/// What every flow of `up` knows once the ssh config is resolved.
struct Up<'a> {
    args: &'a UpArgs,
    local: &'a LocalUser,
    ssh_config: &'a SshConfig,
    /// Jump hosts, then HOST (the login node with --slurm).
    route: &'a [Target],
    /// HOST itself: the route's last hop.
    target: &'a Target,
    /// HOST as typed, lowercased: what the state files are named by.
    host_key: String,
    /// When connecting began (for the "ready after" figures).
    t0: Instant,
}

pub async fn run(args: UpArgs) -> Result<(), UpError> {
    let mut signals = Interrupts::install().map_err(UpError::Signals)?;
    let local = LocalUser::current()?;
    let sources = Sources::new(args.target.config.as_deref(), &local.home);
    let ssh_config = config::load(&sources, &local)?;
    let route = config::resolve_route(
        &ssh_config,
        &args.target.host,
        &local,
        args.target.jump.as_deref(),
    )?;
    let Some(target) = route.last() else {
        return Err(ConfigError::EmptyHost.into());
    };
    tracing::debug!("resolved {route:?}");
    // Bad quoting in --slurm is a usage error: found before connecting.
    let sbatch = args.slurm.as_deref().map(slurm::sbatch_args).transpose()?;
    let host_key = args.target.host.to_ascii_lowercase();
    let mut state = claim_state(&args, target, &host_key)?;
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

    let up = Up {
        args: &args,
        local: &local,
        ssh_config: &ssh_config,
        route: &route,
        target,
        host_key,
        t0: Instant::now(),
    };
    log_route(&route);
    let handle = open_session(&route, args.accept_new, &mut signals).await?;
    tracing::debug!("authenticated after {:.2}s", up.t0.elapsed().as_secs_f64());
    match sbatch {
        Some(sbatch) => {
            let cx = job::JobContext {
                up: &up,
                login: handle,
            };
            cx.run(&sbatch, &mut state, early_listener, &mut signals)
                .await
        }
        None => {
            let mut flow = plain::Plain {
                up: &up,
                state: &mut state,
                signals: &mut signals,
            };
            flow.run(handle, detached, early_listener).await
        }
    }
}

/// This host's state file, claimed (another `up` for it fails here).
fn claim_state(args: &UpArgs, target: &Target, host_key: &str) -> Result<StateFile, StateError> {
    StateFile::claim(TunnelState {
        host: host_key.to_string(),
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
        stop_key: crate::platform::stop_key(),
    })
}

fn log_route(route: &[Target]) {
    let Some((target, hops)) = route.split_last() else {
        return;
    };
    tracing::info!(
        "connecting to {}@{} port {}",
        target.user,
        target.host_name,
        target.port
    );
    for hop in hops {
        tracing::info!(
            "  via jump host {}@{} port {}",
            hop.user,
            hop.host_name,
            hop.port
        );
    }
}
