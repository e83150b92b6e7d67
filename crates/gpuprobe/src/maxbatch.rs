//! `%maxbatch` on libtorch (feature `torch`): real training steps of a model at trial batch
//! sizes, their peak memory read from the caching allocator, driven by [`crate::search`].
//!
//! Every trial starts from the same state: a freshly built model with no gradients or optimizer
//! state, an emptied cache and reset peak counters. It then runs three steps, so the later ones
//! see the gradients, optimizer state and split blocks the first left behind, as every later
//! training step does. An OOM is recognised by the allocator's own `num_ooms` counter going
//! up, not by the error's text.
//!
//! The fit uses each trial's peak *allocated* bytes, which grow in a straight line with the
//! batch; the cache's reserved peak does not near the limit (the allocator frees cached blocks
//! and retries before it gives up), so it misleads a fit. What the cache needs beyond the
//! allocated bytes shows up as the OOM boundary, which the search brackets. `--limit` caps
//! the allocator itself (`set_per_process_memory_fraction`), so a smaller card is reproduced
//! with its real OOMs, not estimated.

use crate::allocator;
use crate::loss::{self, LossInputs, LossPlan};
use crate::output::{NoLossTensor, Output};
use crate::plugin_api::{
    FreeAtStart, MaxBatchReport, MaxBatchRequest, ModelSource, OptimizerKind, Precision,
    StepsReport, ThroughputPoint, BUILTIN_MODELS,
};
use crate::search::{self, Outcome, SearchConfig, Stop};
use crate::stranded;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};

/// Why a libtorch trial, or the search around it, could not go on.
#[derive(Debug, thiserror::Error)]
pub enum TrialError {
    /// Something in the request the user can change; the message says what.
    #[error("{0}")]
    Request(String),
    #[error("{}", torch_text(.0))]
    Torch(#[from] tch::TchError),
    #[error(transparent)]
    Allocator(#[from] allocator::AllocatorError),
    #[error(transparent)]
    Loss(#[from] loss::LossError),
    #[error(transparent)]
    Output(#[from] NoLossTensor),
    /// libtorch panicked (tch panics on a failed op): its message.
    #[error("{0}")]
    Panicked(String),
    #[error("no CUDA device is visible to libtorch")]
    NoCuda,
    #[error(
        "the trial at batch {batch} ran past {limit_s:.0} s (--trial-timeout) after {done} \
         step(s); the libtorch engine stops between steps"
    )]
    TimedOut {
        batch: u64,
        limit_s: f64,
        done: usize,
    },
}

/// A libtorch error as a user reads it. An op that fails inside a TorchScript module comes
/// with both of TorchScript's tracebacks (dozens of lines); the exception itself is the last
/// line, so that line is what the message keeps.
fn torch_text(err: &tch::TchError) -> String {
    let text = err.to_string();
    const SCRIPTED: &str = "The following operation failed in the TorchScript interpreter.";
    if !text.contains(SCRIPTED) {
        return text;
    }
    match text.lines().rev().map(str::trim).find(|l| !l.is_empty()) {
        Some(last) => format!("{last} (in the TorchScript module's forward)"),
        None => text,
    }
}

impl TrialError {
    fn request(message: impl Into<String>) -> Self {
        TrialError::Request(message.into())
    }
}

/// A model we can train a step of.
enum Model {
    Builtin(Box<dyn ModuleT>),
    Script(tch::CModule),
}

impl Model {
    fn forward(&self, x: &Tensor, train: bool) -> Result<Output, TrialError> {
        match self {
            Model::Builtin(m) => Ok(Output::single(m.forward_t(x, train))),
            // A dict or tuple of tensors (torchvision's segmentation models, Inception's
            // aux_logits) as well as a tensor: selected as the python engine selects.
            Model::Script(m) => Ok(Output::select(
                m.forward_is(&[tch::IValue::Tensor(x.shallow_clone())])?,
            )?),
        }
    }
}

/// The per-sample input shape a built-in model expects.
fn default_input(name: &str) -> Vec<i64> {
    match name {
        "inception_v3" => vec![3, 299, 299],
        n if n.starts_with("dinov2") => vec![3, 224, 224],
        _ => vec![3, 224, 224],
    }
}

fn builtin(name: &str, p: &nn::Path) -> Option<Box<dyn ModuleT>> {
    use tch::vision::*;
    const C: i64 = 1000;
    Some(match name {
        "resnet18" => Box::new(resnet::resnet18(p, C)),
        "resnet34" => Box::new(resnet::resnet34(p, C)),
        "resnet50" => Box::new(resnet::resnet50(p, C)),
        "resnet101" => Box::new(resnet::resnet101(p, C)),
        "resnet152" => Box::new(resnet::resnet152(p, C)),
        "vgg11" => Box::new(vgg::vgg11(p, C)),
        "vgg13" => Box::new(vgg::vgg13(p, C)),
        "vgg16" => Box::new(vgg::vgg16(p, C)),
        "vgg19" => Box::new(vgg::vgg19(p, C)),
        "densenet121" => Box::new(densenet::densenet121(p, C)),
        "densenet161" => Box::new(densenet::densenet161(p, C)),
        "densenet169" => Box::new(densenet::densenet169(p, C)),
        "densenet201" => Box::new(densenet::densenet201(p, C)),
        "efficientnet_b0" => Box::new(efficientnet::b0(p, C)),
        "efficientnet_b1" => Box::new(efficientnet::b1(p, C)),
        "efficientnet_b2" => Box::new(efficientnet::b2(p, C)),
        "efficientnet_b3" => Box::new(efficientnet::b3(p, C)),
        "efficientnet_b4" => Box::new(efficientnet::b4(p, C)),
        "efficientnet_b5" => Box::new(efficientnet::b5(p, C)),
        "efficientnet_b6" => Box::new(efficientnet::b6(p, C)),
        "efficientnet_b7" => Box::new(efficientnet::b7(p, C)),
        "mobilenet_v2" => Box::new(mobilenet::v2(p, C)),
        "inception_v3" => Box::new(inception::v3(p, C)),
        "convmixer_1536_20" => Box::new(convmixer::c1536_20(p, C)),
        "convmixer_1024_20" => Box::new(convmixer::c1024_20(p, C)),
        _ => return None,
    })
}

fn kind(precision: Option<Precision>) -> Kind {
    match precision {
        Some(Precision::Bf16) => Kind::BFloat16,
        Some(Precision::Fp16) => Kind::Half,
        None => Kind::Float,
    }
}

/// A model on a device with its optimizer, ready for trial steps.
struct Trainer {
    model: Model,
    vs: Option<nn::VarStore>,
    optimizer: Option<tch::COptimizer>,
    device: Device,
    input: Vec<i64>,
    vocab: Option<i64>,
    dtype: Kind,
    amp: Option<Precision>,
    inference: bool,
    /// The loss of a training step, planned from the output of a batch of 2.
    loss: Option<LossPlan>,
    /// What that loss is computed on, where the model returns several tensors.
    loss_inputs: Option<LossInputs>,
    /// A trial stops at its next step once it has run this long.
    deadline: Option<std::time::Duration>,
    /// The last step's output, kept as a user's loop keeps `out = model(x)`: alive through
    /// its backward pass and optimizer step, and through the next forward pass until that
    /// one's output replaces it. For a language model that is a logits tensor per sample
    /// (65 MB at 512 tokens x 32k vocab in fp32) that the peak includes; dropped right after
    /// the loss, the engine's answer came out 15% above the user's loop (maxbatch-truth-2026-12-03).
    last_output: Option<Output>,
    /// The running trial's peaks, apart inside the optimizer's step and outside it (CUDA only).
    peaks: Option<TrialPeaks>,
}

impl Trainer {
    fn new(request: &MaxBatchRequest, device: Device) -> Result<Self, TrialError> {
        if request.amp.is_some() && request.dtype.is_some() {
            return Err(TrialError::request(
                "--amp keeps fp32 weights and autocasts the forward pass; \
                 it does not combine with --dtype",
            ));
        }
        let dtype = kind(request.dtype);
        let (model, vs, input) = match &request.model {
            ModelSource::Builtin { name } => {
                let mut vs = nn::VarStore::new(device);
                let model = builtin(name, &vs.root()).ok_or_else(|| {
                    TrialError::Request(format!(
                        "unknown model {name:?}; built-ins: {}",
                        BUILTIN_MODELS.join(", ")
                    ))
                })?;
                if dtype != Kind::Float {
                    vs.set_kind(dtype);
                }
                let input = request.input.clone().unwrap_or_else(|| default_input(name));
                (Model::Builtin(model), Some(vs), input)
            }
            ModelSource::TorchScript { path } => {
                let mut module = tch::CModule::load_on_device(path, device)?;
                if dtype != Kind::Float {
                    module.to(device, dtype, false);
                }
                // A module saved in eval mode would otherwise skip dropout and keep BatchNorm's
                // statistics fixed: training steps must run as training does.
                if request.inference {
                    module.set_eval();
                } else {
                    module.set_train();
                }
                let input = request.input.clone().ok_or_else(|| {
                    TrialError::request(
                        "a TorchScript model needs --input SHAPE (the shape of one sample)",
                    )
                })?;
                (Model::Script(module), None, input)
            }
        };
        let mut trainer = Trainer {
            model,
            vs,
            optimizer: None,
            device,
            input,
            vocab: request.vocab,
            dtype,
            amp: request.amp,
            inference: request.inference,
            loss: None,
            loss_inputs: None,
            deadline: request
                .trial_timeout_s
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(std::time::Duration::from_secs_f64),
            last_output: None,
            peaks: None,
        };
        if !request.inference {
            let (plan, inputs) = trainer.plan_loss(request)?;
            trainer.loss = Some(plan);
            trainer.loss_inputs = Some(inputs);
            trainer.optimizer = trainer.make_optimizer(request.optimizer)?;
        }
        Ok(trainer)
    }

    /// The loss for this model's output (see [`crate::loss`]) and what it is computed on,
    /// from a forward pass of two samples without gradients.
    fn plan_loss(&self, request: &MaxBatchRequest) -> Result<(LossPlan, LossInputs), TrialError> {
        let (shape, inputs, like_input) = {
            let _guard = tch::no_grad_guard();
            let x = self.batch_input(2)?;
            let y = catch_unwind(AssertUnwindSafe(|| self.forward(&x, true))).map_err(|_| {
                TrialError::request("the model's forward pass failed: check --input")
            })??;
            let inputs = LossInputs {
                selected: y.selected.clone(),
                heads: y.head_names(),
                scalars: y.scalars.clone(),
            };
            // The input again, sample for sample, maybe flattened: a reconstruction.
            let like_input = self.vocab.is_none()
                && y.main.dim() >= 2
                && y.main.size().first() == x.size().first()
                && y.main.numel() == x.numel();
            (y.main.size(), inputs, like_input)
        };
        let plan = loss::plan(
            &shape,
            request.loss,
            request.target_classes,
            self.vocab,
            like_input,
        )?;
        Ok((plan, inputs))
    }

    /// The planned loss of the selected output, summed over its heads.
    fn loss_on(&self, output: &Output) -> Result<Tensor, TrialError> {
        let mut loss = self.loss_of(&output.main)?;
        for (_, head) in &output.heads {
            loss = loss.f_add(&self.loss_of(head)?)?;
        }
        Ok(loss)
    }

    /// The loss of `y` as planned: random targets of the right shape.
    fn loss_of(&self, y: &Tensor) -> Result<Tensor, TrialError> {
        match self.loss.unwrap_or(LossPlan::Mean) {
            LossPlan::Ce { classes, class_dim } => {
                let size = y.size();
                let device = y.device();
                // Below the tensor's own class count (a head's may differ from the main
                // output's): out of range is a device-side assert, fatal to the CUDA context.
                let own = if class_dim == 1 && size.len() > 2 {
                    size[1]
                } else {
                    size.last().copied().unwrap_or(1)
                };
                let classes = classes.min(own).max(1);
                if class_dim == 1 && size.len() > 2 {
                    let mut target_shape = vec![size[0]];
                    target_shape.extend(&size[2..]);
                    let target =
                        Tensor::f_randint(classes, target_shape.as_slice(), (Kind::Int64, device))?;
                    y.f_cross_entropy_loss::<Tensor>(&target, None, Reduction::Mean, -100, 0.0)
                        .map_err(TrialError::from)
                } else {
                    let last = size.last().copied().unwrap_or(1);
                    let flat = y.f_reshape([-1, last])?;
                    let n = flat.size()[0];
                    let target = Tensor::f_randint(classes, [n], (Kind::Int64, device))?;
                    flat.f_cross_entropy_loss::<Tensor>(&target, None, Reduction::Mean, -100, 0.0)
                        .map_err(TrialError::from)
                }
            }
            LossPlan::Mse => {
                let target = y.f_randn_like()?;
                y.f_mse_loss(&target, Reduction::Mean)
                    .map_err(TrialError::from)
            }
            LossPlan::Mean => y.f_mean(Kind::Float).map_err(TrialError::from),
        }
    }

    fn parameters(&self) -> Vec<Tensor> {
        match (&self.vs, &self.model) {
            (Some(vs), _) => vs.trainable_variables(),
            (None, Model::Script(m)) => m
                .named_parameters()
                .map(|ps| ps.into_iter().map(|(_, t)| t).collect())
                .unwrap_or_default(),
            (None, Model::Builtin(_)) => Vec::new(),
        }
    }

    fn make_optimizer(&self, kind: OptimizerKind) -> Result<Option<tch::COptimizer>, TrialError> {
        let mut optimizer = match kind {
            OptimizerKind::None => return Ok(None),
            OptimizerKind::Sgd => tch::COptimizer::sgd(1e-3, 0.9, 0.0, 0.0, false),
            OptimizerKind::Adam => tch::COptimizer::adam(1e-3, 0.9, 0.999, 0.0, 1e-8, false),
            OptimizerKind::Adamw => tch::COptimizer::adamw(1e-3, 0.9, 0.999, 0.01, 1e-8, false),
        }?;
        for p in self.parameters() {
            optimizer.add_parameters(&p, 0)?;
        }
        Ok(Some(optimizer))
    }

    fn batch_input(&self, batch: u64) -> Result<Tensor, TrialError> {
        let mut shape = vec![batch as i64];
        shape.extend(&self.input);
        match self.vocab {
            Some(vocab) => Tensor::f_randint(vocab, shape.as_slice(), (Kind::Int64, self.device)),
            None => Tensor::f_randn(shape.as_slice(), (self.dtype, self.device)),
        }
        .map_err(TrialError::from)
    }

    /// One full step: forward, and unless `inference`, backward and the optimizer's update.
    /// The optimizer state is allocated by a real step, so it counts in the fixed part.
    /// The forward pass, autocast with `--amp`. Autocast covers the forward pass only, as
    /// torch.autocast is used in training loops: backward runs in the dtypes it chose.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Output, TrialError> {
        let _amp = self.autocast()?;
        self.model.forward(x, train)
    }

    fn autocast(&self) -> Result<Option<allocator::Autocast>, TrialError> {
        match self.amp {
            Some(p) => allocator::Autocast::enter(self.device.is_cuda(), p == Precision::Bf16)
                .map(Some)
                .map_err(TrialError::from),
            None => Ok(None),
        }
    }

    /// Forward and loss under autocast, as `with torch.autocast(...)` around both in a
    /// training loop: cross-entropy then runs its softmax in fp32, as autocast decides.
    fn forward_loss(&mut self, x: &Tensor) -> Result<Tensor, TrialError> {
        let _amp = self.autocast()?;
        let y = self.model.forward(x, true)?;
        // Replaces (frees) the previous output only now that this one exists.
        self.last_output = Some(y.shallow_clone());
        self.loss_on(&y)
    }

    fn step(&mut self, batch: u64) -> Result<(), TrialError> {
        let x = self.batch_input(batch)?;
        if self.inference {
            let _guard = tch::no_grad_guard();
            drop(self.forward(&x, false)?);
            return Ok(());
        }
        let loss = self.forward_loss(&x)?;
        loss.f_backward()?;
        if let Some(optimizer) = &mut self.optimizer {
            if let Some(peaks) = &mut self.peaks {
                peaks.switch(true)?;
            }
            optimizer.step()?;
            if let Some(peaks) = &mut self.peaks {
                peaks.switch(false)?;
            }
            optimizer.zero_grad()?;
        } else {
            for p in self.parameters() {
                let mut grad = p.grad();
                if grad.defined() {
                    let _ = grad.f_zero_();
                }
            }
        }
        Ok(())
    }
}

fn ooms(device: usize) -> i64 {
    allocator::device_stats(device)
        .map(|s| s.num_ooms)
        .unwrap_or(0)
}

use crate::plugin_api::STEPS_PER_TRIAL;

/// A trial's peaks from the allocator's counters, which are reset where the optimizer's step
/// begins and ends so that its update's peak is read apart from the forward and backward's
/// (the search fits a line to each: see `search::PhasePeaks`); the whole trial's peaks are
/// folded here across those resets.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct TrialPeaks {
    device: usize,
    inside: bool,
    stepped: bool,
    outside: u64,
    optimizer: u64,
    reserved: u64,
    active: u64,
    inactive_split: u64,
}

impl TrialPeaks {
    fn start(device: usize) -> Result<Self, TrialError> {
        allocator::reset_peak(device)?;
        Ok(Self {
            device,
            ..Self::default()
        })
    }

    /// Folds the counters' peaks since the last reset into the phase running until now.
    fn fold(&mut self) -> Result<(), TrialError> {
        let stats = allocator::device_stats(self.device)?;
        let peak = |s: &crate::plugin_api::Stat| s.peak.max(0) as u64;
        self.fold_peaks(
            peak(&stats.allocated_bytes),
            peak(&stats.reserved_bytes),
            peak(&stats.active_bytes),
            peak(&stats.inactive_split_bytes),
        );
        Ok(())
    }

    fn fold_peaks(&mut self, allocated: u64, reserved: u64, active: u64, inactive_split: u64) {
        let phase = if self.inside {
            &mut self.optimizer
        } else {
            &mut self.outside
        };
        *phase = (*phase).max(allocated);
        self.reserved = self.reserved.max(reserved);
        self.active = self.active.max(active);
        self.inactive_split = self.inactive_split.max(inactive_split);
    }

    /// Into the optimizer's step (`inside`) or out of it.
    fn switch(&mut self, inside: bool) -> Result<(), TrialError> {
        self.fold()?;
        allocator::reset_peak(self.device)?;
        self.enter(inside);
        Ok(())
    }

    /// The phase the counters count from now on.
    fn enter(&mut self, inside: bool) {
        self.inside = inside;
        self.stepped |= inside;
    }

    fn allocated(&self) -> u64 {
        self.outside.max(self.optimizer)
    }

    fn phases(&self) -> Option<search::PhasePeaks> {
        self.stepped.then_some(search::PhasePeaks {
            outside: self.outside,
            optimizer: self.optimizer,
        })
    }
}

/// What one trial measured.
struct TrialRun {
    /// Peak allocated bytes when the steps ran.
    outcome: Outcome,
    /// The cache's reserved peak (what the device had to hold).
    reserved_peak: u64,
    /// Peaks of the blocks in use and of the free pieces of split blocks (which the cache
    /// cannot give back while the rest of their segment is in use).
    active_peak: u64,
    inactive_split_peak: u64,
    ms: f64,
}

/// Runs `steps` steps at `batch` after resetting the peak counters; an OOM by the counter.
/// With `fresh`, the cache is emptied first so each search trial starts from the same state;
/// repeated training steps keep it, as real training does (fragmentation included).
fn trial(
    trainer: &mut Trainer,
    device: usize,
    batch: u64,
    steps: usize,
    fresh: bool,
) -> Result<TrialRun, TrialError> {
    if fresh {
        let _ = allocator::empty_cache();
    }
    trainer.peaks = Some(TrialPeaks::start(device)?);
    let before = ooms(device);
    let start = Instant::now();
    // tch panics on a failed op (an OOM among them); keep those out of the kernel's log.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = catch_unwind(AssertUnwindSafe(|| {
        (0..steps).try_for_each(|done| match trainer.deadline {
            Some(limit) if done > 0 && start.elapsed() > limit => Err(TrialError::TimedOut {
                batch,
                limit_s: limit.as_secs_f64(),
                done,
            }),
            _ => trainer.step(batch),
        })
    }));
    std::panic::set_hook(hook);
    if trainer.device.is_cuda() {
        let _ = catch_unwind(|| tch::Cuda::synchronize(device as i64));
    }
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    let oom = ooms(device) > before;
    let peaks = trainer.peaks.take();
    match result {
        _ if oom => Ok(TrialRun {
            // Its peak before it ran out, recorded with the trial (`Outcome::OutOfMemory`).
            outcome: Outcome::OutOfMemory {
                peak: peaks.and_then(|mut p| p.fold().ok().map(|()| p.allocated())),
            },
            reserved_peak: 0,
            active_peak: 0,
            inactive_split_peak: 0,
            ms,
        }),
        Ok(Ok(())) => {
            let mut peaks = peaks.unwrap_or(TrialPeaks {
                device,
                ..TrialPeaks::default()
            });
            peaks.fold()?;
            Ok(TrialRun {
                outcome: Outcome::Ran {
                    peak: peaks.allocated(),
                    reserved: peaks.reserved,
                    phases: peaks.phases(),
                },
                reserved_peak: peaks.reserved,
                active_peak: peaks.active,
                inactive_split_peak: peaks.inactive_split,
                ms,
            })
        }
        Ok(Err(e)) => Err(e),
        Err(panic) => Err(TrialError::Panicked(
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "libtorch failed".into()),
        )),
    }
}

/// The memory the allocator may use on `device` for a request: with `--limit`, the card's
/// size less this process's CUDA context; for a notebook module, the notebook allocator's own
/// budget; enforced on the allocator for as long as this lives (restored on drop, also after
/// an error). Otherwise the device as it is.
struct Budget {
    device: usize,
    bytes: u64,
    context: Option<u64>,
    capped: bool,
    /// Where free memory set the budget: what was free and what this process's cache held.
    from_free: Option<FreeAtStart>,
}

impl Budget {
    /// Call with the model built, so the context exists and the weights count.
    fn new(request: &MaxBatchRequest) -> Result<Self, TrialError> {
        let device = request.device;
        let stats = allocator::device_stats(device)?;
        let reserved = stats.reserved_bytes.current.max(0) as u64;
        let available = reserved.saturating_add(stats.free);
        let Some(card) = request.limit else {
            let Some(budget) = request.allocator_budget.filter(|&b| b < available) else {
                return Ok(Self {
                    device,
                    bytes: available,
                    context: None,
                    capped: false,
                    from_free: Some(FreeAtStart {
                        free: stats.free,
                        reserved,
                    }),
                });
            };
            return Self::capped(device, budget, None, stats.total);
        };
        // Only a card size needs the context taken off (an NVML query).
        let context = own_context_bytes(reserved);
        let bytes = card.saturating_sub(context.unwrap_or(0));
        if bytes > available {
            return Err(TrialError::Request(format!(
                "--limit {} is more than this GPU can give (it has {} free besides the {} \
                 this process holds); use a smaller --limit or free the GPU",
                crate::units::human_bytes(card),
                crate::units::human_bytes(stats.free),
                crate::units::human_bytes(reserved)
            )));
        }
        Self::capped(device, bytes, context, stats.total)
    }

    /// The allocator capped at `bytes` of the device's `total`.
    fn capped(
        device: usize,
        bytes: u64,
        context: Option<u64>,
        total: u64,
    ) -> Result<Self, TrialError> {
        if total == 0 {
            return Err(TrialError::request("the device reports no memory size"));
        }
        allocator::set_memory_fraction(device, bytes as f64 / total as f64)?;
        Ok(Self {
            device,
            bytes,
            context,
            capped: true,
            from_free: None,
        })
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        if self.capped {
            let _ = allocator::set_memory_fraction(self.device, 1.0);
        }
    }
}

/// This process's CUDA context: its memory on the GPU as NVML sees it, less what the caching
/// allocator reserved. `None` where NVML does not list this process (no driver access, or a
/// PID namespace that hides it).
fn own_context_bytes(reserved: u64) -> Option<u64> {
    let nvml = crate::nvml::Nvml::open().ok()?;
    let snapshot = nvml.snapshot().ok()?;
    let pid = std::process::id();
    let used: u64 = snapshot
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter())
        .filter(|p| p.pid == pid)
        .filter_map(|p| p.used_memory)
        .sum();
    (used > 0).then(|| used.saturating_sub(reserved))
}

/// TorchScript's graph executor off for this thread while it lives: the module then runs op
/// by op as eager PyTorch does. Optimised, the executor profiles and re-specialises (and may
/// fuse and compile) for every new input shape, which is every trial here: slow, worst under
/// autocast, and its differentiable subgraphs keep other tensors for backward than eager.
struct Interpreted;

impl Interpreted {
    fn enter() -> Self {
        let _ = tch::jit::f_set_graph_executor_optimize(false);
        Self
    }
}

impl Drop for Interpreted {
    fn drop(&mut self) {
        let _ = tch::jit::f_set_graph_executor_optimize(true);
    }
}

/// Runs `count` steps at `batch` on `setup.device`, stopping at the first OOM.
pub fn steps(setup: &MaxBatchRequest, batch: u64, count: u32) -> Result<StepsReport, TrialError> {
    let _interpreted = Interpreted::enter();
    let device = setup.device;
    let mut trainer = Trainer::new(setup, Device::Cuda(device))?;
    let budget = Budget::new(setup)?;
    let mut peak = 0u64;
    let mut ran = 0u32;
    let mut oom = false;
    for _ in 0..count {
        match trial(&mut trainer, device, batch, 1, false)?.outcome {
            Outcome::Ran { reserved, .. } => {
                peak = peak.max(reserved);
                ran += 1;
            }
            Outcome::OutOfMemory { .. } => {
                oom = true;
                break;
            }
        }
    }
    drop(trainer);
    drop(budget);
    let _ = allocator::empty_cache();
    let after = allocator::device_stats(device)?;
    Ok(StepsReport {
        steps_run: ran,
        out_of_memory: oom,
        peak,
        after_allocated: after.allocated_bytes.current,
    })
}

/// Samples per second at each batch: two warm-up steps (cuDNN picks its algorithms, the
/// cache fills), then `count` timed steps, each batch from a fresh model.
pub fn throughput(
    setup: &MaxBatchRequest,
    batches: &[u64],
    count: u32,
    progress: &dyn Fn(&str) -> bool,
) -> Result<Vec<ThroughputPoint>, TrialError> {
    if !tch::Cuda::is_available() {
        return Err(TrialError::NoCuda);
    }
    let _interpreted = Interpreted::enter();
    let device = setup.device;
    let mut points = Vec::new();
    for &batch in batches {
        let mut trainer = Trainer::new(setup, Device::Cuda(device))?;
        let budget = Budget::new(setup)?;
        let warm = trial(&mut trainer, device, batch, 2, true)?;
        let timed = match warm.outcome {
            Outcome::Ran { .. } => Some(trial(&mut trainer, device, batch, count as usize, false)?),
            Outcome::OutOfMemory { .. } => None,
        };
        drop(trainer);
        drop(budget);
        let samples_per_s = timed.and_then(|t| match t.outcome {
            Outcome::Ran { .. } => Some(batch as f64 * f64::from(count) / (t.ms / 1000.0)),
            Outcome::OutOfMemory { .. } => None,
        });
        let event = serde_json::json!({"event": "throughput", "batch": batch,
                                       "samples_per_s": samples_per_s,
                                       "out_of_memory": samples_per_s.is_none()});
        points.push(ThroughputPoint {
            batch,
            samples_per_s,
        });
        if progress(&event.to_string()) {
            break;
        }
    }
    let _ = allocator::empty_cache();
    Ok(points)
}

/// Samples in the CPU check's step: two, as in the loss's planning forward and the python
/// engine's check, because BatchNorm refuses a single sample in training mode (DeepLabV3's
/// pooled branch failed the check at one).
const CPU_CHECK_BATCH: u64 = 2;

/// Validates model and input with one tiny step on the CPU (no GPU here).
pub fn validate_on_cpu(request: &MaxBatchRequest) -> Result<String, TrialError> {
    let _interpreted = Interpreted::enter();
    let mut trainer = Trainer::new(request, Device::Cpu)?;
    catch_unwind(AssertUnwindSafe(|| trainer.step(CPU_CHECK_BATCH))).map_err(|_| {
        TrialError::request("the step failed on the CPU: check the model and --input")
    })??;
    Ok(format!(
        "one training step of batch {CPU_CHECK_BATCH} ran on the CPU with input {:?}{}",
        trainer.input,
        trainer
            .loss
            .map(|l| format!(
                ", loss {}",
                trainer.loss_inputs.clone().unwrap_or_default().describe(l)
            ))
            .unwrap_or_default()
    ))
}

/// A trial's error as the search takes it: the end of the search, with the error's words.
fn failed(e: TrialError) -> Stop {
    Stop::Failed(e.to_string())
}

/// What the search's trials measured beside their outcomes, per batch.
#[derive(Default)]
struct SearchTrials {
    durations: Vec<(u64, f64)>,
    /// The cache's reserved peak of each trial that ran.
    reserved: Vec<(u64, u64)>,
    /// The largest segment each trial that ran made the cache reserve, where readable.
    blocks: Vec<(u64, u64)>,
}

impl SearchTrials {
    /// One search trial at `batch` from a freshly built model, reported through `progress`
    /// (which returns true to stop).
    fn probe(
        &mut self,
        request: &MaxBatchRequest,
        batch: u64,
        limit: u64,
        progress: &dyn Fn(&str) -> bool,
    ) -> Result<Outcome, Stop> {
        let device = request.device;
        let start = serde_json::json!({"event": "trial_start", "batch": batch});
        if progress(&start.to_string()) {
            return Err(Stop::Cancelled);
        }
        // The last trial's segments go before this one's weights are made, so that what the
        // cache holds when the steps begin is the weights' alone, left out of the trial's
        // blocks. Unreadable segments leave the room for a stranded block out, not the trial.
        let _ = allocator::empty_cache();
        let mut trainer = Trainer::new(request, Device::Cuda(device)).map_err(failed)?;
        let held = allocator::segments(device).ok();
        let run = trial(&mut trainer, device, batch, STEPS_PER_TRIAL, true).map_err(failed)?;
        let ran = matches!(run.outcome, Outcome::Ran { .. });
        let largest_block = match (ran, held) {
            (true, Some(held)) => allocator::segments(device)
                .ok()
                .and_then(|after| stranded::largest_new_segment(&after, &held)),
            _ => None,
        };
        drop(trainer);
        self.durations.push((batch, run.ms));
        if ran {
            self.reserved.push((batch, run.reserved_peak));
            self.blocks
                .extend(largest_block.map(|block| (batch, block)));
        }
        let event = serde_json::json!({"event": "trial", "batch": batch, "outcome": run.outcome,
                                       "fits": matches!(run.outcome, Outcome::Ran{peak, ..} if peak <= limit),
                                       "reserved_peak": run.reserved_peak,
                                       "active_peak": run.active_peak,
                                       "inactive_split_peak": run.inactive_split_peak,
                                       "largest_block": largest_block,
                                       "ms": run.ms, "limit": limit});
        if progress(&event.to_string()) {
            return Err(Stop::Cancelled);
        }
        Ok(run.outcome)
    }
}

/// The search on `request.device`, reporting each trial through `progress` (which returns
/// true to stop).
pub fn run(
    request: &MaxBatchRequest,
    progress: &dyn Fn(&str) -> bool,
) -> Result<MaxBatchReport, TrialError> {
    if !tch::Cuda::is_available() {
        return Err(TrialError::NoCuda);
    }
    let device = request.device;
    let started = Instant::now();
    // Creating the model may create this process's CUDA context: measure from after it.
    // Build once to check the model and measure what it holds; each trial then starts from a
    // fresh model with no gradients or optimizer state, as a training run does: state that
    // the first step allocates among its activations fragments the cache differently from
    // state carried over from a smaller trial.
    let _interpreted = Interpreted::enter();
    let (baseline, budget, loss_plan, loss_inputs) = {
        let probe_build = Trainer::new(request, Device::Cuda(device))?;
        let stats = allocator::device_stats(device)?;
        let Trainer {
            loss, loss_inputs, ..
        } = probe_build;
        (stats, Budget::new(request)?, loss, loss_inputs)
    };
    let limit = budget.bytes;
    let config = SearchConfig {
        limit,
        max_batch: request.max_batch,
        max_trials: request.max_trials,
        tolerance: request.tolerance,
        ..SearchConfig::default()
    };
    let mut trials = SearchTrials::default();
    let probe = |batch: u64| trials.probe(request, batch, limit, progress);
    let result = if request.baseline_search {
        search::lightning(&config, probe)
    } else {
        search::search(&config, probe)
    };
    let (context_bytes, free_at_start) = (budget.context, budget.from_free);
    drop(budget);
    let _ = allocator::empty_cache();
    let after = allocator::device_stats(device)?;
    Ok(MaxBatchReport {
        search: result,
        loss: loss_plan,
        loss_inputs,
        limit,
        context_bytes,
        baseline_allocated: baseline.allocated_bytes.current.max(0) as u64,
        after_allocated: after.allocated_bytes.current.max(0) as u64,
        after_reserved: after.reserved_bytes.current.max(0) as u64,
        trial_ms: trials.durations,
        trial_reserved: trials.reserved,
        trial_blocks: trials.blocks,
        elapsed_ms: started.elapsed().as_secs_f64() * 1000.0,
        device_total: baseline.total,
        free_at_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin_api::{MaxBatchRequest, ModelSource, OptimizerKind};

    fn request(model: ModelSource) -> MaxBatchRequest {
        MaxBatchRequest {
            model,
            input: None,
            vocab: None,
            dtype: None,
            optimizer: OptimizerKind::Adam,
            inference: false,
            device: 0,
            limit: None,
            allocator_budget: None,
            max_batch: 1 << 16,
            max_trials: 12,
            tolerance: 0.0,
            amp: None,
            baseline_search: false,
            loss: None,
            target_classes: None,
            trial_timeout_s: None,
        }
    }

    #[test]
    fn a_torchscript_failure_is_told_by_its_exception_not_its_tracebacks() {
        let traced = tch::TchError::Torch(
            "The following operation failed in the TorchScript interpreter.\n\
             Traceback of TorchScript, serialized code (most recent call last):\n  \
             File \"code/__torch__/m.py\", line 9, in forward\n    x = bn(x)\n\
             RuntimeError: Expected more than 1 value per channel when training\n"
                .into(),
        );
        assert_eq!(
            TrialError::from(traced).to_string(),
            "RuntimeError: Expected more than 1 value per channel when training \
             (in the TorchScript module's forward)"
        );
        let plain = tch::TchError::Torch("CUDA out of memory. Tried to allocate 2 GiB".into());
        assert_eq!(
            TrialError::from(plain).to_string(),
            "Internal torch error: CUDA out of memory. Tried to allocate 2 GiB"
        );
    }

    #[test]
    fn a_builtin_trains_one_step_on_cpu() {
        let mut r = request(ModelSource::Builtin {
            name: "resnet18".into(),
        });
        r.input = Some(vec![3, 64, 64]); // small: this is a CPU test
        let said = validate_on_cpu(&r).expect("resnet18 trains on CPU");
        assert!(said.contains("[3, 64, 64]"), "{said}");
    }

    #[test]
    fn mixed_precision_trains_a_step_and_refuses_a_second_dtype() {
        let mut r = request(ModelSource::Builtin {
            name: "resnet18".into(),
        });
        r.input = Some(vec![3, 32, 32]);
        let plain = Trainer::new(&r, Device::Cpu).expect("model");
        let x = plain.batch_input(2).expect("input");
        assert_eq!(
            plain.forward(&x, true).expect("fp32").main.kind(),
            Kind::Float
        );
        r.amp = Some(Precision::Bf16);
        let mixed = Trainer::new(&r, Device::Cpu).expect("model");
        assert_eq!(
            mixed.forward(&x, true).expect("bf16").main.kind(),
            Kind::BFloat16
        );
        validate_on_cpu(&r).expect("bf16 autocast trains on the CPU");
        r.dtype = Some(Precision::Fp16);
        let err = validate_on_cpu(&r).unwrap_err().to_string();
        assert!(err.contains("--amp") && err.contains("--dtype"), "{err}");
    }

    #[test]
    fn a_trials_peaks_are_kept_apart_by_phase_and_whole_across_resets() {
        let mut peaks = TrialPeaks::default();
        peaks.fold_peaks(700, 900, 700, 10); // forward and backward
        peaks.enter(true);
        peaks.fold_peaks(1000, 1100, 1000, 5); // the update
        peaks.enter(false);
        peaks.fold_peaks(800, 950, 800, 20); // the next step's forward and backward
        assert_eq!(
            peaks.phases(),
            Some(search::PhasePeaks {
                outside: 800,
                optimizer: 1000
            })
        );
        assert_eq!(
            (
                peaks.allocated(),
                peaks.reserved,
                peaks.active,
                peaks.inactive_split
            ),
            (1000, 1100, 1000, 20)
        );
        // Forward only (--inference, or no optimizer): no update, no phases.
        let mut forward = TrialPeaks::default();
        forward.fold_peaks(700, 900, 700, 10);
        assert_eq!((forward.phases(), forward.allocated()), (None, 700));
    }

    #[test]
    fn the_optimizer_step_changes_the_weights() {
        let mut r = request(ModelSource::Builtin {
            name: "resnet18".into(),
        });
        r.input = Some(vec![3, 32, 32]);
        let mut trainer = Trainer::new(&r, Device::Cpu).expect("model");
        let before: f64 = trainer.parameters()[0].sum(Kind::Double).double_value(&[]);
        trainer.step(2).expect("step");
        let after: f64 = trainer.parameters()[0].sum(Kind::Double).double_value(&[]);
        assert_ne!(before, after, "Adam updated the first layer");
    }

    #[test]
    fn bad_models_and_shapes_are_explained() {
        let err = validate_on_cpu(&request(ModelSource::Builtin {
            name: "resnet51".into(),
        }))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("unknown model \"resnet51\"") && err.contains("resnet50"),
            "{err}"
        );
        let err = validate_on_cpu(&request(ModelSource::TorchScript {
            path: "/nonexistent.pt".into(),
        }))
        .unwrap_err()
        .to_string();
        assert!(!err.is_empty());
        let mut r = request(ModelSource::Builtin {
            name: "resnet18".into(),
        });
        r.input = Some(vec![7, 8]); // not an image
        assert!(validate_on_cpu(&r).is_err());
    }
}
