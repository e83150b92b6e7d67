//! The side channel into the Python kernel: silent executes with user_expressions, which run
//! no visible code, leave execution_count alone, and wait for earlier cells to finish.

use super::link::ChildLink;
use crate::magics::python::{
    parse_torch_state, Bound, EvalError, PythonKernel, TorchState, EMPTY_CACHE_CODE,
    TORCH_STATE_EXPR,
};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a bounded wait goes on once the child has been interrupted: ipykernel answers an
/// interrupted expression at once, unless a CUDA kernel has to finish first.
const AFTER_INTERRUPT: Duration = Duration::from_secs(10);

pub struct ChildPython {
    pub link: Arc<ChildLink>,
    pub pid: u32,
    pub runtime: tokio::runtime::Handle,
}

/// Evaluates one expression in the child; returns its `text/plain`.
async fn evaluate(link: &ChildLink, expression: &str) -> Result<String, EvalError> {
    let reply = link
        .silent_execute("", &json!({"value": expression}))
        .await
        .map_err(|e| EvalError::Channel(e.to_string()))?;
    let result = &reply["user_expressions"]["value"];
    if result["status"] != "ok" {
        return Err(EvalError::Raised {
            ename: result["ename"].as_str().unwrap_or("error").to_string(),
            evalue: result["evalue"].as_str().unwrap_or("").to_string(),
        });
    }
    result["data"]["text/plain"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| EvalError::Channel(format!("no text/plain in {result}")))
}

impl ChildPython {
    async fn bounded(&self, expression: &str, bound: Bound<'_>) -> Result<String, EvalError> {
        let answer = evaluate(&self.link, expression);
        tokio::pin!(answer);
        let started = Instant::now();
        let mut ticks = tokio::time::interval(Duration::from_millis(500));
        // Why we stopped waiting for an answer, and since when.
        let mut ending: Option<(Instant, EvalError)> = None;
        loop {
            tokio::select! {
                reply = &mut answer => return match ending {
                    // Answered after our interrupt: the expression was cut short, so its
                    // answer is not the one asked for.
                    Some((_, why @ EvalError::TimedOut(_))) => Err(why),
                    _ => reply,
                },
                _ = ticks.tick() => {
                    (bound.tick)(started.elapsed());
                    if ending.is_none() && started.elapsed() > bound.limit {
                        tracing::warn!("no answer within {:?}: interrupting the Python kernel", bound.limit);
                        if let Err(e) = self.link.interrupt(Duration::from_secs(2)).await {
                            tracing::warn!("{e}");
                        }
                        ending = Some((Instant::now(), EvalError::TimedOut(bound.limit)));
                    } else if ending.is_none() && bound.cancel.is_cancelled() {
                        // The frontend's interrupt reached the child as well (signal or
                        // forwarded request): its answer comes soon.
                        ending = Some((Instant::now(), EvalError::Cancelled));
                    }
                    if let Some((since, _)) = &ending {
                        if since.elapsed() > AFTER_INTERRUPT {
                            return Err(ending.map(|(_, why)| why).unwrap_or(EvalError::Cancelled));
                        }
                    }
                }
            }
        }
    }
}

impl PythonKernel for ChildPython {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn evaluate_bounded(&self, expression: &str, bound: Bound<'_>) -> Result<String, EvalError> {
        self.runtime.block_on(self.bounded(expression, bound))
    }

    fn evaluate_within(&self, expression: &str, limit: Duration) -> Result<String, EvalError> {
        self.runtime.block_on(async {
            tokio::time::timeout(limit, evaluate(&self.link, expression))
                .await
                .unwrap_or(Err(EvalError::NoAnswer(limit)))
        })
    }

    fn torch(&self) -> Result<TorchState, EvalError> {
        // Magics run on blocking threads, where waiting on the runtime is allowed.
        let text = self
            .runtime
            .block_on(evaluate(&self.link, TORCH_STATE_EXPR))?;
        parse_torch_state(&text)
    }

    fn empty_cache(&self) -> Result<(), EvalError> {
        let reply = self
            .runtime
            .block_on(self.link.silent_execute(EMPTY_CACHE_CODE, &json!({})))
            .map_err(|e| EvalError::Channel(e.to_string()))?;
        if reply["status"] == "ok" {
            Ok(())
        } else {
            Err(EvalError::Raised {
                ename: reply["ename"].as_str().unwrap_or("error").to_string(),
                evalue: reply["evalue"].as_str().unwrap_or("").to_string(),
            })
        }
    }
}

/// Code that records a mixed cell in IPython's history under `count` and moves the counter on,
/// as IPython does for a cell it ran itself.
pub fn record_history_code(count: u64, cell: &str) -> String {
    let literal = Value::String(cell.to_string()).to_string(); // JSON strings are Python literals
    format!(
        "get_ipython().history_manager.store_inputs({count}, {literal}, {literal}); \
         get_ipython().execution_count = {}",
        count + 1
    )
}
