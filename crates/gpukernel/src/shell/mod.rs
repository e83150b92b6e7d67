//! What both kernel modes share on the shell channel, so neither `kernel/` nor `proxy/`
//! imports the other: a typed view of the requests we answer ([`request`]), the replies we
//! build ([`reply`]), the busy/idle bracket around our own work ([`busy`]), and running one
//! magic into iopub messages ([`exec`], the one place magics meet the protocol).

pub mod exec;
pub mod reply;
pub mod request;

use crate::server::Iopub;
use crate::wire::{Parent, Session};
use jupyter_protocol::{ExecuteInput, ExecutionCount, ExecutionState, Status};
use std::future::Future;

/// Runs `work` between a busy and an idle status for `parent`: the one pair a frontend sees
/// for each request we answer ourselves, whatever `work` sends in between.
pub async fn busy<T>(
    session: &Session,
    iopub: &Iopub,
    parent: &Parent,
    work: impl Future<Output = T>,
) -> T {
    let status = |execution_state| {
        iopub.send(session.iopub(Some(parent), "status", &Status { execution_state }))
    };
    status(ExecutionState::Busy);
    let out = work.await;
    status(ExecutionState::Idle);
    out
}

/// The execute_input that announces a cell and its execution count.
pub fn execute_input(code: &str, execution_count: u64) -> ExecuteInput {
    ExecuteInput {
        code: code.to_string(),
        execution_count: ExecutionCount::new(
            usize::try_from(execution_count).unwrap_or(usize::MAX),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_types_serialise_as_the_spec_writes_them() {
        let busy = serde_json::to_value(Status {
            execution_state: ExecutionState::Busy,
        })
        .unwrap();
        assert_eq!(busy, serde_json::json!({"execution_state": "busy"}));
        let input = serde_json::to_value(execute_input("%gpumem", 3)).unwrap();
        assert_eq!(
            input,
            serde_json::json!({"code": "%gpumem", "execution_count": 3})
        );
        let shutdown = serde_json::to_value(jupyter_protocol::ShutdownReply {
            restart: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            shutdown,
            serde_json::json!({"restart": true, "status": "ok"})
        );
    }
}
