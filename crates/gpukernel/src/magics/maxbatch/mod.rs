//! `%maxbatch`: the largest batch whose full training step fits on the GPU, found in a handful
//! of real steps, with a safe recommendation and a chart.
//!
//! Two engines share gpuprobe's search and this module's report:
//! - **python** ([`python_engine`], the default for a notebook variable or `--step FN` in the
//!   gpu-python kernel): every trial is the user's own eager step in their Python kernel, so
//!   the answer holds for *their* training (their loss, graph, optimizer, and what the kernel
//!   already holds).
//! - **libtorch** ([`libtorch_engine`], feature `torch`): in-process steps through
//!   `libgpuprobe_torch.so` for built-ins, TorchScript files, the magics-only kernel, and
//!   `--engine libtorch` on a notebook module (exported as TorchScript).
//!
//! Parsing and the choice of engine live here.

#[cfg(feature = "torch")]
mod export;
#[cfg(feature = "torch")]
mod libtorch_engine;
mod outside;
mod python_engine;
mod report;

use super::python::is_variable_name;
use super::{parse_args, Magic, MagicContext, MagicError};
use clap::{CommandFactory, Parser, ValueEnum};
use gpuprobe::loss::LossKind;
use gpuprobe::plugin_api::BUILTIN_MODELS;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Dtype {
    Fp32,
    Fp16,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Amp {
    Fp16,
    Bf16,
}

impl Amp {
    pub(super) fn name(self) -> &'static str {
        match self {
            Amp::Fp16 => "fp16",
            Amp::Bf16 => "bf16",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Optimizer {
    None,
    Sgd,
    Adam,
    Adamw,
}

impl Optimizer {
    pub(super) fn name(self) -> &'static str {
        match self {
            Optimizer::None => "none",
            Optimizer::Sgd => "sgd",
            Optimizer::Adam => "adam",
            Optimizer::Adamw => "adamw",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Loss {
    /// Cross-entropy against random class targets.
    Ce,
    /// Mean squared error against a random target.
    Mse,
    /// The output's mean.
    Mean,
    /// The loss the model computes itself: given targets (`forward(x, targets=...)`, as
    /// nanoGPT's; `labels=` for Hugging Face models), or from its own output without them (a
    /// masked autoencoder's `(loss, pred, mask)`); python engine.
    Own,
}

impl Loss {
    /// The standard loss both engines compute; `None` for the model's own.
    pub(super) fn kind(self) -> Option<LossKind> {
        match self {
            Loss::Ce => Some(LossKind::Ce),
            Loss::Mse => Some(LossKind::Mse),
            Loss::Mean => Some(LossKind::Mean),
            Loss::Own => None,
        }
    }

    /// As `trials.py` takes it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Loss::Ce => "ce",
            Loss::Mse => "mse",
            Loss::Mean => "mean",
            Loss::Own => "own",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum EngineChoice {
    /// Your own eager steps in your Python kernel (gpu-python kernel).
    Python,
    /// gpukernel's in-process libtorch steps on a TorchScript copy.
    Libtorch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum SearchKind {
    /// Fit memory against batch size and jump to the limit (a handful of trials).
    Fit,
    /// Double from 2 until out of memory, then bisect to the exact maximum (Lightning's
    /// finder with its defaults; for comparison).
    DoubleBisect,
}

/// Find the largest batch whose full training step (forward, backward, optimizer) fits on the
/// GPU, in a handful of real steps, and recommend a safe one.
///
/// In the gpu-python kernel, a notebook module or `--step FN` is sized by running your own
/// eager steps in your Python kernel; your model, optimizer, gradients, RNG and flags are put
/// back after every trial.
#[derive(Parser, Debug)]
#[command(name = "%maxbatch", disable_version_flag = true)]
pub(super) struct Args {
    /// A notebook variable holding a torch.nn.Module (gpu-python kernel), a built-in
    /// architecture (resnet50, vgg16, densenet121, efficientnet_b0, ...), or the path of a
    /// TorchScript file.
    #[arg(required_unless_present = "step")]
    pub(super) model: Option<String>,
    /// Your own function FN(batch_size) that runs one full training step (data, loss,
    /// autocast + GradScaler, checkpointing, accumulation, torch.compile: whatever you use).
    /// Exact by construction.
    #[arg(long, value_name = "FN", conflicts_with_all = ["model", "input", "batch_dim", "vocab", "dtype", "amp", "loss", "target_classes", "optimizer", "optimizer_from", "inference"])]
    pub(super) step: Option<String>,
    /// Where trials run (default: python for a notebook variable, libtorch otherwise).
    #[arg(long, value_enum)]
    pub(super) engine: Option<EngineChoice>,
    /// Shape of one sample, e.g. 3x224x224 or (3, 224, 224), or 512 with --vocab (default for
    /// built-ins only).
    #[arg(long, value_name = "SHAPE", value_parser = parse_shape)]
    pub(super) input: Option<Shape>,
    /// Where the batch goes in the input (python engine): 0, or 1 for a (seq, batch, ...)
    /// loop. Default: 1 where a layer with batch_first=False would take the batch as its
    /// sequence, else 0; the report says which.
    #[arg(long, value_name = "N")]
    pub(super) batch_dim: Option<usize>,
    /// Integer token inputs in 0..VOCAB (language models) instead of floats; found from the
    /// model's first layer when it is an Embedding.
    #[arg(long, value_name = "VOCAB")]
    pub(super) vocab: Option<i64>,
    /// The loss of the step (default: the model's own where its forward takes targets or
    /// labels and returns a loss for them, as a loop written for it passes them, or returns
    /// one computed from its output; else cross-entropy when the output looks like class
    /// scores, plus a scalar computed from them such as a z-loss, else mse; the report says
    /// which).
    #[arg(long, value_enum)]
    pub(super) loss: Option<Loss>,
    /// Classes the cross-entropy targets range over (picks the output's class dimension).
    #[arg(long, value_name = "N")]
    pub(super) target_classes: Option<i64>,
    /// libtorch engine: precision of parameters and inputs (default fp32).
    #[arg(long, value_enum, conflicts_with = "amp")]
    pub(super) dtype: Option<Dtype>,
    /// Mixed precision: the forward pass under autocast (fp16 adds a GradScaler, as the usual
    /// mixed-precision loop does).
    #[arg(long, value_enum)]
    pub(super) amp: Option<Amp>,
    /// A new optimizer whose state a real step allocates (default: the notebook's own
    /// optimizer of the model if there is exactly one, else adamw).
    #[arg(long, value_enum)]
    pub(super) optimizer: Option<Optimizer>,
    /// The notebook's optimizer to step (its existing state counts as it is).
    #[arg(long, value_name = "VAR", conflicts_with = "optimizer")]
    pub(super) optimizer_from: Option<String>,
    /// Forward only, no gradients (serving).
    #[arg(long)]
    pub(super) inference: bool,
    /// Your loop keeps only the loss of each forward, not its output (`loss =
    /// model(**batch).loss`, `loss = criterion(model(x), y)`, a Trainer's or Lightning's
    /// training_step): size that loop, whose output goes before backward. By default the
    /// output lives on into the next step's forward, as `out = model(x)` in a for loop keeps
    /// it (the safe side).
    #[arg(long, conflicts_with_all = ["step", "inference"])]
    pub(super) drops_output: bool,
    /// CUDA device ordinal (default: the model's device, or the current one).
    #[arg(long)]
    pub(super) device: Option<usize>,
    /// Answer for a card of this size (e.g. 24GiB, 80GB) while running on a bigger one: the
    /// allocator is capped there, so the card's out-of-memory errors happen for real.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub(super) limit: Option<u64>,
    /// Safety margin below the maximum for the recommendation, in percent. Under PyTorch's
    /// default allocator the recommendation also leaves room for one more of the step's
    /// largest allocations, which the cache can strand as it fragments (gpuprobe::stranded).
    #[arg(long, value_name = "PCT", default_value_t = 5.0, value_parser = parse_margin)]
    pub(super) margin: f64,
    /// Largest batch worth trying.
    #[arg(long, value_name = "N", default_value_t = 65536,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) max: u64,
    /// Search to the exact sample instead of within 1.5% (a few more trials near the limit).
    #[arg(long)]
    pub(super) exact: bool,
    /// Skip running the recommendation itself once the search is done (python engine). The
    /// confirming trial costs about one trial at the limit; without it the recommendation is
    /// only implied by the maximum (less the margin and the room for a stranded block), and
    /// the allocator's fragmentation can make a smaller batch fail where a larger one fits.
    #[arg(long)]
    pub(super) no_confirm: bool,
    /// Also time training at batch sizes up to the recommendation and recommend the fastest.
    #[arg(long)]
    pub(super) throughput: bool,
    /// The search algorithm.
    #[arg(long, value_enum, default_value = "fit")]
    pub(super) search: SearchKind,
    /// A trial that runs longer than this is interrupted and reported (seconds).
    #[arg(long, value_name = "SECS", default_value_t = 300.0, value_parser = parse_seconds)]
    pub(super) trial_timeout: f64,
    /// Return the result as JSON (the cell's value).
    #[arg(long)]
    pub(super) json: bool,
}

/// One sample's shape (a newtype: clap would read a bare `Vec` as several values).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Shape(pub(super) Vec<i64>);

/// A shape as the user writes it: `3x224x224`.
pub(super) fn shape_text(dims: &[i64]) -> String {
    dims.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
}

/// The words of an `--input` shape written as Python prints one, `(3, 224, 224)` or
/// `torch.Size([3, 224, 224])`, which the magic line's split cut at its spaces, joined again.
fn join_shape(argv: Vec<String>) -> Vec<String> {
    let depth = |w: &str| {
        let count = |c| w.chars().filter(|x| *x == c).count() as i64;
        count('(') + count('[') - count(')') - count(']')
    };
    let mut joined: Vec<String> = Vec::with_capacity(argv.len());
    let mut open = 0;
    for word in argv {
        if open > 0 {
            if let Some(last) = joined.last_mut() {
                last.push(' ');
                last.push_str(&word);
                open += depth(&word);
                continue;
            }
        }
        let after_input = joined.last().is_some_and(|w| w == "--input");
        let value = word.strip_prefix("--input=").unwrap_or(&word);
        if after_input || value.len() < word.len() {
            open = depth(value).max(0);
        }
        joined.push(word);
    }
    joined
}

fn parse_shape(text: &str) -> Result<Shape, String> {
    // `(3, 224, 224)`, `[3, 224, 224]` or `torch.Size([3, 224, 224])` as Python prints a
    // shape: the brackets go (one left alone is forgiven, as a copy cuts it off), and a
    // one-dimension tuple's trailing comma, `(512,)`, too. Every dimension must be a whole
    // number: `8x` or `3xx224` is a typo to point out, not a shape to guess at.
    let wrong = || {
        format!(
            "{:?} is not a shape like 3x224x224 (the dimensions of one sample, whole \
             numbers above 0, joined by x or commas)",
            text.trim()
        )
    };
    let text = text.trim();
    let text = text.strip_prefix("torch.Size(").unwrap_or(text);
    let inner = text
        .trim_start_matches(['(', '['])
        .trim_end_matches([')', ']'])
        .trim();
    let pieces: Vec<&str> = if inner.contains(',') {
        inner
            .strip_suffix(',')
            .unwrap_or(inner)
            .split(',')
            .collect()
    } else {
        inner.split('x').collect()
    };
    let dims: Vec<i64> = pieces
        .iter()
        .map(|d| d.trim().parse::<i64>().ok().filter(|d| *d > 0))
        .collect::<Option<_>>()
        .ok_or_else(wrong)?;
    Ok(Shape(dims))
}

/// A margin in percent below the maximum: 0 (none) up to 90 (the recommendation keeps a
/// tenth of the maximum at least).
fn parse_margin(text: &str) -> Result<f64, String> {
    match text.trim_end_matches('%').parse::<f64>() {
        Ok(p) if (0.0..=90.0).contains(&p) => Ok(p),
        _ => Err(format!("{text:?} is not a percentage from 0 to 90")),
    }
}

fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 86_400.0 => Ok(s),
        _ => Err(format!(
            "{text:?} is not a number of seconds between 0 and 86400"
        )),
    }
}

/// `24GiB`, `24G` (binary), `80GB` (decimal), `512MiB`, or bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 24GiB"))?;
    let factor: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024f64.powi(2),
        "mb" => 1e6,
        "g" | "gib" => 1024f64.powi(3),
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}: use GiB, GB, MiB, MB"
            ))
        }
    };
    if value <= 0.0 {
        return Err(format!("{text:?} must be more than zero"));
    }
    Ok((value * factor) as u64)
}

/// How close to the true maximum the search goes by default: the recommendation takes a
/// margin of several percent off anyway, and each trial near the limit is the slowest. 1.5%
/// keeps the answer above 0.98 of the truth with room for run-to-run noise (about 1%).
const TOLERANCE: f64 = 0.015;

/// The search's trial budget.
const MAX_TRIALS: usize = 12;

/// What `%maxbatch` sizes, and so which engine runs it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Builtin(String),
    File(String),
    /// A notebook variable (a module) or, with `step`, a step function.
    Notebook {
        name: String,
        step: bool,
    },
}

fn target(args: &Args, in_notebook: bool) -> Result<Target, MagicError> {
    if let Some(step) = &args.step {
        if !in_notebook {
            return Err(MagicError::usage(
                "%maxbatch --step: a step function lives in a notebook's Python; it works in \
                 the gpu-python kernel (\"Python 3 (GPU magics)\")",
            ));
        }
        if !is_variable_name(step) {
            return Err(MagicError::usage(format!(
                "%maxbatch --step: {step:?} is not a name; pass the function's name, e.g. \
                 --step train_step"
            )));
        }
        return Ok(Target::Notebook {
            name: step.clone(),
            step: true,
        });
    }
    let model = args.model.clone().unwrap_or_default();
    if BUILTIN_MODELS.contains(&model.as_str()) {
        return Ok(Target::Builtin(model));
    }
    if std::path::Path::new(&model).is_file() {
        return Ok(Target::File(model));
    }
    if in_notebook && is_variable_name(&model) {
        return Ok(Target::Notebook {
            name: model,
            step: false,
        });
    }
    Err(MagicError::usage(format!(
        "%maxbatch: {model:?} is neither a built-in model nor a TorchScript file{}. Built-ins: {}.",
        if in_notebook {
            " nor a notebook variable"
        } else {
            " (notebook variables work in the gpu-python kernel)"
        },
        BUILTIN_MODELS.join(", ")
    )))
}

/// The engine for `target`, checking that the options fit it.
fn engine(args: &Args, target: &Target) -> Result<EngineChoice, MagicError> {
    let engine = match (target, args.engine) {
        (Target::Notebook { step: true, .. }, Some(EngineChoice::Libtorch)) => {
            return Err(MagicError::usage(
                "%maxbatch --step runs your function, which only your Python kernel can: \
                 drop --engine libtorch",
            ))
        }
        (Target::Builtin(_) | Target::File(_), Some(EngineChoice::Python)) => {
            return Err(MagicError::usage(
                "%maxbatch --engine python sizes a module or step function of the notebook; \
                 a built-in or a TorchScript file runs in the libtorch engine",
            ))
        }
        (Target::Notebook { .. }, choice) => choice.unwrap_or(EngineChoice::Python),
        (_, _) => EngineChoice::Libtorch,
    };
    if engine == EngineChoice::Libtorch && args.batch_dim.is_some_and(|d| d != 0) {
        return Err(MagicError::usage(
            "%maxbatch: the libtorch engine puts the batch first; for a loop that feeds              (seq, batch, ...) use the python engine (drop --engine libtorch), which takes              --batch-dim",
        ));
    }
    if engine == EngineChoice::Libtorch && args.loss == Some(Loss::Own) {
        return Err(MagicError::usage(
            "%maxbatch: --loss own runs your model's forward with targets, which only your \
             Python kernel can: drop --engine libtorch",
        ));
    }
    if engine == EngineChoice::Libtorch && args.drops_output {
        return Err(MagicError::usage(
            "%maxbatch: --drops-output is for the python engine, which runs your model's \
             steps in your Python kernel; the libtorch engine keeps each output into the next \
             forward (drop --engine libtorch, or --drops-output)",
        ));
    }
    if engine == EngineChoice::Python && args.dtype.is_some() {
        return Err(MagicError::usage(
            "%maxbatch: --dtype is for the libtorch engine; the python engine trains your model \
             in its own dtype (convert it in the notebook, or use --amp for mixed precision)",
        ));
    }
    Ok(engine)
}

pub struct MaxBatch;

impl Magic for MaxBatch {
    fn name(&self) -> &'static str {
        "maxbatch"
    }

    fn summary(&self) -> &'static str {
        "The largest batch whose training step fits on the GPU, in a few real steps of your own training, with a safe recommendation and a chart."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(join_shape(argv), ctx)? else {
            return Ok(());
        };
        let target = target(&args, ctx.python.is_some())?;
        match (engine(&args, &target)?, ctx.python) {
            (EngineChoice::Python, Some(python)) => python_engine::run(&args, python, ctx),
            (EngineChoice::Python, None) => Err(MagicError::usage(
                "%maxbatch --engine python needs the gpu-python kernel",
            )),
            (EngineChoice::Libtorch, _) => libtorch(&args, &target, ctx),
        }
    }
}

#[cfg(feature = "torch")]
fn libtorch(args: &Args, target: &Target, ctx: &MagicContext) -> Result<(), MagicError> {
    libtorch_engine::run(args, target, ctx)
}

#[cfg(not(feature = "torch"))]
fn libtorch(_: &Args, _: &Target, _: &MagicContext) -> Result<(), MagicError> {
    Err(MagicError::new(
        "NoLibtorch",
        "this build of gpukernel has no libtorch: the libtorch engine (built-ins, TorchScript \
         files) needs gpukernel built with --features torch and libgpuprobe_torch.so beside it; \
         a notebook module or --step FN runs in your Python kernel without it",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn args(words: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("%maxbatch").chain(words.iter().copied()))
            .expect("arguments parse")
    }

    #[test]
    fn sizes_and_shapes_parse() {
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("24G"), Ok(24 << 30));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert!(parse_size("24 furlongs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_size("-1G").is_err());
        assert_eq!(parse_shape("3x224x224"), Ok(Shape(vec![3, 224, 224])));
        assert_eq!(parse_shape("128"), Ok(Shape(vec![128])));
        assert!(parse_shape("3x-1").is_err());
        // A typo is pointed out, not read as the shape it might have been.
        for typo in [
            "8x", "3xx", "3xx224", "x3", "3 224", "3x224x", "3.5x2", "3,,2", "8X",
        ] {
            let err = parse_shape(typo).expect_err(typo);
            assert!(
                err.contains("is not a shape like 3x224x224"),
                "{typo}: {err}"
            );
        }
        assert_eq!(parse_shape("(512,)"), Ok(Shape(vec![512])));
        assert_eq!(parse_shape(" 3x32x32 "), Ok(Shape(vec![3, 32, 32])));
        // As Python prints a shape, and as torch.Size's numbers are copied out of it.
        assert_eq!(parse_shape("(3, 224, 224)"), Ok(Shape(vec![3, 224, 224])));
        assert_eq!(parse_shape("[512]"), Ok(Shape(vec![512])));
        assert_eq!(parse_shape("3,32,32"), Ok(Shape(vec![3, 32, 32])));
        assert!(
            parse_shape("(3, 224").is_ok(),
            "one bracket alone is forgiven too"
        );
        assert!(parse_shape("()").is_err());
        assert_eq!(
            parse_shape("torch.Size([3, 224, 224])"),
            Ok(Shape(vec![3, 224, 224]))
        );
    }

    #[test]
    fn a_margin_or_a_largest_batch_that_cannot_be_is_refused() {
        let parse = |words: &[&str]| {
            Args::try_parse_from(std::iter::once("%maxbatch").chain(words.iter().copied()))
        };
        assert_eq!(args(&["m", "--margin", "10"]).margin, 10.0);
        assert_eq!(args(&["m", "--margin", "0"]).margin, 0.0);
        assert_eq!(args(&["m", "--margin", "7.5%"]).margin, 7.5);
        for bad in ["--margin=150", "--margin=-5", "--margin=five"] {
            let err = parse(&["m", bad]).expect_err(bad).to_string();
            assert!(err.contains("is not a percentage from 0 to 90"), "{err}");
        }
        assert_eq!(args(&["m", "--max", "1"]).max, 1);
        let err = parse(&["m", "--max", "0"]).expect_err("0").to_string();
        assert!(err.contains("--max <N>"), "{err}");
    }

    #[test]
    fn a_shape_the_line_split_at_its_spaces_is_one_value_again() {
        let words = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(
            join_shape(words("%maxbatch m --input (3, 224, 224) --amp bf16")),
            [
                "%maxbatch",
                "m",
                "--input",
                "(3, 224, 224)",
                "--amp",
                "bf16"
            ]
        );
        assert_eq!(
            join_shape(words("%maxbatch m --input=torch.Size([3, 32, 32]) --json")),
            [
                "%maxbatch",
                "m",
                "--input=torch.Size([3, 32, 32])",
                "--json"
            ]
        );
        assert_eq!(
            join_shape(words("%maxbatch m --input 3x224x224 --amp bf16")),
            words("%maxbatch m --input 3x224x224 --amp bf16")
        );
        // Only --input's value: brackets elsewhere (a --step name, another flag) stay apart.
        assert_eq!(
            join_shape(words("%maxbatch --step f( --json")),
            words("%maxbatch --step f( --json")
        );
        assert!(parse_seconds("1e30").is_err());
        assert!(parse_seconds("0").is_err());
    }

    #[test]
    fn notebook_targets_default_to_the_python_engine() {
        let a = args(&["model", "--input", "3x32x32"]);
        let t = target(&a, true).unwrap();
        assert_eq!(
            t,
            Target::Notebook {
                name: "model".into(),
                step: false
            }
        );
        assert_eq!(engine(&a, &t).unwrap(), EngineChoice::Python);
        let a = args(&["model", "--engine", "libtorch", "--input", "8"]);
        assert_eq!(
            engine(&a, &target(&a, true).unwrap()).unwrap(),
            EngineChoice::Libtorch
        );
        let a = args(&["resnet50"]);
        assert_eq!(
            engine(&a, &target(&a, true).unwrap()).unwrap(),
            EngineChoice::Libtorch
        );
    }

    #[test]
    fn options_that_do_not_fit_the_engine_are_refused() {
        let a = args(&["--step", "train_step", "--engine", "libtorch"]);
        let err = engine(&a, &target(&a, true).unwrap()).unwrap_err();
        assert!(
            err.evalue.contains("drop --engine libtorch"),
            "{}",
            err.evalue
        );
        let a = args(&["resnet50", "--engine", "python"]);
        assert!(engine(&a, &target(&a, true).unwrap()).is_err());
        let a = args(&["model", "--dtype", "bf16"]);
        let err = engine(&a, &target(&a, true).unwrap()).unwrap_err();
        assert!(err.evalue.contains("--amp"), "{}", err.evalue);
        let a = args(&["--step", "train_step"]);
        let err = target(&a, false).unwrap_err();
        assert!(err.evalue.contains("gpu-python kernel"), "{}", err.evalue);
        let a = args(&["model", "--engine", "libtorch", "--batch-dim", "1"]);
        let err = engine(&a, &target(&a, true).unwrap()).unwrap_err();
        assert!(err.evalue.contains("python engine"), "{}", err.evalue);
        let a = args(&["model", "--engine", "libtorch", "--loss", "own"]);
        let err = engine(&a, &target(&a, true).unwrap()).unwrap_err();
        assert!(
            err.evalue.contains("drop --engine libtorch"),
            "{}",
            err.evalue
        );
        let a = args(&["model", "--input", "35", "--batch-dim", "1"]);
        assert_eq!(
            engine(&a, &target(&a, true).unwrap()).unwrap(),
            EngineChoice::Python
        );
        assert!(Args::try_parse_from(["%maxbatch", "--step", "f", "--input", "8"]).is_err());
        assert!(Args::try_parse_from(["%maxbatch", "--step", "f", "--batch-dim", "1"]).is_err());
        // A step function's loop is its own; forward-only keeps no output into a next step.
        assert!(Args::try_parse_from(["%maxbatch", "--step", "f", "--drops-output"]).is_err());
        assert!(Args::try_parse_from(["%maxbatch", "m", "--inference", "--drops-output"]).is_err());
        let a = args(&["model", "--engine", "libtorch", "--drops-output"]);
        let err = engine(&a, &target(&a, true).unwrap()).unwrap_err();
        assert!(err.evalue.contains("python engine"), "{}", err.evalue);
        let a = args(&["model", "--drops-output"]);
        assert_eq!(
            engine(&a, &target(&a, true).unwrap()).unwrap(),
            EngineChoice::Python
        );
        assert!(Args::try_parse_from(["%maxbatch"]).is_err());
    }
}
