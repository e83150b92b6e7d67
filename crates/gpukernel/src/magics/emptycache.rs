//! `%emptycache`: give cached GPU memory back, in the Python kernel and in gpukernel, and say
//! what was freed and what cannot be.

use super::python::{PythonKernel, TorchState};
use super::{bundle, html_escape, parse_args, Magic, MagicContext, MagicError, Output};
use clap::{CommandFactory, Parser};
use gpuprobe::units::human_bytes;
use gpuprobe::GpuSnapshot;
use serde::Serialize;
use serde_json::Value;

/// Release cached, unused GPU memory (torch's caching allocator) in the Python kernel and in
/// gpukernel, and report what was freed and what remains.
#[derive(Parser, Debug)]
#[command(name = "%emptycache", disable_version_flag = true)]
struct Args {
    /// Return the report as JSON (the cell's value).
    #[arg(long)]
    json: bool,
}

pub struct EmptyCache;

/// NVML's figure for one pid, summed over GPUs.
fn process_memory(snapshot: &Option<GpuSnapshot>, pid: u32) -> Option<u64> {
    let snapshot = snapshot.as_ref()?;
    let used: Vec<u64> = snapshot
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter())
        .filter(|p| p.pid == pid)
        .filter_map(|p| p.used_memory)
        .collect();
    (!used.is_empty()).then(|| used.iter().sum())
}

fn totals(state: &TorchState) -> (u64, u64) {
    state
        .devices
        .iter()
        .fold((0, 0), |(a, r), d| (a + d.allocated, r + d.reserved))
}

/// One process's line in the report.
#[derive(Serialize)]
struct Row {
    who: String,
    pid: u32,
    before: Option<u64>,
    after: Option<u64>,
    note: String,
}

/// What `%emptycache` says (`--json` gives it as is).
#[derive(Serialize)]
struct Report {
    freed_bytes: u64,
    processes: Vec<Row>,
    remains: Vec<String>,
}

impl Report {
    fn text(&self) -> String {
        let mut text = format!(
            "Freed {} of GPU memory.\n\n{:<14} {:>8} {:>10} {:>10}  notes\n",
            human_bytes(self.freed_bytes),
            "process",
            "pid",
            "before",
            "after"
        );
        let shown = |v: Option<u64>| v.map(human_bytes).unwrap_or_else(|| "-".into());
        for r in &self.processes {
            text.push_str(&format!(
                "{:<14} {:>8} {:>10} {:>10}  {}\n",
                r.who,
                r.pid,
                shown(r.before),
                shown(r.after),
                r.note
            ));
        }
        if !self.remains.is_empty() {
            text.push_str("\nWhat remains:\n");
            for line in &self.remains {
                text.push_str(&format!("  - {line}\n"));
            }
        }
        text
    }
}

/// Empties the Python kernel's cache (where torch has a CUDA context there) and says what its
/// allocator held before and after; live tensors left are added to `remains`.
fn empty_python(python: &dyn PythonKernel, remains: &mut Vec<String>) -> Result<Row, MagicError> {
    let before = python.torch().map_err(|e| {
        MagicError::new("KernelError", format!("cannot read the Python kernel: {e}"))
    })?;
    let note = if !before.imported {
        "torch is not imported in the Python kernel: nothing is cached there".to_string()
    } else if !before.cuda_initialized {
        "torch has not initialised CUDA in the Python kernel: nothing is cached there".to_string()
    } else {
        python.empty_cache().map_err(|e| {
            MagicError::new(
                "KernelError",
                format!("empty_cache in the Python kernel failed: {e}"),
            )
        })?;
        let after = python
            .torch()
            .map_err(|e| MagicError::new("KernelError", e.to_string()))?;
        let (alloc_before, reserved_before) = totals(&before);
        let (alloc_after, reserved_after) = totals(&after);
        if alloc_after > 0 {
            remains.push(format!(
                "{} held by live tensors in the Python kernel: `del` them (and drop references such as optimizer state or `_`/`Out`) to free it",
                human_bytes(alloc_after)
            ));
        }
        format!(
            "allocator reserved {} -> {}, allocated {} -> {}",
            human_bytes(reserved_before),
            human_bytes(reserved_after),
            human_bytes(alloc_before),
            human_bytes(alloc_after)
        )
    };
    Ok(Row {
        who: "Python kernel".into(),
        pid: python.pid(),
        before: None,
        after: None,
        note,
    })
}

/// Fills each row's NVML figures before and after; returns the bytes freed over all rows,
/// and adds what each process still holds to `remains`.
fn measure(
    rows: &mut [Row],
    before: &Option<GpuSnapshot>,
    after: &Option<GpuSnapshot>,
    remains: &mut Vec<String>,
) -> u64 {
    let mut freed_total: i64 = 0;
    for row in rows {
        row.before = process_memory(before, row.pid);
        row.after = process_memory(after, row.pid);
        if let (Some(b), Some(a)) = (row.before, row.after) {
            freed_total += b as i64 - a as i64;
        }
        if let Some(held) = row.after.filter(|a| *a > 0) {
            remains.push(format!(
                "{} still held by {} (pid {}): its CUDA context and library workspaces, which only a restart of that process gives back, plus any live tensors",
                human_bytes(held),
                row.who,
                row.pid
            ));
        }
    }
    if before.is_none() {
        remains.push(
            "No NVIDIA GPU is visible here (no driver): process memory cannot be measured.".into(),
        );
    }
    freed_total.max(0) as u64
}

impl Magic for EmptyCache {
    fn name(&self) -> &'static str {
        "emptycache"
    }

    fn summary(&self) -> &'static str {
        "Release cached GPU memory (torch's caching allocator) in the Python kernel and gpukernel; report what was freed and what remains."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        let nvml_before = ctx.gpu.snapshot().ok();
        let mut rows: Vec<Row> = Vec::new();
        let mut remains: Vec<String> = Vec::new();
        if let Some(python) = ctx.python {
            rows.push(empty_python(python, &mut remains)?);
        }
        rows.push(Row {
            who: "gpukernel".into(),
            pid: std::process::id(),
            before: None,
            after: None,
            note: ctx.gpu.empty_own_cache(),
        });
        let nvml_after = ctx.gpu.snapshot().ok();
        let freed_bytes = measure(&mut rows, &nvml_before, &nvml_after, &mut remains);
        let report = Report {
            freed_bytes,
            processes: rows,
            remains,
        };
        if args.json {
            let value = serde_json::to_value(&report).unwrap_or(Value::Null);
            let mut data = bundle(
                serde_json::to_string_pretty(&value).unwrap_or_default(),
                None,
            );
            data.insert("application/json".into(), value);
            ctx.out.emit(Output::Result { data });
            return Ok(());
        }
        let text = report.text();
        let html = format!("<pre>{}</pre>", html_escape(&text));
        ctx.out.emit(Output::Display {
            data: bundle(text, Some(html)),
            display_id: None,
        });
        Ok(())
    }
}
