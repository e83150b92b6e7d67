//! The side channel into the Python kernel: silent executes with user_expressions, which run
//! no visible code, leave execution_count alone, and wait for earlier cells to finish.

use super::link::ChildLink;
use crate::magics::python::{
    export_module_expression, parse_exported_module, parse_torch_state, ExportedModule,
    PythonKernel, TorchState, EMPTY_CACHE_CODE, TORCH_STATE_EXPR,
};
use serde_json::{json, Value};
use std::sync::Arc;

pub struct ChildPython {
    pub link: Arc<ChildLink>,
    pub pid: u32,
    pub runtime: tokio::runtime::Handle,
}

/// Evaluates one expression in the child; returns its `text/plain`.
pub async fn evaluate(link: &ChildLink, expression: &str) -> Result<String, String> {
    let reply = link
        .silent_execute("", &json!({"value": expression}))
        .await
        .map_err(|e| e.to_string())?;
    let result = &reply["user_expressions"]["value"];
    if result["status"] != "ok" {
        return Err(format!(
            "{}: {}",
            result["ename"].as_str().unwrap_or("error"),
            result["evalue"].as_str().unwrap_or("")
        ));
    }
    result["data"]["text/plain"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("no text/plain in {result}"))
}

impl PythonKernel for ChildPython {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn export_module(
        &self,
        name: &str,
        input: Option<&[i64]>,
        vocab: Option<i64>,
        train: bool,
    ) -> Result<ExportedModule, String> {
        let expression = export_module_expression(name, input, vocab, train);
        let text = self.runtime.block_on(evaluate(&self.link, &expression))?;
        parse_exported_module(&text)
    }

    fn torch(&self) -> Result<TorchState, String> {
        // Magics run on blocking threads, where waiting on the runtime is allowed.
        let text = self
            .runtime
            .block_on(evaluate(&self.link, TORCH_STATE_EXPR))?;
        parse_torch_state(&text)
    }

    fn empty_cache(&self) -> Result<(), String> {
        let reply = self
            .runtime
            .block_on(self.link.silent_execute(EMPTY_CACHE_CODE, &json!({})))
            .map_err(|e| e.to_string())?;
        if reply["status"] == "ok" {
            Ok(())
        } else {
            Err(format!(
                "{}: {}",
                reply["ename"].as_str().unwrap_or("error"),
                reply["evalue"].as_str().unwrap_or("")
            ))
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
