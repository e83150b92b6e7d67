//! `%oom`: the diagnosis of a CUDA out-of-memory error in the Python kernel.
//!
//! After a cell's execute_reply comes back with status `error`, the proxy runs
//! `%oom --after-error ENAME` (hidden flag) before the cell's idle goes out. It asks the Python
//! kernel through the silent side channel (`probe.py`, never importing anything, leaving nothing
//! behind) whether the exception IPython stored for that cell (`sys.last_value`) is a
//! `torch.OutOfMemoryError` — by type; the allocator's `num_ooms` is the cross-check on a GPU —
//! and, only if it is, shows one display: what was asked and what was there, who holds the
//! card, the biggest live tensors, and the next steps ranked for this case. `%oom` shows the
//! last diagnosis again; `%oom --json` returns it as the cell's value.

mod diagnosis;
mod facts;
mod procs;
mod render;

use super::python::{module_call_expression, EvalError};
use super::{parse_args, Magic, MagicContext, MagicError, Output, OutputSink};
use clap::{CommandFactory, Parser};
use diagnosis::{Diagnosis, Inputs, MaxBatchNote};
use facts::{ProbeFacts, ProbeReply, Released};
use gpuprobe::units::human_bytes;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

const SOURCE: &str = include_str!("probe.py");
const KEY: &str = "_gpukernel_oom";
/// How long the diagnosis waits for the Python kernel. It never interrupts: a cell queued after
/// the failed one keeps running and the diagnosis is skipped.
const LIMIT: Duration = Duration::from_millis(2500);

/// Show the last CUDA out-of-memory diagnosis of this session.
///
/// The diagnosis appears by itself under a cell that fails with torch.OutOfMemoryError
/// (recognised by type, never by the message's text). It is not made when the cell catches
/// the error itself.
#[derive(Parser, Debug)]
#[command(name = "%oom", disable_version_flag = true)]
struct Args {
    /// Return the diagnosis as JSON (the cell's value) for scripts.
    #[arg(long)]
    json: bool,
    /// Let go of what the failed cell's traceback keeps alive (IPython holds it for %debug:
    /// every frame's tensors and their autograd graph), then return the cache; says what it
    /// freed. %debug has nothing to show afterwards.
    #[arg(long, conflicts_with = "after_error")]
    release: bool,
    /// (gpukernel itself, after a failed cell) diagnose if the cell's exception ENAME is an OOM.
    #[arg(long, hide = true, value_name = "ENAME")]
    after_error: Option<String>,
}

#[derive(Default)]
struct Inner {
    last: Option<Diagnosis>,
    maxbatch: Vec<MaxBatchNote>,
    ooms: BTreeMap<u32, u64>,
}

/// What this session remembers for `%oom`: the last diagnosis, the `%maxbatch` results seen,
/// and the allocator's OOM count at the last look.
#[derive(Default)]
pub struct Notes {
    inner: Mutex<Inner>,
}

impl Notes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers a `%maxbatch` result (its application/json) for later diagnoses.
    fn note(&self, output: &Output) {
        let data = match output {
            Output::Display { data, .. } | Output::Result { data } => data,
            _ => return,
        };
        let Some(value) = data.get("application/json") else {
            return;
        };
        let Some(model) = value.get("model").and_then(Value::as_str) else {
            return;
        };
        if value.get("recommended").is_none() {
            return;
        }
        self.lock().maxbatch.push(MaxBatchNote {
            model: model.to_string(),
            max_batch: value.get("max_batch").and_then(Value::as_u64),
            recommended: value.get("recommended").and_then(Value::as_u64),
        });
    }
}

/// Passes a magic's outputs on and lets [`Notes`] see them (for `%maxbatch`).
pub struct Tee<'a> {
    pub inner: &'a dyn OutputSink,
    pub notes: &'a Notes,
}

impl OutputSink for Tee<'_> {
    fn emit(&self, output: Output) {
        self.notes.note(&output);
        self.inner.emit(output);
    }

    fn detach(&self) -> Arc<dyn OutputSink> {
        self.inner.detach()
    }
}

pub struct Oom {
    notes: Arc<Notes>,
}

impl Oom {
    pub fn new(notes: Arc<Notes>) -> Self {
        Self { notes }
    }

    /// Asks the Python kernel about the failed cell's exception; `None` when it is no OOM (or
    /// the kernel could not say in time: a diagnosis must never hold a cell up).
    fn probe(&self, ename: &str, ctx: &MagicContext) -> Option<ProbeFacts> {
        let python = ctx.python?;
        let expression = module_call_expression(KEY, SOURCE, "diagnose", &json!({"ename": ename}));
        let mut answer = python.evaluate_within(&expression, LIMIT);
        // A request that reached ipykernel while it aborted the queue after the error gets an
        // "aborted" reply (no user_expressions): ask once more.
        if matches!(&answer, Err(EvalError::Raised { ename, .. }) if ename == "error") {
            std::thread::sleep(Duration::from_millis(50));
            answer = python.evaluate_within(&expression, LIMIT);
        }
        let text = match answer {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!("OOM diagnosis skipped: {e}");
                return None;
            }
        };
        match serde_json::from_str::<ProbeReply<ProbeFacts>>(&text) {
            Ok(ProbeReply::Ok(facts)) => Some(*facts),
            Ok(ProbeReply::Failed(why)) => {
                tracing::warn!("OOM probe failed in the Python kernel: {why}");
                None
            }
            Err(e) => {
                tracing::warn!("unreadable OOM probe answer ({e}): {text}");
                None
            }
        }
    }

    fn after_error(&self, ename: &str, ctx: &MagicContext) {
        let Some(facts) = self.probe(ename, ctx) else {
            return;
        };
        let this_cell = facts.exception.as_ref().is_some_and(|e| e.matches_reply);
        if !facts.is_oom || !this_cell {
            return;
        }
        let snapshot = ctx.gpu.snapshot();
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let (maxbatch, previous) = {
            let inner = self.notes.lock();
            (inner.maxbatch.clone(), inner.ooms.clone())
        };
        let diagnosis = diagnosis::diagnose(&Inputs {
            facts: &facts,
            snapshot: snapshot.as_ref(),
            kernel_pid: ctx.python.map(|p| p.pid()),
            maxbatch: &maxbatch,
            previous_ooms: &previous,
            cuda_visible_devices: visible.as_deref(),
        });
        ctx.out.emit(Output::Display {
            data: render::bundle_of(&diagnosis),
            display_id: None,
        });
        let mut inner = self.notes.lock();
        for d in &facts.devices {
            inner.ooms.insert(d.index, d.num_ooms);
        }
        inner.last = Some(diagnosis);
    }
}

impl Oom {
    fn release(&self, as_value: bool, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(python) = ctx.python else {
            return Err(MagicError::usage(
                "%oom --release frees what a failed cell of the Python kernel holds; this is the \
                 magics-only kernel",
            ));
        };
        let expression = module_call_expression(KEY, SOURCE, "release", &json!({}));
        let text = python
            .evaluate_within(&expression, Duration::from_secs(60))
            .map_err(|e| MagicError::new("OomError", e.to_string()))?;
        let released = match serde_json::from_str::<ProbeReply<Released>>(&text) {
            Ok(ProbeReply::Ok(r)) => *r,
            Ok(ProbeReply::Failed(why)) => return Err(MagicError::new("OomError", why)),
            Err(e) => return Err(MagicError::new("OomError", format!("{e}: {text}"))),
        };
        let cache = if released.devices.is_empty() {
            "torch holds no CUDA memory in this kernel"
        } else {
            "returned the cache"
        };
        let mut lines = vec![if released.had_traceback {
            format!("Released the failed cell's traceback; {cache}.")
        } else {
            format!("No traceback was held; {cache}.")
        }];
        for d in &released.devices {
            lines.push(format!(
                "  cuda:{}: allocated {} -> {}, reserved {} -> {}",
                d.index,
                human_bytes(d.allocated_before),
                human_bytes(d.allocated_after),
                human_bytes(d.reserved_before),
                human_bytes(d.reserved_after)
            ));
        }
        let mut data = super::bundle(lines.join("\n") + "\n", None);
        data.insert(
            "application/json".into(),
            serde_json::to_value(&released).unwrap_or(Value::Null),
        );
        ctx.out.emit(Output::value_or_display(data, as_value));
        Ok(())
    }
}

impl Magic for Oom {
    fn name(&self) -> &'static str {
        "oom"
    }

    fn summary(&self) -> &'static str {
        "The last CUDA out-of-memory diagnosis (shown by itself under a cell that ran out of GPU memory); --json for scripts."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        if let Some(ename) = &args.after_error {
            self.after_error(ename, ctx);
            return Ok(());
        }
        if args.release {
            return self.release(args.json, ctx);
        }
        let last = self.notes.lock().last.clone();
        let data = match (&last, args.json) {
            (Some(d), false) => render::bundle_of(d),
            (Some(d), true) => {
                let mut data = render::bundle_of(d);
                data.remove("text/html");
                data
            }
            (None, json) => {
                let text = if ctx.python.is_some() {
                    "No CUDA out-of-memory error in this session yet. When a cell fails with \
                     torch.OutOfMemoryError, its diagnosis appears under the traceback."
                } else {
                    "No CUDA out-of-memory diagnosis: this is the magics-only kernel; the \
                     diagnosis is made for cells of the gpu-python kernel."
                };
                let mut data = super::bundle(text, None);
                if json {
                    data.insert("application/json".into(), json!({"diagnosis": null}));
                }
                data
            }
        };
        ctx.out.emit(Output::value_or_display(data, args.json));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::magics::bundle;

    struct Nowhere;
    impl OutputSink for Nowhere {
        fn emit(&self, _: Output) {}
        fn detach(&self) -> Arc<dyn OutputSink> {
            Arc::new(Nowhere)
        }
    }

    #[test]
    fn maxbatch_results_seen_through_the_tee_are_remembered() {
        let notes = Notes::default();
        let tee = Tee {
            inner: &Nowhere,
            notes: &notes,
        };
        let mut data = bundle("progress", None);
        tee.emit(Output::Display {
            data: data.clone(),
            display_id: Some("x".into()),
        });
        data.insert(
            "application/json".into(),
            json!({"model": "net", "max_batch": 100, "recommended": 96}),
        );
        tee.emit(Output::Result { data });
        let inner = notes.lock();
        assert_eq!(
            inner.maxbatch,
            vec![MaxBatchNote {
                model: "net".into(),
                max_batch: Some(100),
                recommended: Some(96)
            }]
        );
    }
}
