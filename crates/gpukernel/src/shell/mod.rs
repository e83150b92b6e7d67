//! What both kernel modes share on the shell channel, so neither `kernel/` nor `proxy/`
//! imports the other: a typed view of the requests we answer ([`request`]), the replies we
//! build ([`reply`]), the busy/idle bracket around our own work ([`busy`]), and running one
//! magic into iopub messages ([`exec`], the one place magics meet the protocol).

pub mod exec;
pub mod reply;
pub mod request;

use crate::server::Iopub;
use crate::wire::{Parent, Session};
use serde_json::json;
use std::future::Future;

/// Runs `work` between a busy and an idle status for `parent`: the one pair a frontend sees
/// for each request we answer ourselves, whatever `work` sends in between.
pub async fn busy<T>(
    session: &Session,
    iopub: &Iopub,
    parent: &Parent,
    work: impl Future<Output = T>,
) -> T {
    let status = |state: &str| {
        iopub.send(session.iopub(Some(parent), "status", &json!({"execution_state": state})))
    };
    status("busy");
    let out = work.await;
    status("idle");
    out
}
