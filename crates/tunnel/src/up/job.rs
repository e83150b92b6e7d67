//! `up --slurm`: submit the holding job, wait for it to run, start Jupyter
//! as a step of it, reach it (ssh to the node through the login node, or
//! relay steps), serve; then cancel the job whatever happened, so that none
//! is left holding GPUs.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::launch::{launch_spec, stop_remote, Remote};
use super::serve::{Finish, JobLink, Link, Serve};
use super::{interruptible, now_secs, Up, UpError};
use crate::config::{self, Target};
use crate::connect::Handle;
use crate::forward;
use crate::platform::Interrupts;
use crate::relay::Relay;
use crate::remote::Launcher;
use crate::route;
use crate::slurm::{self, JobStatus, SlurmError, Waited};
use crate::state::{SlurmJob, StateFile};
use crate::token::Token;

/// How long a fresh connection to the login node may take when the first
/// one is gone and only a `scancel` is left to do.
const CANCEL_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the login node could not be reached again for the `scancel` (shown
/// inside the warning that says how to cancel the job by hand).
#[derive(Debug, thiserror::Error)]
enum ReconnectError {
    /// Boxed: a route error is far larger than the other two.
    #[error(transparent)]
    Route(Box<route::RouteError>),
    #[error("timed out")]
    TimedOut,
    #[error("interrupted")]
    Interrupted,
}

/// What `up --slurm` works with: HOST is the login node, `login` its session.
pub(super) struct JobContext<'a> {
    pub up: &'a Up<'a>,
    pub login: Arc<Handle>,
}

impl JobContext<'_> {
    fn host(&self) -> &str {
        &self.up.target.alias
    }

    /// Submit, run Jupyter in the job, serve; then cancel the job.
    pub async fn run(
        &self,
        sbatch: &[String],
        state: &mut StateFile,
        early_listener: Option<TcpListener>,
        signals: &mut Interrupts,
    ) -> Result<(), UpError> {
        let host = self.host();
        tracing::info!(
            "submitting a job on {host}: sbatch {}",
            slurm::args_text(sbatch)
        );
        let step_key = slurm::step_key().map_err(UpError::Random)?;
        let job = slurm::submit(&self.login, host, sbatch, &step_key).await?;
        tracing::info!("job {job} submitted; waiting for it to start (Ctrl-C cancels it)");
        state.state.slurm = Some(SlurmJob {
            job_id: job.clone(),
            state: "PENDING".into(),
            reason: None,
            node: None,
            ends_at: None,
        });
        state.save()?;
        let result = self
            .in_job(&job, &step_key, state, early_listener, signals)
            .await;
        let result = self.explain_end(&job, result).await;
        self.cancel_job(&job, signals).await;
        result
    }

    /// Jupyter's launcher ended under us: most often the job itself ended
    /// (time limit, scancel from elsewhere). Say which.
    async fn explain_end(&self, job: &str, result: Result<(), UpError>) -> Result<(), UpError> {
        let e = match result {
            Err(e) if !self.login.is_closed() => e,
            other => return other,
        };
        let Some(how) = step_end(&e) else {
            return Err(e);
        };
        let seen = match slurm::query(&self.login, self.host(), job).await {
            Ok(Some(st)) => format!("{}; {how}", st.describe()),
            Ok(None) => format!("squeue no longer lists it; {how}"),
            Err(q) => format!("{how}; squeue: {q}"),
        };
        Err(SlurmError::Ended {
            job: job.to_string(),
            how: seen,
        }
        .into())
    }

    /// Wait for the job, start Jupyter in it, reach its node and serve.
    async fn in_job(
        &self,
        job: &str,
        step_key: &str,
        state: &mut StateFile,
        early_listener: Option<TcpListener>,
        signals: &mut Interrupts,
    ) -> Result<(), UpError> {
        let args = self.up.args;
        let node = self.wait_for_node(job, state, signals).await?;
        let token = Token::generate().map_err(UpError::Random)?;
        let spec = launch_spec(args, Some(step_key.to_string()));
        tracing::info!(
            "starting jupyter {} in job {job} on {node}",
            args.app.subcommand()
        );
        let wrapper = slurm::srun_wrapper(job, &node);
        let launcher = Launcher::start_via(&self.login, Some(&wrapper), &spec, &token).await?;
        // While Jupyter starts, open the way to it.
        let node_target =
            config::resolve_node(self.up.ssh_config, &node, self.up.local, self.up.target)?;
        let node_handle = interruptible(signals, self.reach_node(&node, &node_target)).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout + 5);
        let remote = Remote::ready(launcher, token, state, signals, deadline, args.timeout).await?;
        let way = match &node_handle {
            Some(_) => forward::Way::Direct(remote.port),
            None => forward::Way::Relay(Arc::new(Relay::new(slurm::relay_wrapper(
                job,
                &node,
                remote.port,
            )))),
        };
        let forward_session = node_handle.clone().unwrap_or_else(|| self.login.clone());
        let (session_tx, session_rx) = watch::channel(Some(forward_session));
        let mut serve = Serve {
            link: Link {
                args,
                target: &node_target,
                route: self.up.route,
                handle: self.login.clone(),
                session: session_tx,
                job: Some(JobLink {
                    node: node_handle.clone(),
                    way,
                }),
            },
            remote,
            state,
            signals,
            deadline,
            t0: self.up.t0,
        };
        let result = serve.run(session_rx, early_listener).await;
        if let Ok(Finish::Stop | Finish::Detach) = result {
            // A clean stop first (kernels shut down, runtime dir removed); the
            // scancel that follows ends the job.
            stop_remote(&mut serve.remote.launcher, &node_target, serve.signals, 0).await;
        }
        if let Some(h) = node_handle {
            let _ = h
                .disconnect(russh::Disconnect::ByApplication, "", "en")
                .await;
        }
        result.map(|_| ())
    }

    /// Poll squeue until the job runs (each state saved for `tunnel
    /// status`); the node its batch script runs on.
    async fn wait_for_node(
        &self,
        job: &str,
        state: &mut StateFile,
        signals: &mut Interrupts,
    ) -> Result<String, UpError> {
        let host = self.host();
        let mut save_error = None;
        let waited = slurm::wait_running(&self.login, host, job, signals, |st| {
            tracing::info!("job {job} {}", st.describe());
            record_status(state, st);
            if let Err(e) = state.save() {
                save_error = Some(e);
            }
        })
        .await?;
        if let Some(e) = save_error {
            return Err(e.into());
        }
        let node = match waited {
            Waited::Running(st) => st.batch_host,
            Waited::Interrupted(sig) => {
                tracing::info!("{sig}: cancelling job {job}");
                return Err(UpError::Interrupted(sig));
            }
        };
        if !slurm::valid_node(&node) {
            return Err(SlurmError::Unexpected {
                host: host.to_string(),
                command: "squeue",
                answer: format!("batch host {node:?}"),
            }
            .into());
        }
        Ok(node)
    }

    /// ssh to the job's node through the login node, host key and login
    /// checked as for any hop; `None` where that is closed (each connection
    /// then goes through a relay job step).
    async fn reach_node(&self, node: &str, node_target: &Target) -> Option<Arc<Handle>> {
        let host = self.host();
        tracing::info!(
            "connecting to {node} ({}@{} port {}) through {host}",
            node_target.user,
            node_target.host_name,
            node_target.port
        );
        let accept_new = self.up.args.accept_new;
        match route::open_through(self.login.clone(), host, node_target, accept_new).await {
            Ok(h) => Some(Arc::new(h)),
            Err(e) => {
                tracing::warn!(
                    "cannot ssh to {node} through {host}: {e}\n  relaying through a job \
                     step instead (srun on {host}; one step carries every connection). If \
                     `ssh {node}` works from {host}, a Host block for {node} in your ssh \
                     config can set its HostName, Port, User or keys."
                );
                None
            }
        }
    }

    /// scancel the job and wait for it to leave the queue. Over the login
    /// connection if it still stands, else over a fresh one; if even that
    /// fails, say how the job ends anyway and how to end it now.
    async fn cancel_job(&self, job: &str, signals: &mut Interrupts) {
        let host = self.host();
        let fresh;
        let handle: &Handle = if self.login.is_closed() {
            match self.reconnect_login(signals).await {
                Ok(h) => {
                    fresh = h;
                    &fresh
                }
                Err(why) => {
                    tracing::warn!(
                        "cannot reach {host} to cancel job {job} ({why}); it ends by itself \
                         once Jupyter's step is gone, or run `scancel {job}` on {host}"
                    );
                    return;
                }
            }
        } else {
            &self.login
        };
        match interruptible(signals, slurm::cancel(handle, host, job)).await {
            Ok(Ok(true)) => tracing::info!("cancelled job {job} on {host}; it has left the queue"),
            Ok(Ok(false)) => {
                tracing::warn!("cancelled job {job} on {host}, but squeue still lists it")
            }
            Ok(Err(e)) => {
                tracing::warn!("cannot cancel job {job}: {e}\n  run `scancel {job}` on {host}")
            }
            Err(e) => {
                let sig = match e {
                    UpError::Interrupted(sig) => sig,
                    _ => "a signal",
                };
                tracing::warn!("{sig} again: not waiting for job {job} to leave the queue");
            }
        }
    }

    /// A fresh login session for the scancel; why not, when it fails.
    async fn reconnect_login(&self, signals: &mut Interrupts) -> Result<Handle, ReconnectError> {
        let reopen = tokio::time::timeout(
            CANCEL_CONNECT_TIMEOUT,
            route::open(self.up.route, self.up.args.accept_new),
        );
        match interruptible(signals, reopen).await {
            Ok(Ok(Ok(h))) => Ok(h),
            Ok(Ok(Err(e))) => Err(ReconnectError::Route(Box::new(e))),
            Ok(Err(_)) => Err(ReconnectError::TimedOut),
            Err(_) => Err(ReconnectError::Interrupted),
        }
    }
}

/// squeue's latest word on the job, into the state file (`tunnel status`).
fn record_status(state: &mut StateFile, st: &JobStatus) {
    if let Some(rec) = state.state.slurm.as_mut() {
        rec.state = st.state.clone();
        rec.reason = Some(st.reason.clone()).filter(|r| !r.is_empty() && r != "None");
        if st.is_running() {
            rec.node = Some(st.batch_host.clone());
            rec.ends_at = st.time_left.map(|left| now_secs().saturating_add(left));
        }
    }
}

/// How Jupyter's job step ended, when that is what `e` reports.
fn step_end(e: &UpError) -> Option<String> {
    match e {
        UpError::JupyterStopped { status, .. } => Some(format!("Jupyter exited with {status}")),
        UpError::LauncherEnded { how, .. } => Some(format!("Jupyter's step ended ({how})")),
        _ => None,
    }
}
