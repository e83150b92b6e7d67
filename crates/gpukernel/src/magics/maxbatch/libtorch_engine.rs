//! The libtorch engine: trials in-process through `libgpuprobe_torch.so` (gpuprobe's
//! `maxbatch`), for built-ins, TorchScript files, the magics-only kernel, and `--engine
//! libtorch` on a notebook module, which the Python kernel saves as TorchScript in a private
//! file for the trials (removed afterwards).

use super::export::{self, ExportedModule};
use super::report::{self, Assumptions, Card, EngineKind, Findings, Line, Live, Throughput};
use super::{outside, Amp, Args, Dtype, Optimizer, SearchKind, Target, MAX_TRIALS, TOLERANCE};
use crate::magics::{MagicContext, MagicError, Output};
use crate::torch_plugin::{self, PluginError};
use gpuprobe::plugin_api::{
    MaxBatchReport, MaxBatchRequest, ModelSource, OptimizerKind, Precision, Request,
    ThroughputPoint,
};
use gpuprobe::search::Outcome;
use gpuprobe::stranded::{self, Room};
use gpuprobe::units::human_bytes;
use serde::Deserialize;
use serde_json::Value;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A module exported from the notebook: its private TorchScript file, removed on drop.
struct Exported {
    module: ExportedModule,
}

impl Drop for Exported {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.module.path);
    }
}

fn failed(e: PluginError) -> MagicError {
    MagicError::new("MaxBatchError", e.to_string())
}

fn model_source(
    args: &Args,
    target: &Target,
    ctx: &MagicContext,
) -> Result<(ModelSource, Option<Exported>), MagicError> {
    match target {
        Target::Builtin(name) => Ok((ModelSource::Builtin { name: name.clone() }, None)),
        Target::File(path) => Ok((ModelSource::TorchScript { path: path.clone() }, None)),
        Target::Notebook { name, .. } => {
            let python = ctx.python.ok_or_else(|| {
                MagicError::usage("%maxbatch: notebook variables work in the gpu-python kernel")
            })?;
            let input = args.input.as_ref().map(|s| s.0.as_slice());
            let module =
                export::export(python, ctx.cancel, name, input, args.vocab, !args.inference)
                    .map_err(|e| {
                        MagicError::usage(format!(
                            "%maxbatch: could not take the model from {name:?}: {e}"
                        ))
                    })?;
            let path = module.path.clone();
            Ok((ModelSource::TorchScript { path }, Some(Exported { module })))
        }
    }
}

/// The request for `model`; for a notebook module (`exported`), its token range and its
/// kernel's allocator budget: the answer is for that kernel, unless --limit asks for a card.
fn request_for(
    args: &Args,
    model: ModelSource,
    exported: Option<&ExportedModule>,
) -> MaxBatchRequest {
    let mut request = request(args, model);
    request.vocab = request.vocab.or(exported.and_then(|e| e.vocab));
    request.allocator_budget = exported.and_then(|e| e.allocator_limit);
    request
}

fn request(args: &Args, model: ModelSource) -> MaxBatchRequest {
    MaxBatchRequest {
        model,
        input: args.input.clone().map(|s| s.0),
        vocab: args.vocab,
        dtype: match args.dtype {
            None | Some(Dtype::Fp32) => None,
            Some(Dtype::Fp16) => Some(Precision::Fp16),
            Some(Dtype::Bf16) => Some(Precision::Bf16),
        },
        amp: args.amp.map(|a| match a {
            Amp::Fp16 => Precision::Fp16,
            Amp::Bf16 => Precision::Bf16,
        }),
        optimizer: match args.optimizer.unwrap_or(Optimizer::Adamw) {
            Optimizer::None => OptimizerKind::None,
            Optimizer::Sgd => OptimizerKind::Sgd,
            Optimizer::Adam => OptimizerKind::Adam,
            Optimizer::Adamw => OptimizerKind::Adamw,
        },
        inference: args.inference,
        device: args.device.unwrap_or(0),
        limit: args.limit,
        allocator_budget: None,
        max_batch: args.max.max(1),
        max_trials: MAX_TRIALS,
        tolerance: if args.exact { 0.0 } else { TOLERANCE },
        baseline_search: args.search == SearchKind::DoubleBisect,
        loss: args.loss.and_then(|l| l.kind()),
        target_classes: args.target_classes,
        trial_timeout_s: Some(args.trial_timeout),
    }
}

/// A plugin progress event.
#[derive(Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event {
    TrialStart {
        batch: u64,
    },
    Trial {
        batch: u64,
        outcome: Outcome,
        fits: bool,
        ms: f64,
    },
    Throughput {
        batch: u64,
        samples_per_s: Option<f64>,
    },
}

/// Runs a plugin request while the display shows every trial, the running one with its time
/// so far (a ticker thread: the plugin reports only between trials).
fn call_live(request: &Request, live: &Live, ctx: &MagicContext) -> Result<Value, MagicError> {
    let plugin = torch_plugin::plugin().map_err(failed)?;
    let running: Mutex<Option<(u64, Instant)>> = Mutex::new(None);
    let done = crate::magics::CancelToken::new();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while done.sleep(Duration::from_secs(1)) {
                let current = *running.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some((batch, since)) = current {
                    live.show(Line::Running {
                        batch,
                        elapsed: since.elapsed(),
                    });
                }
            }
        });
        let mut on_event = |event: &str| -> bool {
            let set = |v| *running.lock().unwrap_or_else(PoisonError::into_inner) = v;
            match serde_json::from_str::<Event>(event) {
                Ok(Event::TrialStart { batch }) => {
                    set(Some((batch, Instant::now())));
                    live.show(Line::Running {
                        batch,
                        elapsed: Duration::ZERO,
                    });
                }
                Ok(Event::Trial {
                    batch,
                    outcome,
                    fits,
                    ms,
                }) => {
                    set(None);
                    live.show(Line::Trial {
                        batch,
                        outcome,
                        fits,
                        ms,
                    });
                }
                Ok(Event::Throughput {
                    batch,
                    samples_per_s,
                }) => {
                    set(None);
                    live.show(Line::Timing {
                        batch,
                        samples_per_s,
                    });
                }
                Err(e) => tracing::debug!("unread plugin event ({e}): {event}"),
            }
            ctx.cancel.is_cancelled()
        };
        let reply = plugin.call(request, &mut on_event);
        done.cancel();
        reply.map_err(failed)
    })
}

pub(super) fn run(args: &Args, target: &Target, ctx: &MagicContext) -> Result<(), MagicError> {
    let (model, exported) = model_source(args, target, ctx)?;
    let request = request_for(args, model, exported.as_ref().map(|e| &e.module));
    let result = search(args, request, exported.as_ref(), ctx);
    drop(exported); // the private TorchScript file goes now, whatever happened
    result
}

fn search(
    args: &Args,
    request: MaxBatchRequest,
    exported: Option<&Exported>,
    ctx: &MagicContext,
) -> Result<(), MagicError> {
    let plugin = torch_plugin::plugin().map_err(failed)?;
    let info = plugin.request(&Request::Info).map_err(failed)?;
    let name = args.model.clone().unwrap_or_default();
    if let Some(e) = exported {
        ctx.stdout(format!(
            "%maxbatch: {name} ({} parameters) saved as TorchScript by torch.jit.{} for the \
             libtorch engine; the notebook's module is untouched\n",
            e.module.parameters, e.module.method
        ));
    }
    if info["cuda_available"] != Value::Bool(true) {
        return validate_on_cpu(plugin, request, &name, exported, ctx);
    }
    let live = Live::start(
        ctx.out,
        format!("%maxbatch {name}: trying batch sizes (libtorch, in gpukernel)"),
    );
    // Who holds the card as the search begins, for the note on memory outside gpukernel.
    let gpus = outside::snapshot();
    let reply = call_live(&Request::MaxBatch(request.clone()), &live, ctx)?;
    let report: MaxBatchReport = serde_json::from_value(reply)
        .map_err(|e| MagicError::new("MaxBatchError", format!("unreadable report: {e}")))?;
    match &report.search.stopped {
        Some(gpuprobe::search::Stop::Cancelled) => return Err(MagicError::interrupted()),
        Some(gpuprobe::search::Stop::Failed(why)) => {
            return Err(MagicError::new("MaxBatchError", why.clone()))
        }
        None => {}
    }
    let mut findings = findings(args, &name, &request, &report, exported);
    if exported.is_none() {
        // (A notebook module's kernel holds its weights, which unseen_memory_note counts.)
        findings.notes.extend(outside_note(
            &report,
            gpus.as_ref(),
            request.device,
            ctx.python.map(|p| p.pid()),
        ));
    }
    if let (true, Some(recommended)) = (args.throughput, findings.recommended()) {
        findings.throughput = Some(throughput(request, recommended, &live, ctx)?);
    }
    ctx.out.emit(Output::value_or_display(
        report::summary(&findings),
        args.json,
    ));
    Ok(())
}

/// Without a GPU there is nothing to size against: the plugin runs the step once on the CPU,
/// so that a model that cannot train is told now rather than on the GPU machine.
fn validate_on_cpu(
    plugin: &torch_plugin::TorchPlugin,
    request: MaxBatchRequest,
    name: &str,
    exported: Option<&Exported>,
    ctx: &MagicContext,
) -> Result<(), MagicError> {
    let said = plugin
        .request(&Request::ValidateOnCpu(request))
        .map_err(failed)?;
    // How this engine's step can differ from the user's loop is worth knowing before the
    // search, as after it.
    let notes: String = exported
        .map(|e| input_notes(name, &e.module))
        .unwrap_or_default()
        .iter()
        .map(|n| format!("Note: {n}.\n"))
        .collect();
    ctx.stdout(format!(
        "No CUDA GPU is visible to libtorch here, so there is no GPU memory to size against.\n\
         Validated the model instead: {}.\n{notes}Run %maxbatch on a GPU machine for the \
         search.\n",
        said.as_str().unwrap_or("ok")
    ));
    Ok(())
}

/// `--throughput`: samples per second at batches up to the recommendation.
fn throughput(
    request: MaxBatchRequest,
    recommended: u64,
    live: &Live,
    ctx: &MagicContext,
) -> Result<Throughput, MagicError> {
    let points = call_live(
        &Request::Throughput {
            setup: request,
            batches: report::throughput_candidates(recommended),
            steps: report::THROUGHPUT_STEPS,
        },
        live,
        ctx,
    )?;
    if ctx.cancel.is_cancelled() {
        return Err(MagicError::interrupted());
    }
    let points: Vec<ThroughputPoint> = serde_json::from_value(points)
        .map_err(|e| MagicError::new("MaxBatchError", format!("unreadable timings: {e}")))?;
    Ok(Throughput::from_points(
        points
            .into_iter()
            .map(|p| (p.batch, p.samples_per_s))
            .collect(),
    ))
}

/// Why this engine's answer can be above the user's loop's: memory the notebook's process
/// holds besides the module, which a copy in gpukernel's process does not compete with.
/// Measured on an H200: 0.85 GB more held in one run than another moved the loop's truth for
/// ViT-B/16 bf16 by 12 samples while this engine's answer stayed (maxbatch-truth-2026-12-03).
fn unseen_memory_note(
    module: &ExportedModule,
    search: &gpuprobe::search::SearchResult,
) -> Option<String> {
    let extra = module.held_on_device?.checked_sub(module.own_bytes?)?;
    if extra < (64 << 20) {
        return None;
    }
    let per_sample = search.fit.map(|(_, per)| per).filter(|p| *p > 0.0);
    let samples = per_sample
        .map(|p| (extra as f64 / p) as u64)
        .filter(|&n| n > 0)
        .map(|n| format!(", up to about {n} samples of this answer"))
        .unwrap_or_default();
    Some(format!(
        "your Python kernel holds {} on this GPU besides the model's own weights and \
         gradients; your loop has that much less room, which this engine (a copy in \
         gpukernel's own process) does not count{samples}",
        human_bytes(extra)
    ))
}

/// Why this engine's answer may not be for the user's batches at all: it feeds the batch
/// first, while a layer with `batch_first=False` takes (seq, batch, ...).
fn seq_first_note(module: &ExportedModule) -> Option<String> {
    let (first, rest) = module.seq_first.split_first()?;
    let more = match rest.len() {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    Some(format!(
        "{first}{more} take (seq, batch, ...) (batch_first=False), and this engine puts the \
         batch on dim 0 of the input: if your loop feeds (seq, batch) tensors, this answer is \
         for another model's batches; the python engine (without --engine libtorch) puts the \
         batch where those layers take it"
    ))
}

/// How this engine's call of the module can differ from the user's loop's: the batch first
/// into seq-first layers, and no targets for a forward that takes them.
fn input_notes(name: &str, module: &ExportedModule) -> Vec<String> {
    let targets = module.targets_parameter.as_deref().map(|p| {
        format!(
            "{name}.forward takes {p}, and this engine calls it without and trains on its \
             output's loss as planned here; the python engine (the default for a notebook \
             variable) passes them and trains on the loss the forward returns, as a loop that \
             passes them does: that can differ (nanoGPT computes the logits of its last \
             position only without targets; a Hugging Face model's loss upcasts bf16 logits to \
             float32)"
        )
    });
    let lightning = module.lightning.then(|| {
        format!(
            "{name} is a LightningModule: this engine trains its forward on the loss planned \
             here, its gradients zeroed before the forward, where its Trainer runs its \
             training_step and zeroes them after it, so that the last step's are alive through \
             the forward; the python engine (the default for a notebook variable) runs the \
             Trainer's step"
        )
    });
    seq_first_note(module)
        .into_iter()
        .chain(targets)
        .chain(lightning)
        .collect()
}

fn findings(
    args: &Args,
    name: &str,
    request: &MaxBatchRequest,
    report: &MaxBatchReport,
    exported: Option<&Exported>,
) -> Findings {
    let mut notes = Vec::new();
    if let Some(note) = exported.and_then(|e| unseen_memory_note(&e.module, &report.search)) {
        notes.push(note);
    }
    if let Some(e) = exported {
        notes.extend(input_notes(name, &e.module));
    }
    if let Some(note) = exported.and_then(|e| unmeasured_block_note(&e.module, report)) {
        notes.push(note);
    }
    if exported.is_some() {
        notes.push(
            "the libtorch engine trains a TorchScript copy with its own loss and a new \
             optimizer, not your loop: for the number your own training needs, run it without \
             --engine libtorch (the python engine runs your eager step in your kernel)"
                .into(),
        );
    }
    Findings {
        model: name.to_string(),
        search: report.search.clone(),
        assumptions: assumptions(args, name, request, report, exported),
        limit: report.limit,
        device_total: report.device_total,
        card: args.limit.map(|bytes| Card {
            bytes,
            context: report.context_bytes,
        }),
        elapsed_ms: report.elapsed_ms,
        trial_ms: report.trial_ms.clone(),
        trial_steps: report
            .trial_ms
            .iter()
            .map(|&(batch, _)| (batch, gpuprobe::plugin_api::STEPS_PER_TRIAL as u32))
            .collect(),
        trial_reserved: report.trial_reserved.clone(),
        held: None,
        after: format!(
            "afterwards gpukernel holds {} allocated, {} reserved (cache emptied)",
            human_bytes(report.after_allocated),
            human_bytes(report.after_reserved)
        ),
        notes,
        margin_percent: args.margin,
        throughput: None,
        confirmation: None,
        room: room_for_a_stranded_block(report, exported.map(|e| &e.module)),
        timings: None,
    }
}

/// The note on memory in use outside gpukernel's allocator where free memory set the limit
/// (another user's training, or the notebook's own kernel), naming who held it on the
/// device as the search began (`at_start`, NVML's reading then).
fn outside_note(
    report: &MaxBatchReport,
    at_start: Option<&gpuprobe::GpuSnapshot>,
    device: usize,
    python_pid: Option<u32>,
) -> Option<String> {
    let start = report.free_at_start?;
    let budget = outside::Budget {
        total: report.device_total,
        free: start.free,
        reserved: start.reserved,
        fraction: 1.0,
    };
    if !budget.worth_a_note() {
        return None;
    }
    // gpukernel made its CUDA context in the search: read again to find it listed.
    let now = at_start.and_then(|_| outside::snapshot());
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let visible = visible.as_deref();
    let holders = match (
        at_start.and_then(|s| outside::gpu_by_ordinal(s, device, visible)),
        now.as_ref()
            .and_then(|s| outside::gpu_by_ordinal(s, device, visible)),
    ) {
        (Some(at_start), Some(now)) => {
            outside::holders(at_start, now, std::process::id(), python_pid)
        }
        _ => Vec::new(),
    };
    outside::note(&budget, report.limit, &holders, "gpukernel's allocator")
}

/// The room the recommendation leaves for one more of the step's largest blocks, as the
/// python engine leaves it: the user's loop strands blocks under the default allocator just
/// the same, whichever engine sized it. None for a notebook module whose kernel's allocator
/// maps expandable segments, though gpukernel's own does not (set with %env in the notebook).
fn room_for_a_stranded_block(
    report: &MaxBatchReport,
    notebook: Option<&ExportedModule>,
) -> Option<Room> {
    if notebook.and_then(|m| m.expandable_segments) == Some(true) {
        return None;
    }
    let block = |batch| {
        report
            .trial_blocks
            .iter()
            .find(|&&(b, _)| b == batch)
            .map(|&(_, block)| block)
    };
    let fitted = report.search.trials.iter().filter_map(|t| match t.outcome {
        Outcome::Ran { peak, .. } if t.fits => Some((t.batch, peak, block(t.batch))),
        _ => None,
    });
    stranded::room_of_trials(fitted, report.limit)
}

/// Why this engine's recommendation leaves no room for a stranded block where the notebook's
/// allocator can strand one: its trials measured no block (gpukernel's own allocator maps
/// expandable segments, or its segments could not be read).
fn unmeasured_block_note(module: &ExportedModule, report: &MaxBatchReport) -> Option<String> {
    if module.expandable_segments != Some(false) || report.search.max_fit.is_none() {
        return None;
    }
    if room_for_a_stranded_block(report, Some(module)).is_some() {
        return None;
    }
    Some(
        "your kernel's allocator does not use expandable segments, so its cache can strand \
         one of your step's largest allocations as it fragments, but this engine's trials \
         could not measure that allocation (gpukernel's own allocator maps expandable \
         segments, or its segments were unreadable): the recommendation leaves no room for \
         it; the python engine (without --engine libtorch) does"
            .into(),
    )
}

/// What the libtorch trials assumed: the step, loss, precision, optimizer and input.
fn assumptions(
    args: &Args,
    name: &str,
    request: &MaxBatchRequest,
    report: &MaxBatchReport,
    exported: Option<&Exported>,
) -> Assumptions {
    let precision = match (args.amp, args.dtype) {
        (Some(amp), _) => format!("fp32 weights, {} autocast", amp.name()),
        (None, Some(Dtype::Fp16)) => "fp16".into(),
        (None, Some(Dtype::Bf16)) => "bf16".into(),
        (None, _) => "fp32".into(),
    };
    let optimizer = if args.inference {
        "none (inference, no gradients)".to_string()
    } else {
        format!("a new {:?}", request.optimizer).to_lowercase()
    };
    let input = request
        .input
        .as_ref()
        .map(|s| super::shape_text(s))
        .unwrap_or_else(|| "the model's default".into());
    let tokens = match (request.vocab, args.vocab) {
        (Some(v), Some(_)) => format!(", token ids < {v}"),
        (Some(v), None) => format!(", token ids < {v} (from the model's Embedding)"),
        (None, _) => String::new(),
    };
    let source = match exported {
        Some(m) => format!(
            "the notebook's {name} as TorchScript (torch.jit.{})",
            m.module.method
        ),
        None => name.to_string(),
    };
    Assumptions {
        engine: EngineKind::Libtorch,
        step: if args.inference {
            format!("forward of {source} without gradients")
        } else {
            format!("forward, loss, backward and optimizer step of {source}, 3 steps per trial")
        },
        loss: report
            .loss
            .map(|l| report.loss_inputs.clone().unwrap_or_default().describe(l)),
        precision,
        optimizer,
        input: Some(format!("{input} per sample{tokens}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuprobe::search::SearchResult;

    fn module(held: Option<u64>, own: Option<u64>) -> ExportedModule {
        serde_json::from_value(serde_json::json!({
            "path": "/tmp/x.pt", "method": "script", "training": true, "parameters": 1,
            "held_on_device": held, "own_bytes": own,
        }))
        .expect("an export reply")
    }

    fn search(per_sample: f64) -> SearchResult {
        SearchResult {
            max_fit: Some(337),
            min_fail: Some(338),
            exact: true,
            settled: true,
            capped: false,
            trials: vec![],
            fit: Some((1.0e9, per_sample)),
            stopped: None,
        }
    }

    #[test]
    fn memory_the_notebook_holds_beyond_the_model_is_named_with_its_samples() {
        let gb = 1u64 << 30;
        let note = unseen_memory_note(&module(Some(2 * gb), Some(gb / 2)), &search(69.0e6))
            .expect("a note");
        assert!(note.contains("1.50 GiB"), "{note}");
        assert!(note.contains("up to about 23 samples"), "{note}");
        // Nothing beyond the model, or off the GPU: no note.
        assert!(unseen_memory_note(&module(Some(gb), Some(gb)), &search(69.0e6)).is_none());
        assert!(unseen_memory_note(&module(None, None), &search(69.0e6)).is_none());
    }

    #[test]
    fn a_notebook_module_is_sized_against_its_kernels_allocator() {
        let exported: ExportedModule = serde_json::from_value(serde_json::json!({
            "path": "/tmp/x.pt", "method": "trace", "training": true, "parameters": 1,
            "vocab": 32000, "allocator_limit": 25_769_803_776u64,
        }))
        .expect("an export reply");
        let args = super::super::tests::args(&["m", "--engine", "libtorch"]);
        let model = ModelSource::TorchScript {
            path: exported.path.clone(),
        };
        let request = request_for(&args, model.clone(), Some(&exported));
        assert_eq!(request.allocator_budget, Some(25_769_803_776));
        assert_eq!(request.limit, None);
        assert_eq!(request.vocab, Some(32000));
        // A built-in or a file has no kernel to answer for.
        assert_eq!(request_for(&args, model, None).allocator_budget, None);
    }

    #[test]
    fn memory_outside_gpukernel_is_noted_where_free_memory_set_the_limit() {
        let gib = 1u64 << 30;
        let mut shared = report(vec![]);
        (shared.device_total, shared.limit) = (80 * gib, 12 * gib);
        // Another user's training held 67 GiB: 11 GiB free beside gpukernel's 1.
        shared.free_at_start = Some(gpuprobe::plugin_api::FreeAtStart {
            free: 11 * gib,
            reserved: gib,
        });
        let note = outside_note(&shared, None, 0, None).expect("a note");
        assert!(
            note.starts_with(
                "68.0 GiB of this GPU's 80.0 GiB was in use outside gpukernel's \
                              allocator when the search began: the limit (12.0 GiB)"
            ),
            "{note}"
        );
        // `--limit` or a notebook's budget set the limit (the plugin sends no free figure),
        // or the card was gpukernel's alone: nothing.
        shared.free_at_start = None;
        assert_eq!(outside_note(&shared, None, 0, None), None);
        shared.free_at_start = Some(gpuprobe::plugin_api::FreeAtStart {
            free: 79 * gib,
            reserved: 0,
        });
        assert_eq!(outside_note(&shared, None, 0, None), None);
    }

    #[test]
    fn seq_first_layers_are_named_since_this_engine_puts_the_batch_first() {
        let mut exported = module(None, None);
        assert_eq!(seq_first_note(&exported), None);
        exported.seq_first = vec!["lm.rnn".into(), "lm.attn".into()];
        let note = seq_first_note(&exported).expect("a note");
        assert!(
            note.starts_with("lm.rnn and 1 more take (seq, batch, ...)"),
            "{note}"
        );
        assert!(note.contains("without --engine libtorch"), "{note}");
        exported.targets_parameter = Some("targets".into());
        let notes = input_notes("lm", &exported);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[1].starts_with("lm.forward takes targets, and this engine calls it without"),
            "{notes:?}"
        );
        exported.seq_first.clear();
        assert_eq!(input_notes("lm", &exported).len(), 1);
        exported.lightning = true;
        let notes = input_notes("lm", &exported);
        assert!(
            notes[1].starts_with("lm is a LightningModule: this engine trains its forward"),
            "{notes:?}"
        );
    }

    fn report(blocks: Vec<(u64, u64)>) -> MaxBatchReport {
        let gb = 1_000_000_000u64;
        let ran = |batch, peak_gb: f64| gpuprobe::search::Trial {
            batch,
            outcome: Outcome::Ran {
                peak: (peak_gb * gb as f64) as u64,
                reserved: 0,
                phases: None,
            },
            fits: true,
        };
        // The fp16 GPT's trials (maxbatch-truth-2026-12-07b), as this engine would run them.
        let trials = vec![
            ran(4, 2.784),
            ran(64, 21.52),
            gpuprobe::search::Trial {
                batch: 244,
                outcome: Outcome::OutOfMemory { peak: None },
                fits: false,
            },
            ran(232, 74.01),
        ];
        serde_json::from_value(serde_json::json!({
            "search": SearchResult { max_fit: Some(232), min_fail: Some(233), trials,
                                     ..search(65.5e6) },
            "limit": 81_604_378_624u64, "baseline_allocated": 0, "after_allocated": 0,
            "after_reserved": 0, "trial_ms": [], "trial_blocks": blocks, "elapsed_ms": 1.0,
            "device_total": 85_000_000_000u64,
        }))
        .expect("a report")
    }

    #[test]
    fn this_engine_leaves_the_same_room_for_a_stranded_block() {
        let mb = 1_000_000u64;
        let measured = report(vec![(4, 262 * mb), (64, 4190 * mb), (232, 15_200 * mb)]);
        let room = room_for_a_stranded_block(&measured, None).expect("a room");
        assert!((208..216).contains(&room.largest_batch), "{room:?}");
        let args = super::super::tests::args(&["gpt", "--engine", "libtorch"]);
        let request = request_for(&args, ModelSource::Builtin { name: "x".into() }, None);
        let found = findings(&args, "gpt", &request, &measured, None);
        assert_eq!(found.recommended(), Some(208));
        // A trial without a block (expandable segments, or segments unread): the margin alone.
        let partial = report(vec![(4, 262 * mb), (232, 15_200 * mb)]);
        assert_eq!(room_for_a_stranded_block(&partial, None), None);
        // A notebook whose allocator maps expandable segments strands nothing, whatever
        // gpukernel's own allocator measured: the margin alone.
        let mut notebook = module(Some(1 << 30), Some(1 << 30));
        assert!(room_for_a_stranded_block(&measured, Some(&notebook)).is_some());
        notebook.expandable_segments = Some(true);
        assert_eq!(room_for_a_stranded_block(&measured, Some(&notebook)), None);
        // Nothing to tell where the room was measured or the notebook strands nothing.
        assert_eq!(unmeasured_block_note(&notebook, &measured), None);
        notebook.expandable_segments = Some(false);
        assert_eq!(unmeasured_block_note(&notebook, &measured), None);
        // The notebook's cache can strand a block this engine's trials did not measure.
        let note = unmeasured_block_note(&notebook, &report(vec![])).expect("a note");
        assert!(note.contains("could not measure that allocation"), "{note}");
        let args = super::super::tests::args(&["gpt", "--engine", "libtorch"]);
        let request = request_for(&args, ModelSource::Builtin { name: "x".into() }, None);
        // Its drop removes the file: one that cannot exist.
        let exported = Exported {
            module: ExportedModule {
                path: "/nonexistent/gpukernel-test.pt".into(),
                ..notebook
            },
        };
        let found = findings(&args, "gpt", &request, &report(vec![]), Some(&exported));
        assert!(
            found.notes.iter().any(|n| n.contains("could not measure")),
            "{:?}",
            found.notes
        );
        let found = findings(&args, "gpt", &request, &partial, None);
        assert_eq!(found.recommended(), Some(216));
    }

    #[test]
    fn less_than_a_sample_held_is_named_without_a_count_of_samples() {
        let mib = 1u64 << 20;
        let note = unseen_memory_note(&module(Some(1000 * mib), Some(934 * mib)), &search(130.0e6))
            .expect("a note");
        assert!(note.contains("66.0 MiB"), "{note}");
        assert!(!note.contains("samples"), "{note}");
    }
}
