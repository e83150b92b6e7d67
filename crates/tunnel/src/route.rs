//! The way to the host: through each ProxyJump hop in turn, each one
//! connected, host-key checked and authenticated on its own, as ssh does.

use std::sync::Arc;

use crate::auth::{self, AuthError};
use crate::config::Target;
use crate::connect::{self, ConnectError, Handle, HostKeyPolicy};
use crate::exit::{Exit, HasExit};

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("{prefix}{source}", prefix = hop_prefix(hop))]
    Connect {
        hop: Option<String>,
        source: ConnectError,
    },
    #[error("{prefix}{source}", prefix = hop_prefix(hop))]
    Auth {
        hop: Option<String>,
        source: AuthError,
    },
}

fn hop_prefix(hop: &Option<String>) -> String {
    hop.as_deref()
        .map(|h| format!("jump host {h}: "))
        .unwrap_or_default()
}

impl HasExit for RouteError {
    fn exit(&self) -> Exit {
        match self {
            RouteError::Connect { source, .. } => source.exit(),
            RouteError::Auth { source, .. } => source.exit(),
        }
    }
}

impl RouteError {
    /// Errors a retry cannot fix: a refused host key or refused credentials.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            RouteError::Auth { .. }
                | RouteError::Connect {
                    source: ConnectError::HostKey(_),
                    ..
                }
        )
    }
}

/// An authenticated session with `target` through the session `via` (whose
/// alias is `via_alias`): the compute node of a SLURM job, reached through
/// the login node. The node's own host key and credentials are checked, as
/// for any hop; the returned session keeps `via` alive.
pub async fn open_through(
    via: Arc<Handle>,
    via_alias: &str,
    target: &Target,
    accept_new: bool,
) -> Result<Handle, RouteError> {
    let policy = HostKeyPolicy::for_target(target, accept_new);
    let mut handle = connect::connect_via(vec![via], via_alias, target, policy)
        .await
        .map_err(|source| RouteError::Connect { hop: None, source })?;
    auth::authenticate(&mut handle, target)
        .await
        .map_err(|source| RouteError::Auth { hop: None, source })?;
    Ok(handle)
}

/// A step of [`open_reporting`] that succeeded, for `tunnel doctor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passed {
    /// TCP (or the jump host's channel) and the SSH handshake, host key
    /// included: russh checks the key inside the handshake.
    Connected,
    Authenticated,
}

/// Connect along `route` (jump hosts first, the target last) and return
/// the authenticated session with the target.
pub async fn open(route: &[Target], accept_new: bool) -> Result<Handle, RouteError> {
    open_reporting(route, accept_new, |_, _| {}).await
}

/// [`open`], telling `passed` about each step that succeeded, with the index
/// of its hop in `route`.
pub async fn open_reporting(
    route: &[Target],
    accept_new: bool,
    mut passed: impl FnMut(usize, Passed),
) -> Result<Handle, RouteError> {
    let mut jumps: Vec<Arc<Handle>> = Vec::new();
    let mut via = String::new();
    let last = route.len().saturating_sub(1);
    for (i, target) in route.iter().enumerate() {
        let hop =
            (i < last).then(|| format!("{} ({}@{})", target.alias, target.user, target.host_name));
        let policy = HostKeyPolicy::for_target(target, accept_new);
        if i < last {
            tracing::debug!(
                "jump host {}: {}@{} port {}",
                i + 1,
                target.user,
                target.host_name,
                target.port
            );
        }
        let connected = if jumps.is_empty() {
            connect::connect(target, policy).await.map(|c| {
                tracing::debug!("connected to {}", c.peer);
                c.handle
            })
        } else {
            connect::connect_via(jumps.clone(), &via, target, policy).await
        };
        let mut handle = connected.map_err(|source| RouteError::Connect {
            hop: hop.clone(),
            source,
        })?;
        passed(i, Passed::Connected);
        auth::authenticate(&mut handle, target)
            .await
            .map_err(|source| RouteError::Auth { hop, source })?;
        passed(i, Passed::Authenticated);
        if i == last {
            return Ok(handle);
        }
        via = target.alias.clone();
        jumps.push(Arc::new(handle));
    }
    // resolve_route always ends with the target itself.
    Err(RouteError::Connect {
        hop: None,
        source: ConnectError::UnknownAlias {
            alias: String::new(),
            detail: "no host to connect to".into(),
        },
    })
}
