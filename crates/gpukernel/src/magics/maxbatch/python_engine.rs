//! The python engine: each trial is the user's own eager step, run in their Python kernel by
//! `trials.py` through the silent side channel; the search (gpuprobe) and the display stay
//! here. A session guard closes the Python side whatever happens, so the user's state is put
//! back and the private module removed even after an error or an interrupt.

use super::report::{
    Assumptions, Card, Confirmation, EngineKind, Findings, Held, Line, Live, Throughput, Timings,
};
use super::{outside, Args, SearchKind};
use crate::magics::python::{module_call_expression, Bound, EvalError, PythonKernel};
use crate::magics::{MagicContext, MagicError, Output};
use gpuprobe::loss::{self, LossInputs, LossPlan};
use gpuprobe::search::{self, Outcome, Phase, PhasePeaks, SearchConfig, SearchResult, Stop};
use gpuprobe::stranded::{self, Room};
use gpuprobe::units::human_bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const SOURCE: &str = include_str!("trials.py");
const KEY: &str = "_gpukernel_maxbatch";

/// Steps per trial, at most: the second runs with the optimizer state the first allocated and
/// the gradients it left, as every later training step does; a third, because some models'
/// third step from a fresh optimizer needs more than the second (a UNet measured on an H200:
/// maxbatch-truth-2026-12-03). Lightning's finder also runs 3. Far below the limit a trial ends
/// after two when the second left memory as the first did (trials.py `_run_steps`).
const STEPS_PER_TRIAL: u32 = 3;

/// Bound on the calls that are not trials (prepare, close): they copy the state to or from
/// host memory, seconds for the largest models.
const SETUP_LIMIT: Duration = Duration::from_secs(300);

/// What a trial runs, as `trials.py` takes it.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Spec {
    /// `"module"` (a standard step built from it) or `"step"` (the user's function).
    pub(super) kind: &'static str,
    pub(super) target: String,
    pub(super) input: Option<Vec<i64>>,
    /// Where the batch goes in the input; `None`: found from the model.
    pub(super) batch_dim: Option<usize>,
    pub(super) vocab: Option<i64>,
    pub(super) amp: Option<&'static str>,
    pub(super) optimizer: Option<&'static str>,
    pub(super) optimizer_from: Option<String>,
    pub(super) inference: bool,
    /// `--drops-output`: each step keeps only its loss; the output goes before backward.
    pub(super) drops_output: bool,
    pub(super) device: Option<usize>,
    /// `--loss`: "own" makes the step train on the model's own loss; the others leave it to
    /// the plan (`set_loss`), and keep the step from choosing the model's own by itself.
    pub(super) loss: Option<&'static str>,
}

/// `prepare`'s reply.
#[derive(Debug, Clone, Deserialize)]
struct Prepared {
    describe: Described,
    memory: Memory,
    output: Option<OutputInfo>,
    #[serde(default)]
    timings_ms: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Deserialize)]
struct Described {
    device: String,
    cuda: bool,
    #[serde(default)]
    state: BTreeMap<String, Vec<String>>,
    /// Whether hooks of the user's modules, or forwards of their own classes, reach state of
    /// theirs, put back with the rest.
    #[serde(default)]
    hooked: bool,
    snapshot_bytes: u64,
    /// Weights the step cannot write (frozen and in no optimizer), left uncopied.
    #[serde(default)]
    fixed_bytes: u64,
    /// Frozen weights in no optimizer that a step function may still write: kept, and put
    /// back only where a trial changed them (part of `snapshot_bytes`).
    #[serde(default)]
    watched_bytes: u64,
    optimizer: String,
    parameters: Option<u64>,
    #[serde(default)]
    vocab: Option<i64>,
    #[serde(default)]
    vocab_from: Option<String>,
    /// Where the batch went in the input, and the seq-first layer that put it there.
    #[serde(default)]
    batch_dim: usize,
    #[serde(default)]
    batch_dim_from: Option<String>,
    /// A seq-first layer that gets the batch as its sequence however it is fed.
    #[serde(default)]
    batch_warning: Option<String>,
    #[serde(default)]
    input_dtype: Option<String>,
    /// The dtype of the module's floating-point weights: the step's precision without autocast.
    #[serde(default)]
    weights_dtype: Option<String>,
    #[serde(default)]
    grad_scaler: bool,
    /// torch.compile wraps the module, or modules in it: the trials run the compiled graphs,
    /// as the user's loop does, compiling again where a new batch size asks for it.
    #[serde(default)]
    compiled: Option<Compiled>,
    /// Optimizers that had not stepped yet: the first trial creates their state.
    #[serde(default)]
    optimizers_without_state: Vec<String>,
    /// The GPUs the model's weights and buffers sit on (several for a split model).
    #[serde(default)]
    gpus: Vec<String>,
    torch: String,
    /// A LightningModule: the standard step runs its training_step as its Trainer does.
    #[serde(default)]
    lightning: bool,
    /// Its batch's target where no output says how to make one (a module without a forward).
    #[serde(default)]
    lightning_target: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct Memory {
    device: String,
    name: Option<String>,
    uuid: Option<String>,
    total: Option<u64>,
    free: Option<u64>,
    /// `torch.cuda.get_per_process_memory_fraction`.
    fraction: Option<f64>,
    limit: Option<u64>,
    allocated: Option<u64>,
    reserved: Option<u64>,
    /// Page-locked host memory torch's host allocator holds (in use and cached).
    pinned: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
struct OutputInfo {
    shape: Vec<i64>,
    dtype: String,
    /// The selected tensor and the heads trained with it.
    #[serde(flatten)]
    inputs: LossInputs,
    /// The loss the model computes itself, when the step trains on it.
    #[serde(default)]
    own_loss: Option<OwnLoss>,
    /// A scalar loss the forward returns without targets, computed from the selected output.
    #[serde(default)]
    returned_loss: Option<ReturnedLoss>,
    /// Where the output holds other scalars with a gradient, left out of the step's loss.
    #[serde(default)]
    left_out: Vec<String>,
    /// The forward's optional targets argument (`targets`, `labels`), if it has one.
    #[serde(default)]
    targets_parameter: Option<String>,
    /// The float input again, sample for sample (maybe flattened): a reconstruction.
    #[serde(default)]
    like_input: bool,
    /// What the whole output of the step's forward holds per sample (every tensor, each
    /// storage once), alive into the next forward as in a for loop.
    #[serde(default)]
    output_sample_bytes: u64,
}

/// The loss the model computes itself when given targets (`--loss own`, or by default where
/// its forward takes them and returns a loss for them: nanoGPT's `targets`, a Hugging Face
/// model's `labels`).
#[derive(Debug, Clone, Deserialize)]
struct OwnLoss {
    /// The forward's argument the targets go to.
    parameter: String,
    /// What the targets are, in words.
    targets: String,
    /// Where the forward returns the loss: `output[1]`, `output.loss`.
    returned: String,
    /// Why the step trains on it without --loss own.
    #[serde(default)]
    reason: Option<String>,
}

/// A scalar loss the forward returns without targets: a masked autoencoder's `(loss, pred,
/// mask)`, a diffusion wrapper's loss; or a term a loop adds to its loss (a z-loss).
#[derive(Debug, Clone, Deserialize)]
struct ReturnedLoss {
    /// Where: `output[0]`, `output.loss`, `output` (the output is the loss itself).
    returned: String,
    /// The output itself is that scalar.
    #[serde(default)]
    itself: bool,
    /// The selected output carries no gradient (detached): the scalar is all a loop can
    /// train on.
    #[serde(default)]
    detached: bool,
}

/// How the standard step uses a [`ReturnedLoss`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum ReturnedUse {
    /// The loss the step trains on.
    Alone,
    /// Added to the planned loss on the class scores it is computed from.
    Added,
}

/// `set_loss`'s reply: what the step found it needs beside the plan.
#[derive(Debug, Clone, Copy, Deserialize)]
struct LossSet {
    #[serde(default)]
    target_values: bool,
}

/// The loss the standard step trains on.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepLoss {
    plan: LossPlan,
    returned: Option<ReturnedUse>,
    /// A LightningModule's training_step took values shaped like the output as its target
    /// where it refused the plan's class ids (`set_loss`'s probe).
    target_values: bool,
}

impl StepLoss {
    /// How a step uses the scalar the forward returns: alone where `--loss own` asks or no
    /// loss was asked and the output is no class scores (the loss of a reconstruction or a
    /// denoiser); added to the cross-entropy on class scores that flow into it (a loop's
    /// z-loss beside its cross-entropy); not at all under `--loss ce/mse/mean`.
    fn of(plan: LossPlan, returned: Option<&ReturnedLoss>, asked: Option<super::Loss>) -> Self {
        let returned = returned.and_then(|r| match asked {
            Some(super::Loss::Own) => Some(ReturnedUse::Alone),
            Some(_) => None,
            // A detached output has nothing to add: the scalar is all there is to train.
            None if matches!(plan, LossPlan::Ce { .. }) && !r.detached => Some(ReturnedUse::Added),
            None => Some(ReturnedUse::Alone),
        });
        StepLoss {
            plan,
            returned,
            target_values: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum TrialResult {
    Ran,
    OutOfMemory,
    Error,
    Interrupted,
}

#[derive(Debug, Clone, Deserialize)]
struct StepError {
    ename: String,
    evalue: String,
    #[serde(rename = "where")]
    location: Option<String>,
    /// What to do about it, where the engine knows (a LightningModule's batch).
    #[serde(default)]
    hint: Option<String>,
}

/// What of the module torch.compile wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Compiled {
    /// The module itself (`model = torch.compile(model)`).
    Whole,
    /// Only modules inside it (`model.blocks = torch.compile(model.blocks)`).
    Part,
}

/// `trial`'s reply.
#[derive(Debug, Clone, Deserialize)]
struct TrialReply {
    result: TrialResult,
    #[serde(default)]
    error: Option<StepError>,
    ms: f64,
    #[serde(default)]
    peak_allocated: Option<u64>,
    #[serde(default)]
    peak_reserved: Option<u64>,
    /// The allocated peak outside the optimizer's step and inside it, where one ran.
    #[serde(default)]
    phase_peaks: Option<PhasePeaks>,
    #[serde(default)]
    samples_per_s: Option<f64>,
    /// The steps it ran: fewer than asked once a step repeated the one before.
    #[serde(default)]
    steps: Option<u32>,
    #[serde(default)]
    settle_ms: f64,
    #[serde(default)]
    cleanup_ms: Cleanup,
    /// The largest segment the trial made the cache reserve, for a trial that ran on a GPU;
    /// absent under expandable segments (they strand no block).
    #[serde(default)]
    largest_block: Option<u64>,
}

impl TrialReply {
    /// The steps it ran (a reply without the field: all it was asked for).
    fn steps(&self) -> u32 {
        self.steps.unwrap_or(STEPS_PER_TRIAL)
    }
}

/// What a trial spent after its steps, in ms.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct Cleanup {
    /// Reading the cache's segments for the largest block (a trial that ran on a GPU).
    segments: f64,
    collect: f64,
    empty_cache: f64,
    restore: f64,
}

#[derive(Debug, Clone, Deserialize)]
struct Closed {
    memory: Option<Memory>,
    #[serde(default)]
    timings_ms: BTreeMap<String, f64>,
    /// What the trials changed and could not put back (tensors over the snapshot's budget,
    /// an unreached optimizer's gradients), for the report's last line.
    #[serde(default)]
    not_kept: Vec<String>,
}

/// `trials.py` answers a request it cannot serve with `{"refused": why}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Reply<T> {
    Refused { refused: String },
    Served(T),
}

#[derive(Debug, thiserror::Error)]
enum CallError {
    /// The request cannot be served (a wrong variable, say): the user's to fix.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Eval(#[from] EvalError),
    #[error("unreadable answer from the Python kernel ({0})")]
    Unreadable(String),
}

impl CallError {
    /// The user's interrupt: seen while waiting, or raised in the Python kernel outside a
    /// trial's own handler (while a state was put back, say), not a failure of ours.
    fn is_interrupt(&self) -> bool {
        match self {
            CallError::Eval(EvalError::Cancelled) => true,
            CallError::Eval(EvalError::Raised { ename, .. }) => ename == "KeyboardInterrupt",
            _ => false,
        }
    }

    fn into_magic(self) -> MagicError {
        match self {
            e if e.is_interrupt() => MagicError::interrupted(),
            CallError::Refused(why) => MagicError::usage(format!("%maxbatch: {why}")),
            other => MagicError::new("MaxBatchError", other.to_string()),
        }
    }
}

/// The open session in the Python kernel; closed on drop.
struct Session<'a> {
    python: &'a dyn PythonKernel,
    ctx: &'a MagicContext<'a>,
    closed: Option<Closed>,
    timings: RefCell<Timings>,
}

impl<'a> Session<'a> {
    fn call<T: DeserializeOwned>(
        &self,
        function: &str,
        args: Value,
        limit: Duration,
        tick: &mut dyn FnMut(Duration),
    ) -> Result<T, CallError> {
        let expression = module_call_expression(KEY, SOURCE, function, &args);
        let started = Instant::now();
        let text = self.python.evaluate_bounded(
            &expression,
            Bound {
                limit,
                cancel: self.ctx.cancel,
                tick,
            },
        );
        self.timed(function, started.elapsed());
        let text = text?;
        match serde_json::from_str::<Reply<T>>(&text) {
            Ok(Reply::Served(value)) => Ok(value),
            Ok(Reply::Refused { refused }) => Err(CallError::Refused(refused)),
            Err(e) => Err(CallError::Unreadable(format!("{e}: {text}"))),
        }
    }

    /// Adds a call's time, end to end, to its phase.
    fn timed(&self, function: &str, took: Duration) {
        let ms = took.as_secs_f64() * 1000.0;
        let mut t = self.timings.borrow_mut();
        match function {
            "prepare" => t.prepare += ms,
            "set_loss" => t.set_loss += ms,
            "close" => t.close += ms,
            "trial" => t.trial_calls += ms,
            _ => {}
        }
    }

    /// Adds what the Python side measured inside a trial.
    fn timed_trial(&self, reply: &TrialReply) {
        let mut t = self.timings.borrow_mut();
        t.steps += reply.ms;
        t.settle += reply.settle_ms;
        t.segments += reply.cleanup_ms.segments;
        t.collect += reply.cleanup_ms.collect;
        t.empty_cache += reply.cleanup_ms.empty_cache;
        t.restore += reply.cleanup_ms.restore;
    }

    fn close(&mut self) -> Option<&Closed> {
        if self.closed.is_none() {
            match self.call::<Closed>("close", json!({}), SETUP_LIMIT, &mut |_| {}) {
                Ok(closed) => {
                    self.timings.get_mut().close_laps = closed.timings_ms.clone();
                    self.closed = Some(closed);
                }
                Err(e) => tracing::warn!("%maxbatch could not close its Python session: {e}"),
            }
        }
        self.closed.as_ref()
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.close();
    }
}

/// The spec for `args`.
pub(super) fn spec(args: &Args) -> Spec {
    let (kind, target) = match (&args.step, &args.model) {
        (Some(step), _) => ("step", step.clone()),
        (None, model) => ("module", model.clone().unwrap_or_default()),
    };
    Spec {
        kind,
        target,
        input: args.input.clone().map(|s| s.0),
        batch_dim: args.batch_dim,
        vocab: args.vocab,
        amp: args.amp.map(|a| a.name()),
        optimizer: args.optimizer.map(|o| o.name()),
        optimizer_from: args.optimizer_from.clone(),
        inference: args.inference,
        drops_output: args.drops_output,
        device: args.device,
        // --target-classes asks for cross-entropy over them, not the model's own loss.
        loss: args
            .loss
            .map(|l| l.name())
            .or(args.target_classes.map(|_| "ce")),
    }
}

/// Runs `%maxbatch` with the python engine.
pub(super) fn run(
    args: &Args,
    python: &dyn PythonKernel,
    ctx: &MagicContext,
) -> Result<(), MagicError> {
    let started = Instant::now();
    let spec = spec(args);
    let mut session = Session {
        python,
        ctx,
        closed: None,
        timings: RefCell::default(),
    };
    let prepared: Prepared = session
        .call("prepare", json!({ "spec": spec }), SETUP_LIMIT, &mut |_| {})
        .map_err(CallError::into_magic)?;
    session.timings.get_mut().prepare_laps = prepared.timings_ms.clone();
    let loss = plan_loss(&session, args, &prepared)?;
    let assumptions = assumptions(args, &spec, &prepared, loss.as_ref());
    let trial_limit = Duration::from_secs_f64(args.trial_timeout);
    if !prepared.describe.cuda || !prepared.memory.device.starts_with("cuda") {
        let check = CpuCheck {
            prepared: &prepared,
            assumptions: &assumptions,
            restored: Restored::of(spec.kind == "step", &prepared.describe),
            model: &spec.target,
            json: args.json,
        };
        return validate_without_gpu(&mut session, &check, trial_limit);
    }
    let mut findings = search_on_gpu(
        &mut session,
        args,
        &spec,
        &prepared,
        assumptions,
        trial_limit,
    )?;
    findings.elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    ctx.out.emit(Output::value_or_display(
        super::report::summary(&findings),
        args.json,
    ));
    Ok(())
}

/// The search on the GPU, from the budget to the closed session: what the report shows (all
/// but the elapsed time, which the caller measures from before `prepare`).
fn search_on_gpu(
    session: &mut Session,
    args: &Args,
    spec: &Spec,
    prepared: &Prepared,
    assumptions: Assumptions,
    trial_limit: Duration,
) -> Result<Findings, MagicError> {
    let python = session.python;
    let (memory, card) = match args.limit {
        Some(card) => cap(session, python.pid(), &prepared.memory, card)?,
        None => (prepared.memory.clone(), None),
    };
    let limit = memory.limit.ok_or_else(|| {
        MagicError::new("MaxBatchError", "the Python kernel gave no memory limit")
    })?;
    let config = SearchConfig {
        limit,
        max_batch: args.max.max(1),
        max_trials: super::MAX_TRIALS,
        tolerance: if args.exact { 0.0 } else { super::TOLERANCE },
        held: memory.allocated.unwrap_or(0),
        ..SearchConfig::default()
    };
    let live = Live::start(
        session.ctx.out,
        format!(
            "%maxbatch {}: trying batch sizes in your Python kernel ({})",
            spec.target,
            memory.name.as_deref().unwrap_or(&memory.device)
        ),
    );
    let held_before = memory.allocated.unwrap_or(0);
    // Read as the search begins, with the memory figures it starts from.
    let outside = outside_note(python.pid(), &memory, limit);
    let searched = search_and_confirm(session, &live, args, &config, held_before, trial_limit)?;
    let mut findings = Findings {
        model: spec.target.clone(),
        trial_ms: searched.records.iter().map(|r| (r.batch, r.ms)).collect(),
        trial_steps: searched
            .records
            .iter()
            .map(|r| (r.batch, r.steps))
            .collect(),
        trial_reserved: searched
            .records
            .iter()
            .filter_map(|r| Some((r.batch, r.reserved?)))
            .collect(),
        search: searched.result,
        assumptions,
        limit,
        device_total: memory.total.unwrap_or(0),
        card,
        elapsed_ms: 0.0,
        held: Some(Held {
            who: format!("your Python kernel (pid {})", python.pid()),
            allocated: held_before,
            reserved: memory.reserved.unwrap_or(0),
        }),
        after: String::new(),
        notes: notes(prepared),
        margin_percent: args.margin,
        throughput: None,
        confirmation: searched.confirmation,
        room: searched.room,
        timings: None,
    };
    findings
        .notes
        .extend(output_note(args, prepared, &findings.search));
    findings.notes.extend(outside);
    if args.throughput {
        findings.throughput = Some(throughput(session, &live, &findings, trial_limit)?);
    }
    findings.after = close_line(
        session,
        Restored::of(spec.kind == "step", &prepared.describe),
    );
    findings.timings = Some(session.timings.borrow().clone());
    Ok(findings)
}

/// The note on what the standard step's held output costs, where it matters (not for a
/// forward-only search, which keeps no output into a next step).
fn output_note(args: &Args, prepared: &Prepared, search: &SearchResult) -> Option<String> {
    let output = prepared.output.as_ref().filter(|_| !args.inference)?;
    let step = step_sample_bytes(&search.trials)?;
    held_output_note(
        output.output_sample_bytes,
        search.max_fit?,
        step,
        args.drops_output,
    )
}

/// What the trials put back, for the report's line on it ([`Restored::line`]).
#[derive(Debug, Clone, Copy)]
struct Restored {
    /// A step function's reach, rather than a module's standard step.
    step_fn: bool,
    /// Hooks of the user's modules, or forwards of their own classes, reach state of theirs
    /// (`trials.py`'s `_model_code_refs`).
    hooked: bool,
}

impl Restored {
    fn of(step_fn: bool, described: &Described) -> Self {
        Self {
            step_fn,
            hooked: described.hooked,
        }
    }

    /// What the trials leave as it was: the state `trials.py` snapshots (modules with their
    /// weights, buffers, gradients and attributes; optimizers, schedulers, scalers; the random
    /// generators; a step function's objects' attributes, loose tensors and the globals it
    /// assigns; what the modules' hooks and forwards keep), and a word on what it cannot (an
    /// iterator).
    fn line(self) -> String {
        match (self.step_fn, self.hooked) {
            (true, hooked) => format!(
                "the modules, optimizers, schedulers, scalers and random generators your step \
                 reaches, the attributes and tensors of the objects it reaches{} and the \
                 variables it assigns are as they were (an iterator it draws from is not put \
                 back)",
                if hooked {
                    ", what your modules' hooks and forwards keep"
                } else {
                    ""
                }
            ),
            (false, hooked) => format!(
                "your model (weights, buffers, gradients, attributes), its optimizer{} and the \
                 random generators are as they were",
                if hooked {
                    ", what its hooks and forwards keep"
                } else {
                    ""
                }
            ),
        }
    }
}

/// Closes the session; the report's line on what the user's kernel holds afterwards.
fn close_line(session: &mut Session, restored: Restored) -> String {
    match session.close() {
        Some(Closed {
            memory: Some(m),
            not_kept,
            ..
        }) => {
            let mut line = afterwards(m, restored);
            if !not_kept.is_empty() {
                line.push_str(&format!("; not put back: {}", not_kept.join("; ")));
            }
            line
        }
        _ => "afterwards: the Python session could not be closed (see the kernel log)".into(),
    }
}

/// What the user's kernel holds once the session is closed.
fn afterwards(m: &Memory, restored: Restored) -> String {
    // Pinned host memory is named only where some is left: the snapshot's is given back at
    // close, so what remains is the user's own (a DataLoader's batches in use).
    let pinned = match m.pinned {
        Some(p) if p > 0 => format!(" and {} of page-locked host memory", human_bytes(p)),
        _ => String::new(),
    };
    format!(
        "afterwards: {}; your Python kernel holds {} allocated, {} reserved{pinned}",
        restored.line(),
        human_bytes(m.allocated.unwrap_or(0)),
        human_bytes(m.reserved.unwrap_or(0))
    )
}

/// The loss a module's standard step uses (from its output, or `--loss`), set in the session;
/// `None` for a step function, whose loss is its own.
fn plan_loss(
    session: &Session,
    args: &Args,
    prepared: &Prepared,
) -> Result<Option<StepLoss>, MagicError> {
    let Some(output) = prepared.output.as_ref().filter(|o| o.own_loss.is_none()) else {
        return Ok(None); // a step function's loss, or the model's own: nothing to plan
    };
    let plan = loss::plan(
        &output.shape,
        args.loss.and_then(|l| l.kind()),
        args.target_classes,
        prepared.describe.vocab.or(args.vocab),
        output.like_input,
    )
    .map_err(|e| MagicError::usage(format!("%maxbatch: {e}")))?;
    let mut loss = StepLoss::of(plan, output.returned_loss.as_ref(), args.loss);
    let set: LossSet = session
        .call(
            "set_loss",
            json!({ "plan": plan, "returned": loss.returned }),
            SETUP_LIMIT,
            &mut |_| {},
        )
        .map_err(CallError::into_magic)?;
    loss.target_values = set.target_values;
    Ok(Some(loss))
}

/// What the search and the confirming trial found.
struct Searched {
    result: search::SearchResult,
    /// One per trial of the search, in its order.
    records: Vec<Record>,
    confirmation: Option<Confirmation>,
    room: Option<Room>,
}

/// What one trial measured beside its outcome.
#[derive(Debug, Clone, Copy)]
struct Record {
    batch: u64,
    ms: f64,
    steps: u32,
    /// The cache's peak, for a trial that ran.
    reserved: Option<u64>,
    /// The largest block it made the cache reserve (a trial that ran, default allocator).
    largest_block: Option<u64>,
}

/// The search over the user's own step, each trial on the live display, then (unless
/// `--no-confirm`, or for the baseline) the trial that runs the recommendation itself.
fn search_and_confirm(
    session: &Session,
    live: &Live,
    args: &Args,
    config: &SearchConfig,
    held_before: u64,
    trial_limit: Duration,
) -> Result<Searched, MagicError> {
    let limit = config.limit;
    let mut records = Vec::new();
    let probe = |batch: u64| -> Result<Outcome, Stop> {
        let (reply, outcome, _) =
            shown_trial(session, live, batch, (limit, held_before), trial_limit)?;
        records.push(Record {
            batch,
            ms: reply.ms,
            steps: reply.steps(),
            reserved: reply
                .peak_reserved
                .filter(|_| matches!(outcome, Outcome::Ran { .. })),
            largest_block: reply.largest_block,
        });
        Ok(outcome)
    };
    let result = match args.search {
        SearchKind::Fit => search::search(config, probe),
        SearchKind::DoubleBisect => search::lightning(config, probe),
    };
    if let Some(stop) = result.stopped.clone() {
        return Err(stop_error(stop));
    }
    // The search's own trials that fitted: each ran as the confirmation would.
    let fitted: Vec<(Record, u64)> = result
        .trials
        .iter()
        .zip(&records)
        .filter_map(|(t, &r)| match t.outcome {
            Outcome::Ran { peak, .. } if t.fits => Some((r, peak)),
            _ => None,
        })
        .collect();
    let room = room_for_a_stranded_block(&fitted, limit);
    // A step whose memory did not grow with the batch had none sized: nothing to confirm.
    let confirmation = match (args.no_confirm, args.search, result.max_fit) {
        (false, SearchKind::Fit, Some(max)) if result.flat_memory().is_none() => {
            let first = stranded::recommend(max, args.margin / 100.0, room);
            let ran: Vec<Record> = fitted.iter().map(|&(r, _)| r).collect();
            Some(confirm(
                session,
                live,
                (Candidates::from(first), &ran),
                (limit, held_before),
                trial_limit,
            )?)
        }
        _ => None,
    };
    Ok(Searched {
        result,
        records,
        confirmation,
        room,
    })
}

/// The room the recommendation leaves for one more of the step's largest blocks, from the
/// trials that fitted; none where a trial gave no block size (expandable segments, which
/// strand none, or off the GPU).
fn room_for_a_stranded_block(fitted: &[(Record, u64)], limit: u64) -> Option<Room> {
    stranded::room_of_trials(
        fitted
            .iter()
            .map(|&(r, peak)| (r.batch, peak, r.largest_block)),
        limit,
    )
}

fn stop_error(stop: Stop) -> MagicError {
    match stop {
        Stop::Cancelled => MagicError::interrupted(),
        Stop::Failed(why) => MagicError::new("MaxBatchError", why),
    }
}

/// Tries the recommendation gets before the search gives up on one.
const CONFIRM_TRIES: usize = 3;

/// The batches the recommendation is confirmed among: the first (the margin's batch below the
/// maximum, or the room for a stranded block's), then the next multiple of 8 below (or the
/// next batch, under 16).
struct Candidates {
    next: Option<u64>,
}

impl Candidates {
    fn from(first: u64) -> Self {
        Self {
            next: Some(first).filter(|&b| b > 0),
        }
    }
}

impl Iterator for Candidates {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        let current = self.next?;
        let lower = if current > 16 {
            (current - 1) / 8 * 8
        } else {
            current - 1
        };
        self.next = Some(lower).filter(|&b| b > 0);
        Some(current)
    }
}

/// Runs the recommendation as a trial of its own (as the user's training starts: the state
/// put back, the optimizer without state): a batch below one that fits can still fail where
/// the allocator's fragmentation depends on the exact sizes (a checkpointed GPT on an H200:
/// 64 failed where 69 to 76 fitted, maxbatch-truth-2026-12-03). A candidate the search itself
/// ran and saw fit (`fitted`) is not run again: every trial starts from that state.
fn confirm(
    session: &Session,
    live: &Live,
    (candidates, fitted): (Candidates, &[Record]),
    (limit, held_before): (u64, u64),
    trial_limit: Duration,
) -> Result<Confirmation, MagicError> {
    let mut confirmation = Confirmation {
        batch: None,
        failed: Vec::new(),
        steps: STEPS_PER_TRIAL,
        ms: 0.0,
        during_search: false,
    };
    for batch in candidates.take(CONFIRM_TRIES) {
        if let Some(ran) = fitted.iter().find(|r| r.batch == batch) {
            confirmation.ms += ran.ms;
            confirmation.steps = ran.steps;
            confirmation.batch = Some(batch);
            confirmation.during_search = true;
            break;
        }
        let (reply, _, fits) = shown_trial(session, live, batch, (limit, held_before), trial_limit)
            .map_err(stop_error)?;
        confirmation.ms += reply.ms;
        confirmation.steps = reply.steps();
        if fits {
            confirmation.batch = Some(batch);
            break;
        }
        confirmation.failed.push(batch);
    }
    Ok(confirmation)
}

/// One search-sized trial (STEPS_PER_TRIAL steps), its outcome on the live display; whether
/// it fits `limit`; stopped if the user interrupted meanwhile.
fn shown_trial(
    session: &Session,
    live: &Live,
    batch: u64,
    (limit, held_before): (u64, u64),
    trial_limit: Duration,
) -> Result<(TrialReply, Outcome, bool), Stop> {
    let reply = trial(session, live, batch, STEPS_PER_TRIAL, 0, trial_limit)?;
    let outcome = outcome(&reply, batch, held_before)?;
    let fits = matches!(outcome, Outcome::Ran { peak, .. } if peak <= limit);
    live.show(Line::Trial {
        batch,
        outcome,
        fits,
        ms: reply.ms,
    });
    if session.ctx.cancel.is_cancelled() {
        return Err(Stop::Cancelled);
    }
    Ok((reply, outcome, fits))
}

/// One trial, shown live while it runs.
fn trial(
    session: &Session,
    live: &Live,
    batch: u64,
    steps: u32,
    timed: u32,
    limit: Duration,
) -> Result<TrialReply, Stop> {
    live.show(Line::Running {
        batch,
        elapsed: Duration::ZERO,
    });
    let mut tick = |elapsed| live.show(Line::Running { batch, elapsed });
    let reply = session
        .call::<TrialReply>(
            "trial",
            json!({"batch": batch, "steps": steps, "timed": timed}),
            limit,
            &mut tick,
        )
        .map_err(|e| trial_stop(e, batch))?;
    session.timed_trial(&reply);
    Ok(reply)
}

/// Why a trial call ended the search.
fn trial_stop(e: CallError, batch: u64) -> Stop {
    match e {
        e if e.is_interrupt() => Stop::Cancelled,
        CallError::Eval(EvalError::TimedOut(limit)) => Stop::Failed(format!(
            "the trial at batch {batch} ran past {} s (--trial-timeout) and was interrupted; \
                 your state was put back. A first step that compiles (torch.compile) can take \
                 long: raise --trial-timeout",
            limit.as_secs()
        )),
        other => Stop::Failed(format!("the trial at batch {batch} failed: {other}")),
    }
}

/// What a trial's reply means for the search.
fn outcome(reply: &TrialReply, batch: u64, held_before: u64) -> Result<Outcome, Stop> {
    match reply.result {
        TrialResult::Interrupted => Err(Stop::Cancelled),
        // Its peak before it ran out, recorded with the trial (`Outcome::OutOfMemory`).
        TrialResult::OutOfMemory => Ok(Outcome::OutOfMemory {
            peak: reply.peak_allocated,
        }),
        TrialResult::Error => {
            let e = reply.error.as_ref();
            Err(Stop::Failed(format!(
                "the step raised {}: {} at batch {batch}{}; your state was put back{}",
                e.map_or("an error", |e| e.ename.as_str()),
                e.map_or("", |e| e.evalue.as_str()),
                e.and_then(|e| e.location.as_deref())
                    .map(|w| format!(" ({w})"))
                    .unwrap_or_default(),
                e.and_then(|e| e.hint.as_deref())
                    .map(|h| format!(". {h}"))
                    .unwrap_or_default()
            )))
        }
        TrialResult::Ran => {
            let peak = reply.peak_allocated.unwrap_or(0);
            if peak <= held_before {
                return Err(Stop::Failed(format!(
                    "the step at batch {batch} allocated no GPU memory: does it put its model \
                     and data on the GPU?"
                )));
            }
            Ok(Outcome::Ran {
                peak,
                reserved: reply.peak_reserved.unwrap_or(0),
                phases: reply.phase_peaks,
            })
        }
    }
}

/// `--limit CARD`: caps the Python kernel's allocator at the card less its CUDA context.
fn cap(
    session: &Session,
    pid: u32,
    memory: &Memory,
    card: u64,
) -> Result<(Memory, Option<Card>), MagicError> {
    let context = context_bytes(pid, memory);
    let bytes = card.saturating_sub(context.unwrap_or(0));
    let available = memory.limit.unwrap_or(0);
    if bytes > available {
        return Err(MagicError::usage(format!(
            "%maxbatch: --limit {} is more than this GPU can give your Python kernel ({}); use a \
             smaller --limit or free the GPU",
            human_bytes(card),
            human_bytes(available)
        )));
    }
    let capped: Memory = session
        .call(
            "set_cap",
            json!({ "bytes": bytes }),
            SETUP_LIMIT,
            &mut |_| {},
        )
        .map_err(CallError::into_magic)?;
    Ok((
        capped,
        Some(Card {
            bytes: card,
            context,
        }),
    ))
}

/// The note on memory in use outside the Python kernel's allocator where it set the limit
/// (another user's training on a shared card), naming the processes NVML shows there.
fn outside_note(pid: u32, memory: &Memory, limit: u64) -> Option<String> {
    let budget = outside::Budget {
        total: memory.total?,
        free: memory.free?,
        reserved: memory.reserved.unwrap_or(0),
        fraction: memory.fraction.unwrap_or(1.0),
    };
    if !budget.worth_a_note() {
        return None;
    }
    let snapshot = outside::snapshot();
    let gpu = snapshot
        .as_ref()
        .zip(memory.uuid.as_deref())
        .and_then(|(snapshot, uuid)| outside::gpu_by_uuid(snapshot, uuid));
    // The kernel has its CUDA context already: one reading serves both.
    let holders = gpu.map_or_else(Vec::new, |gpu| outside::holders(gpu, gpu, pid, None));
    outside::note(&budget, limit, &holders, "your Python kernel's allocator")
}

/// The Python kernel's CUDA context on its device: NVML's figure for the process less what
/// its allocator reserved. `None` where NVML does not show it (no driver access, containers).
fn context_bytes(pid: u32, memory: &Memory) -> Option<u64> {
    let snapshot = outside::snapshot()?;
    let gpu = outside::gpu_by_uuid(&snapshot, memory.uuid.as_deref()?)?;
    let used: u64 = gpu
        .processes
        .iter()
        .filter(|p| p.pid == pid)
        .filter_map(|p| p.used_memory)
        .sum();
    (used > 0).then(|| used.saturating_sub(memory.reserved.unwrap_or(0)))
}

/// `--throughput`: timed steps at the recommendation and fractions of it.
fn throughput(
    session: &Session,
    live: &Live,
    findings: &Findings,
    limit: Duration,
) -> Result<Throughput, MagicError> {
    let Some(recommended) = findings.recommended() else {
        return Ok(Throughput::from_points(Vec::new()));
    };
    let mut points = Vec::new();
    for batch in super::report::throughput_candidates(recommended) {
        let reply = trial(
            session,
            live,
            batch,
            2,
            super::report::THROUGHPUT_STEPS,
            limit,
        )
        .map_err(|stop| match stop {
            Stop::Cancelled => MagicError::interrupted(),
            Stop::Failed(why) => MagicError::new("MaxBatchError", why),
        })?;
        let speed = match reply.result {
            TrialResult::Ran => reply.samples_per_s,
            TrialResult::Interrupted => return Err(MagicError::interrupted()),
            _ => None,
        };
        live.show(Line::Timing {
            batch,
            samples_per_s: speed,
        });
        points.push((batch, speed));
    }
    Ok(Throughput::from_points(points))
}

/// What the check without a GPU reports, and how (`validate_without_gpu`).
struct CpuCheck<'a> {
    prepared: &'a Prepared,
    assumptions: &'a Assumptions,
    restored: Restored,
    /// The module or step function, as the GPU report names it.
    model: &'a str,
    /// `--json`: the cell's value (no batch size in it), else printed as text.
    json: bool,
}

/// No GPU in the Python kernel, so nothing to search: one small trial checks the step and the
/// state's return, and the report says what a search would assume.
fn validate_without_gpu(
    session: &mut Session,
    check: &CpuCheck,
    limit: Duration,
) -> Result<(), MagicError> {
    let reply: TrialReply = session
        .call("trial", json!({"batch": 2, "steps": 1}), limit, &mut |_| {})
        .map_err(|e| match e {
            CallError::Eval(EvalError::TimedOut(limit)) => MagicError::new(
                "MaxBatchError",
                format!(
                    "the trial at batch 2 ran past {} s (--trial-timeout) and was interrupted; \
                     your state was put back",
                    limit.as_secs_f64()
                ),
            ),
            other => other.into_magic(),
        })?;
    let prepared = check.prepared;
    let said = match reply.result {
        TrialResult::Ran => format!("one step of batch 2 ran on the {}", prepared.memory.device),
        TrialResult::OutOfMemory => "the step ran out of memory at batch 2".to_string(),
        TrialResult::Interrupted => return Err(MagicError::interrupted()),
        TrialResult::Error => {
            return Err(MagicError::new(
                "MaxBatchError",
                match outcome(&reply, 2, 0) {
                    Err(Stop::Failed(why)) => why,
                    _ => "the step failed".into(),
                },
            ))
        }
    };
    session.close();
    let a = check.assumptions;
    // A model that mixes the samples of a batch is worth knowing before any GPU is found.
    let warning = prepared
        .describe
        .batch_warning
        .as_ref()
        .map(|w| format!("Note: {w}.\n"))
        .unwrap_or_default();
    let text = format!(
        "No CUDA GPU is visible to torch in your Python kernel ({}), so there is no GPU memory \
         to size against.\nChecked the step instead: {said}; {}.\n{}{warning}\
         Run %maxbatch where the notebook has a GPU for the search (its trials run the steps \
         said above; this check ran one).\n",
        prepared.describe.torch,
        check.restored.line(),
        super::report::assumption_lines(a),
    );
    if !check.json {
        session.ctx.stdout(text);
        return Ok(());
    }
    let value = json!({
        "model": check.model, "max_batch": null, "recommended": null, "gpu": false,
        "torch": prepared.describe.torch,
        "checked": said, "engine": a.engine, "assumptions": a,
    });
    let mut data = crate::magics::bundle(text, None);
    data.insert("application/json".into(), value);
    session.ctx.out.emit(Output::value_or_display(data, true));
    Ok(())
}

/// Where the batch went in the input, when not first: a seq-first loop's (seq, batch, ...).
fn batch_dim_text(dim: usize, from: Option<&str>) -> String {
    match (dim, from) {
        (0, _) => String::new(),
        (d, Some(layer)) => format!(
            ", the batch on dim {d} of the input, as {layer} takes it (--batch-dim 0 if your \
             loop feeds the batch first)"
        ),
        (d, None) => format!(", the batch on dim {d} of the input (--batch-dim)"),
    }
}

fn assumptions(
    args: &Args,
    spec: &Spec,
    prepared: &Prepared,
    loss: Option<&StepLoss>,
) -> Assumptions {
    let (step, precision, input) = if spec.kind == "step" {
        (
            format!(
                "your {}(batch_size), {STEPS_PER_TRIAL} calls per trial (two far below the \
                 limit when the second leaves memory as the first did)",
                spec.target
            ),
            "whatever your step uses".to_string(),
            None,
        )
    } else {
        (
            standard_step_text(args, spec, &prepared.describe),
            standard_precision(args, &prepared.describe),
            Some(standard_input_text(spec, prepared)),
        )
    };
    Assumptions {
        engine: EngineKind::Python,
        step,
        loss: match prepared.output.as_ref().and_then(|o| o.own_loss.as_ref()) {
            Some(own) if prepared.describe.lightning => Some(lightning_loss_text(
                &spec.target,
                &format!("made for {}", own_loss_text(&spec.target, own)),
            )),
            Some(own) => Some(own_loss_text(&spec.target, own)),
            // training_step computes the loss; the plan only makes the batch's target.
            None if prepared.describe.lightning => match &prepared.describe.lightning_target {
                Some(target) => Some(lightning_loss_text(&spec.target, target)),
                None => loss.map(|loss| {
                    let target = if loss.target_values {
                        "values shaped like the output (it refused class ids for the \
                         cross-entropy the output looks like)"
                            .to_string()
                    } else {
                        format!("made for {}", loss_text(args, prepared, &loss.plan))
                    };
                    lightning_loss_text(&spec.target, &target)
                }),
            },
            None => loss.map(|loss| {
                let planned = loss_text(args, prepared, &loss.plan);
                let text = returned_loss_text(&spec.target, loss, prepared, planned);
                let left_out = prepared.output.as_ref().map_or(&[][..], |o| &o.left_out);
                format!("{text}{}", left_out_text(left_out))
            }),
        },
        precision,
        optimizer: prepared.describe.optimizer.clone(),
        input,
    }
}

/// What the standard step built from a module runs.
fn standard_step_text(args: &Args, spec: &Spec, d: &Described) -> String {
    if args.inference {
        return "forward only (no gradients)".to_string();
    }
    if d.lightning {
        return lightning_step_text(&spec.target, d.grad_scaler);
    }
    let scaler = if d.grad_scaler {
        " through a GradScaler"
    } else {
        ""
    };
    let compiled = match d.compiled {
        Some(Compiled::Whole) => {
            " (compiled by torch.compile: a new batch size may compile again, before its \
             trial's steps)"
        }
        Some(Compiled::Part) => {
            " (parts of it compiled by torch.compile: a new batch size may compile them again, \
             before its trial's steps)"
        }
        None => "",
    };
    let output = if spec.drops_output {
        "only the loss kept, the output let go before backward (--drops-output)"
    } else {
        "the last output alive into the next step as in a for loop"
    };
    format!(
        "a standard step of {}{compiled}: zero_grad, forward, loss, backward{scaler}, optimizer \
         step; {STEPS_PER_TRIAL} steps per trial (two far below the limit when the second \
         leaves memory as the first did), {output}; at the limit your own loop can differ by a \
         sample or two (the order it frees memory in): --step FN sizes your own step exactly",
        spec.target
    )
}

/// A LightningModule's loss: what its training_step returns; `target` says how the batch's
/// target was made (for the loss the forward's output reads as, or without one).
fn lightning_loss_text(model: &str, target: &str) -> String {
    format!(
        "what {model}.training_step returns, on a batch (input, target) whose target is \
         {target}"
    )
}

/// What the standard step of a LightningModule runs: its Trainer's automatic optimization.
fn lightning_step_text(target: &str, grad_scaler: bool) -> String {
    let scaler = if grad_scaler {
        " through a GradScaler"
    } else {
        ""
    };
    format!(
        "{target}.training_step((input, target), 0) as a Lightning Trainer runs it: \
         training_step, zero_grad (the last step's gradients alive through the forward), \
         backward{scaler}, optimizer step; {STEPS_PER_TRIAL} steps per trial (two far below the \
         limit when the second leaves memory as the first did), what training_step returns \
         alive into the next step; the Trainer's gradient clipping and accumulation are left \
         out: --step FN sizes a step with them"
    )
}

/// The standard step's precision: the autocast asked for, else the weights' dtype.
fn standard_precision(args: &Args, d: &Described) -> String {
    match args.amp {
        Some(amp) => format!("{} autocast over your weights' dtype", amp.name()),
        // Token ids are the input's dtype, not the step's: the weights' says how it computes.
        None => d
            .weights_dtype
            .clone()
            .or_else(|| d.input_dtype.clone())
            .unwrap_or_else(|| "your model's dtype".into()),
    }
}

/// One sample as the standard step feeds it, and the output it reads.
fn standard_input_text(spec: &Spec, prepared: &Prepared) -> String {
    let d = &prepared.describe;
    let shape = spec
        .input
        .as_ref()
        .map(|s| super::shape_text(s))
        .unwrap_or_default();
    let tokens = match (&d.vocab, &d.vocab_from) {
        (Some(v), Some(from)) => format!(", token ids < {v} (from the model's {from})"),
        (Some(v), None) => format!(", token ids < {v}"),
        _ => String::new(),
    };
    let output = prepared
        .output
        .as_ref()
        .map(|o| format!(", {} {:?} {}", o.inputs.selected, o.shape, o.dtype))
        .unwrap_or_default();
    let batch = batch_dim_text(d.batch_dim, d.batch_dim_from.as_deref());
    format!("{shape} per sample{batch}{tokens}{output}")
}

/// The loss as the report states it; where it was inferred from the output alone and another
/// reading was as likely, how to ask for that one.
fn loss_text(args: &Args, prepared: &Prepared, plan: &LossPlan) -> String {
    let guessed = args.loss.is_none() && args.target_classes.is_none();
    let vocab = prepared.describe.vocab.or(args.vocab);
    let hint = prepared
        .output
        .as_ref()
        .filter(|_| guessed)
        .and_then(|o| loss::alternative(&o.shape, plan, vocab, o.like_input));
    let text = match hint {
        Some(hint) => format!("{plan} ({hint})"),
        None => plan.to_string(),
    };
    let Some(o) = &prepared.output else {
        return text;
    };
    let text = o.inputs.describe(text);
    // The trials pass targets wherever the forward returns a loss for them, unless a loss
    // was asked for; here it returned none for any %maxbatch could make.
    match (&o.targets_parameter, guessed) {
        (Some(p), true) => format!(
            "{text} (its forward also takes {p}, but gave no loss for the targets %maxbatch \
             could make: --step FN sizes a loop that passes yours)"
        ),
        _ => text,
    }
}

/// The model's own loss as the report states it.
fn own_loss_text(model: &str, own: &OwnLoss) -> String {
    let reason = own
        .reason
        .as_deref()
        .map(|r| format!(" ({r})"))
        .unwrap_or_default();
    format!(
        "the model's own: {model}(x, {p}=...) returns it at {returned}, {p} {targets}{reason}",
        p = own.parameter,
        returned = own.returned,
        targets = own.targets,
    )
}

/// The scalars with a gradient the output also holds and the step's loss leaves out.
fn left_out_text(left_out: &[String]) -> String {
    let (what, are) = match left_out.len() {
        0 => return String::new(),
        1 => ("the scalar", "is"),
        _ => ("the scalars", "are"),
    };
    format!(
        " ({what} also returned at {} {are} not in it: an auxiliary loss, say, which --step FN \
         sizes in a loop that adds it)",
        left_out.join(", ")
    )
}

/// The loss of a step that uses the scalar the forward returns without targets.
fn returned_loss_text(
    model: &str,
    loss: &StepLoss,
    prepared: &Prepared,
    planned: String,
) -> String {
    let Some(output) = prepared.output.as_ref() else {
        return planned;
    };
    let Some(r) = output.returned_loss.as_ref() else {
        return planned;
    };
    let selected = &output.inputs.selected;
    match loss.returned {
        Some(ReturnedUse::Alone) if r.itself => format!(
            "the model's own: {model}(x) returns it at {} (its forward returns the loss itself, \
             which a loop over it trains on)",
            r.returned
        ),
        Some(ReturnedUse::Alone) if r.detached => format!(
            "the model's own: {model}(x) returns it at {} (its forward returns a loss, and \
             {selected} carries no gradient: that loss is what a loop over it trains on)",
            r.returned
        ),
        Some(ReturnedUse::Alone) => format!(
            "the model's own: {model}(x) returns it at {} (its forward returns a loss computed \
             from {selected}, which a loop over it trains on; --loss ce, mse or mean sizes that \
             loss on {selected} instead)",
            r.returned
        ),
        Some(ReturnedUse::Added) => format!(
            "{planned}, plus the scalar {model}(x) returns at {}, which is computed from \
             {selected} (a term of its loss, as a z-loss is; --loss ce leaves it out)",
            r.returned
        ),
        None => planned,
    }
}

/// The step's memory per sample, from the smallest and the largest batch that ran (the
/// search's opening line has no second point where its second opening failed), outside the
/// optimizer's step, whose peak barely grows with the batch.
fn step_sample_bytes(trials: &[search::Trial]) -> Option<f64> {
    let ran = trials
        .iter()
        .filter_map(|t| Some((t.batch, t.outcome.peak_in(Phase::Outside)?)));
    let low = ran.clone().min_by_key(|(b, _)| *b)?;
    let high = ran.max_by_key(|(b, _)| *b)?;
    (high.0 > low.0).then(|| (high.1 as f64 - low.1 as f64) / (high.0 - low.0) as f64)
}

/// What keeping the last output alive into the next forward (as `out = model(x)` in a for
/// loop keeps it) may cost at the maximum, where that is a sample or more of the step's own
/// memory: an LM's logits are [batch, seq, vocab] (206 MB a sample for GPT-2 small in fp32),
/// and a loop that drops them first (`loss = model(x, y)[1]`) fits more. The count is by
/// bytes; what it comes to depends on how the cache fragments, measured from none to four
/// times as many: a denoiser's 2 samples' worth came to none (maxbatch-truth-2026-12-06e), a
/// bf16 Llama's 3 to 7 (-06f), a masked autoencoder's 4 to 17 (-06n: its loop fitted 578,
/// the same loop keeping the output 561).
fn held_output_note(
    sample_bytes: u64,
    max_fit: u64,
    step_sample_bytes: f64,
    dropped: bool,
) -> Option<String> {
    let held = sample_bytes.saturating_mul(max_fit);
    let more = (held as f64 / step_sample_bytes).floor();
    if !(1.0..1e9).contains(&more) {
        return None;
    }
    let (sample, held) = (human_bytes(sample_bytes), human_bytes(held));
    Some(if dropped {
        format!(
            "--drops-output: each step's output, {sample} a sample ({held} at {max_fit}), was \
             let go once its loss was computed, as your loop keeps only the loss; a loop that \
             keeps it (`out = model(x)`, or `outputs = model(**batch)` then `outputs.loss`, in \
             a for loop) has about {more} samples' worth less room by its bytes, more as the \
             cache fragments: size such a loop without --drops-output"
        )
    } else {
        format!(
            "the last step's output, {sample} a sample ({held} at {max_fit}), lives into the \
             next step's forward here, as `out = model(x)` or `logits, loss = model(x, y)` in a \
             for loop keeps it; a loop that keeps only the loss (`loss = model(x, y)[1]`, \
             `model(**batch).loss`, `criterion(model(x), y)`, a Trainer's or Lightning's \
             training_step) has about {more} samples' worth more room by its bytes, which has \
             come to anything \
             from none to four times as many samples, as the cache fragments: --drops-output \
             sizes such a loop, --step FN yours exactly"
        )
    })
}

fn notes(prepared: &Prepared) -> Vec<String> {
    let d = &prepared.describe;
    let kept: Vec<String> = d
        .state
        .iter()
        .filter(|(_, names)| !names.is_empty())
        .map(|(kind, names)| format!("{kind}: {}", names.join(", ")))
        .collect();
    let mut notes = vec![format!(
        "kept and put back after every trial ({} copied to host memory): {}",
        human_bytes(d.snapshot_bytes),
        if kept.is_empty() {
            "nothing found".to_string()
        } else {
            kept.join("; ")
        }
    )];
    if d.fixed_bytes > 0 {
        notes.push(format!(
            "{} of weights the step cannot change (frozen, in no optimizer, or all of them \
             with --inference) were not copied",
            human_bytes(d.fixed_bytes)
        ));
    }
    if d.watched_bytes > 0 {
        notes.push(format!(
            "{} of that are frozen weights in no optimizer, which your step could still \
             write: put back only after a trial that changed them (by a hash of their bits)",
            human_bytes(d.watched_bytes)
        ));
    }
    if let Some(warning) = &d.batch_warning {
        notes.push(warning.clone());
    }
    if let Some(p) = d.parameters {
        notes.push(format!("{p} parameters on {}", d.device));
    }
    if !d.optimizers_without_state.is_empty() {
        notes.push(format!(
            "{} had no state yet (no step has run): every trial started that way and made it \
             at its first step, as your loop's first step will; it is gone again",
            d.optimizers_without_state.join(", ")
        ));
    }
    if d.cuda {
        notes.push(format!(
            "torch.cuda.max_memory_allocated() and max_memory_reserved() on {} count again \
             from what you hold now: the trials reset them",
            d.device
        ));
    }
    if d.gpus.len() > 1 {
        notes.push(format!(
            "your model sits on {}, and the trials read the memory of {} only: an \
             out-of-memory error on any of them ends a trial as a failure, so the maximum did \
             run, but the search aimed by one card's figures and the memory shown is that card's",
            d.gpus.join(", "),
            prepared.memory.device
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_left_afterwards_names_pinned_host_memory_only_where_some_is_left() {
        let memory = |pinned| Memory {
            device: "cuda:0".into(),
            name: None,
            uuid: None,
            total: None,
            free: None,
            fraction: None,
            limit: None,
            allocated: Some(3 << 30),
            reserved: Some(4 << 30),
            pinned,
        };
        let module_step = Restored {
            step_fn: false,
            hooked: false,
        };
        let line = afterwards(&memory(Some(0)), module_step);
        assert!(
            line.ends_with("holds 3.00 GiB allocated, 4.00 GiB reserved"),
            "{line}"
        );
        assert_eq!(
            afterwards(&memory(None), module_step),
            line,
            "a torch that cannot tell"
        );
        let step_fn = Restored {
            step_fn: true,
            hooked: false,
        };
        let line = afterwards(&memory(Some(256 << 20)), step_fn);
        assert!(
            line.ends_with("reserved and 256 MiB of page-locked host memory"),
            "{line}"
        );
    }

    #[test]
    fn hooks_that_keep_state_are_named_in_the_line_on_what_was_put_back() {
        let line = |step_fn, hooked| Restored { step_fn, hooked }.line();
        assert!(!line(false, false).contains("hook"));
        assert!(!line(true, false).contains("hook"));
        assert!(
            line(false, true).contains("its optimizer, what its hooks and forwards keep and the"),
            "{}",
            line(false, true)
        );
        assert!(
            line(true, true).contains("it reaches, what your modules' hooks and forwards keep and"),
            "{}",
            line(true, true)
        );
        // Without hooks the lines read as they did before hooks were followed.
        assert!(line(true, false).contains("the objects it reaches and the variables it assigns"));
    }

    #[test]
    fn memory_outside_the_kernel_is_noted_from_the_figures_the_search_began_with() {
        const GIB: u64 = 1 << 30;
        let memory = |free: Option<u64>| Memory {
            device: "cuda:0".into(),
            name: None,
            // No GPU has this uuid: NVML, where there is one, names no process.
            uuid: Some("GPU-no-such-card".into()),
            total: Some(80 * GIB),
            free,
            fraction: Some(1.0),
            limit: free,
            allocated: Some(GIB / 4),
            reserved: Some(GIB / 2),
            pinned: None,
        };
        // 6 GiB free of 80: the rest is someone else's.
        let note = outside_note(1, &memory(Some(6 * GIB)), 6 * GIB).expect("a note");
        assert!(
            note.starts_with("73.5 GiB of this GPU's 80.0 GiB"),
            "{note}"
        );
        assert!(note.contains("began: the limit (6.00 GiB)"), "{note}");
        // The card to itself, or a torch that did not say what is free: nothing.
        assert_eq!(outside_note(1, &memory(Some(79 * GIB)), 79 * GIB), None);
        assert_eq!(outside_note(1, &memory(None), 6 * GIB), None);
    }

    #[test]
    fn the_models_own_loss_is_said_with_its_targets_and_why() {
        let own = OwnLoss {
            parameter: "targets".into(),
            targets: "ids < 500 shaped like the input".into(),
            returned: "output[1]".into(),
            reason: Some("without targets its forward returns output[0] [2, 1, 500]".into()),
        };
        assert_eq!(
            own_loss_text("gpt", &own),
            "the model's own: gpt(x, targets=...) returns it at output[1], targets ids < 500 \
             shaped like the input (without targets its forward returns output[0] [2, 1, 500])"
        );
    }

    #[test]
    fn a_returned_loss_is_used_alone_or_added_to_cross_entropy_on_the_scores_it_is_from() {
        use super::super::Loss;
        let returned = ReturnedLoss {
            returned: "output[0]".into(),
            itself: false,
            detached: false,
        };
        let ce = LossPlan::Ce {
            classes: 10,
            class_dim: -1,
        };
        let alone = Some(ReturnedUse::Alone);
        let of = |plan, asked| StepLoss::of(plan, Some(&returned), asked).returned;
        assert_eq!(
            of(LossPlan::Mse, None),
            alone,
            "a reconstruction's loss: MAE's"
        );
        assert_eq!(of(LossPlan::Mean, None), alone);
        assert_eq!(
            of(ce, None),
            Some(ReturnedUse::Added),
            "a z-loss beside the CE"
        );
        assert_eq!(of(ce, Some(Loss::Own)), alone);
        assert_eq!(
            of(LossPlan::Mse, Some(Loss::Mse)),
            None,
            "the loss asked for only"
        );
        assert_eq!(of(ce, Some(Loss::Ce)), None);
        assert_eq!(
            StepLoss::of(ce, None, None).returned,
            None,
            "nothing returned"
        );
        let detached = ReturnedLoss {
            detached: true,
            ..returned.clone()
        };
        assert_eq!(StepLoss::of(ce, Some(&detached), None).returned, alone);
    }

    #[test]
    fn scalars_left_out_of_the_loss_are_named() {
        assert_eq!(left_out_text(&[]), "");
        assert_eq!(
            left_out_text(&["output[1]".into()]),
            " (the scalar also returned at output[1] is not in it: an auxiliary loss, say, \
             which --step FN sizes in a loop that adds it)"
        );
        assert!(left_out_text(&["output[1]".into(), "output[2]".into()])
            .starts_with(" (the scalars also returned at output[1], output[2] are not in it"));
    }

    #[test]
    fn a_batch_not_first_is_said_with_the_layer_that_put_it_there() {
        assert_eq!(batch_dim_text(0, None), "");
        let text = batch_dim_text(1, Some("lm.rnn (LSTM, batch_first=False)"));
        assert!(
            text.starts_with(", the batch on dim 1 of the input, as lm.rnn (LSTM"),
            "{text}"
        );
        assert!(text.contains("--batch-dim 0"), "{text}");
        assert_eq!(
            batch_dim_text(2, None),
            ", the batch on dim 2 of the input (--batch-dim)"
        );
    }

    #[test]
    fn an_interrupt_raised_in_the_python_kernel_is_the_users_interrupt() {
        let raised = CallError::Eval(EvalError::Raised {
            ename: "KeyboardInterrupt".into(),
            evalue: String::new(),
        });
        assert_eq!(raised.into_magic().ename, "KeyboardInterrupt");
        let other = CallError::Eval(EvalError::Raised {
            ename: "RuntimeError".into(),
            evalue: "boom".into(),
        });
        assert_eq!(other.into_magic().ename, "MaxBatchError");
    }

    #[test]
    fn an_interrupt_that_lands_outside_a_step_stops_the_search_as_an_interrupt() {
        let raised = CallError::Eval(EvalError::Raised {
            ename: "KeyboardInterrupt".into(),
            evalue: String::new(),
        });
        assert_eq!(trial_stop(raised, 64), Stop::Cancelled);
        assert_eq!(stop_error(Stop::Cancelled).ename, "KeyboardInterrupt");
        let other = CallError::Eval(EvalError::Raised {
            ename: "RuntimeError".into(),
            evalue: "boom".into(),
        });
        assert!(matches!(trial_stop(other, 64), Stop::Failed(why) if why.contains("batch 64")));
    }

    #[test]
    fn the_recommendation_steps_down_by_multiples_of_eight() {
        let tried: Vec<u64> = Candidates::from(search::recommend(76, 0.05))
            .take(CONFIRM_TRIES)
            .collect();
        assert_eq!(tried, vec![72, 64, 56]);
        let small: Vec<u64> = Candidates::from(search::recommend(10, 0.05)).collect();
        assert_eq!(small, (1..=9).rev().collect::<Vec<_>>());
        // 17..=23 step to 16, not 8 below themselves.
        assert_eq!(Candidates { next: Some(23) }.nth(1), Some(16));
    }

    #[test]
    fn the_room_for_a_stranded_block_comes_from_trials_that_all_measured_one() {
        let record = |batch, largest_block| Record {
            batch,
            ms: 1.0,
            steps: 2,
            reserved: None,
            largest_block,
        };
        let gb = 1_000_000_000u64;
        let fitted = [
            (record(4, Some(gb / 4)), 3 * gb),
            (record(232, Some(15 * gb)), 74 * gb),
        ];
        let room = room_for_a_stranded_block(&fitted, 81 * gb).expect("room");
        assert!(
            room.largest_batch < 232 && room.largest_batch > 200,
            "{room:?}"
        );
        // A trial under expandable segments (no block): no room, the margin alone.
        let expandable = [fitted[0], (record(232, None), 74 * gb)];
        assert_eq!(room_for_a_stranded_block(&expandable, 81 * gb), None);
    }

    /// `prepare`'s reply on cuda:0 with these GPUs and uncopied (fixed) weight bytes.
    fn prepared(gpus: &str, fixed_bytes: u64) -> Prepared {
        serde_json::from_str(&format!(
            r#"{{"describe": {{"device": "cuda:0", "cuda": true, "snapshot_bytes": 0,
                "fixed_bytes": {fixed_bytes}, "optimizer": "a new AdamW (lr 1e-3)",
                "parameters": 10, "torch": "2.11.0", "gpus": {gpus}}},
               "memory": {{"device": "cuda:0"}}, "output": null}}"#
        ))
        .expect("a prepare reply")
    }

    #[test]
    fn weights_the_step_cannot_change_are_told_as_not_copied() {
        let lora = notes(&prepared(r#"["cuda:0"]"#, 14 << 30));
        assert!(
            lora.contains(
                &"14.0 GiB of weights the step cannot change (frozen, in no optimizer, or all \
                  of them with --inference) were not copied"
                    .to_string()
            ),
            "{lora:?}"
        );
        let none = notes(&prepared(r#"["cuda:0"]"#, 0));
        assert!(!none.iter().any(|n| n.contains("not copied")), "{none:?}");
    }

    #[test]
    fn frozen_weights_a_step_function_could_write_are_told_as_put_back_when_changed() {
        let mut lora = prepared(r#"["cuda:0"]"#, 0);
        lora.describe.snapshot_bytes = 14 << 30;
        lora.describe.watched_bytes = 13 << 30;
        let told = notes(&lora);
        assert!(
            told.contains(
                &"13.0 GiB of that are frozen weights in no optimizer, which your step could \
                  still write: put back only after a trial that changed them (by a hash of \
                  their bits)"
                    .to_string()
            ),
            "{told:?}"
        );
        let none = notes(&prepared(r#"["cuda:0"]"#, 0));
        assert!(
            !none.iter().any(|n| n.contains("frozen weights")),
            "{none:?}"
        );
    }

    #[test]
    fn an_output_held_into_the_next_forward_is_a_note_where_it_is_a_sample_or_more() {
        // nanoGPT's logits on an H100 (maxbatch-truth-2026-12-06): 206 MB a sample, the step
        // about 1.2 GB a sample, 15 fitted where a loop dropping the logits fitted 17.
        let note = held_output_note(206_045_184, 15, 1.25e9, false).expect("a note");
        assert!(note.contains("196 MiB a sample (2.88 GiB at 15)"), "{note}");
        assert!(note.contains("about 2 samples' worth more room"), "{note}");
        assert!(note.contains("--drops-output sizes such a loop"), "{note}");
        // Asked to size a loop that drops it: the same bytes, said the other way round.
        let dropped = held_output_note(206_045_184, 15, 1.25e9, true).expect("a note");
        assert!(dropped.starts_with("--drops-output: each step's output, 196 MiB a sample"));
        assert!(
            dropped.contains("about 2 samples' worth less room"),
            "{dropped}"
        );
        // A ResNet-50's thousand scores a sample, against its 100 MB a sample: nothing to say.
        assert_eq!(held_output_note(4000, 2000, 1e8, false), None);
        assert_eq!(held_output_note(206_045_184, 15, 0.0, false), None);
        // A denoiser's images (maxbatch-truth-2026-12-06e): 2 samples of 583; a masked
        // autoencoder's prediction (-06n): 4 of 557, which came to 17 in its loop; a
        // deep-supervised UNet's maps: 20 of 513.
        let images = held_output_note(196_608, 583, 4.0e7, false).expect("a note");
        assert!(images.contains("about 2 samples' worth"), "{images}");
        let pred = held_output_note(301_840, 557, 4.04e7, false).expect("a note");
        assert!(pred.contains("about 4 samples' worth"), "{pred}");
        assert!(pred.contains("from none to four times"), "{pred}");
        let maps = held_output_note(1_720_320, 513, 4.3e7, false).expect("a note");
        assert!(maps.contains("about 20 samples' worth"), "{maps}");
        // That run's trials: 4 and 15 ran, 16 did not; 8 between.
        let trial = |batch, peak: Option<u64>| search::Trial {
            batch,
            outcome: peak.map_or(Outcome::OutOfMemory { peak: None }, |peak| Outcome::Ran {
                peak,
                reserved: 0,
                phases: None,
            }),
            fits: peak.is_some(),
        };
        let trials = [
            trial(4, Some(7_321_902_080)),
            trial(16, None),
            trial(8, Some(13_044_833_280)),
            trial(15, Some(23_167_245_312)),
        ];
        let step = step_sample_bytes(&trials).expect("two batches ran");
        assert!((step - 1.4405e9).abs() < 1e6, "{step}");
        assert_eq!(step_sample_bytes(&trials[..2]), None);
    }

    #[test]
    fn a_layer_that_mixes_the_samples_of_a_batch_is_a_note() {
        let mut p = prepared(r#"["cuda:0"]"#, 0);
        assert!(!notes(&p).iter().any(|n| n.contains("attends across")));
        p.describe.batch_warning = Some("vit.encoder (...) attends across the samples".into());
        assert!(notes(&p).contains(&"vit.encoder (...) attends across the samples".to_string()));
    }

    #[test]
    fn a_model_split_over_gpus_is_told_which_card_the_trials_read() {
        let split = notes(&prepared(r#"["cuda:0", "cuda:1"]"#, 0));
        assert!(
            split.iter().any(|n| n.starts_with(
                "your model sits on cuda:0, cuda:1, and the trials read the memory of cuda:0 only"
            )),
            "{split:?}"
        );
        let whole = notes(&prepared(r#"["cuda:0"]"#, 0));
        assert!(!whole.iter().any(|n| n.contains("sits on")), "{whole:?}");
    }

    #[test]
    fn the_peak_counters_the_trials_reset_are_told_on_a_gpu_only() {
        let mut p = prepared(r#"["cuda:0"]"#, 0);
        assert!(notes(&p).contains(
            &"torch.cuda.max_memory_allocated() and max_memory_reserved() on cuda:0 count \
              again from what you hold now: the trials reset them"
                .to_string()
        ));
        p.describe.cuda = false;
        assert!(!notes(&p).iter().any(|n| n.contains("max_memory_allocated")));
    }

    fn reply(text: &str) -> TrialReply {
        serde_json::from_str(text).expect("a trial reply")
    }

    #[test]
    fn trial_replies_become_outcomes() {
        let ran = reply(
            r#"{"batch": 4, "result": "ran", "ms": 3.0, "peak_allocated": 900, "peak_reserved": 1000}"#,
        );
        assert_eq!(
            outcome(&ran, 4, 100),
            Ok(Outcome::Ran {
                peak: 900,
                reserved: 1000,
                phases: None,
            })
        );
        let split = reply(
            r#"{"batch": 4, "result": "ran", "ms": 3.0, "peak_allocated": 900,
                "phase_peaks": {"outside": 700, "optimizer": 900}}"#,
        );
        assert_eq!(
            outcome(&split, 4, 100),
            Ok(Outcome::Ran {
                peak: 900,
                reserved: 0,
                phases: Some(PhasePeaks {
                    outside: 700,
                    optimizer: 900
                }),
            })
        );
        let oom = reply(
            r#"{"batch": 4, "result": "out_of_memory", "ms": 3.0, "message": "CUDA out of memory"}"#,
        );
        assert_eq!(outcome(&oom, 4, 0), Ok(Outcome::OutOfMemory { peak: None }));
        // The peak it reached before it ran out is recorded with the trial.
        let oom =
            reply(r#"{"batch": 4, "result": "out_of_memory", "ms": 3.0, "peak_allocated": 800}"#);
        assert_eq!(
            outcome(&oom, 4, 0),
            Ok(Outcome::OutOfMemory { peak: Some(800) })
        );
        let stop = reply(r#"{"batch": 4, "result": "interrupted", "ms": 3.0}"#);
        assert_eq!(outcome(&stop, 4, 0), Err(Stop::Cancelled));
    }

    #[test]
    fn a_failing_step_and_a_step_off_the_gpu_are_explained() {
        let failed = reply(
            r#"{"batch": 8, "result": "error", "ms": 1.0,
                "error": {"ename": "ValueError", "evalue": "bad shape", "where": "<cell>:3 in step"}}"#,
        );
        let Err(Stop::Failed(why)) = outcome(&failed, 8, 0) else {
            panic!("an error stops the search")
        };
        assert!(
            why.contains("ValueError: bad shape at batch 8 (<cell>:3 in step)"),
            "{why}"
        );
        // What to do, where the engine knows (a LightningModule's batch), ends the message.
        let hinted = reply(
            r#"{"batch": 8, "result": "error", "ms": 1.0,
                "error": {"ename": "TypeError", "evalue": "bad batch", "where": null,
                          "hint": "Write FN(batch_size)"}}"#,
        );
        let Err(Stop::Failed(why)) = outcome(&hinted, 8, 0) else {
            panic!("an error stops the search")
        };
        assert!(
            why.ends_with("bad batch at batch 8; your state was put back. Write FN(batch_size)"),
            "{why}"
        );
        let idle = reply(r#"{"batch": 4, "result": "ran", "ms": 1.0, "peak_allocated": 100}"#);
        let Err(Stop::Failed(why)) = outcome(&idle, 4, 100) else {
            panic!("no GPU memory is an error")
        };
        assert!(why.contains("allocated no GPU memory"), "{why}");
    }

    #[test]
    fn refusals_are_told_apart_from_answers() {
        let r: Reply<TrialReply> =
            serde_json::from_str(r#"{"refused": "x is not defined in this notebook"}"#).unwrap();
        assert!(matches!(r, Reply::Refused { .. }));
        let r: Reply<TrialReply> = serde_json::from_str(
            r#"{"batch": 2, "result": "error", "ms": 1.0, "error": {"ename": "E", "evalue": "v", "where": null}}"#,
        )
        .unwrap();
        assert!(matches!(r, Reply::Served(_)));
    }
}
