//! `%maxbatch MODEL`: the largest batch whose full training step fits, found in a few real
//! steps in-process with libtorch (through `libgpuprobe_torch.so`), with a safe recommendation
//! and a chart. Parsing and presentation live here; the steps and the search in gpuprobe.
//! MODEL may name a module of the notebook (gpu-python kernel): the Python kernel saves it as
//! TorchScript in a private file, which is removed once the search is done.

use super::python::{is_variable_name, ExportedModule};
use super::{parse_args, Magic, MagicContext, MagicError};
use clap::{CommandFactory, Parser, ValueEnum};
use gpuprobe::plugin_api::{
    MaxBatchRequest, ModelSource, OptimizerKind, Precision, BUILTIN_MODELS,
};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum Dtype {
    Fp32,
    Fp16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum Amp {
    Fp16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum Optimizer {
    None,
    Sgd,
    Adam,
    Adamw,
}

/// Find the largest batch whose full training step (forward, backward, optimizer) fits on the
/// GPU, in a handful of real steps, and recommend a safe one.
#[derive(Parser, Debug)]
#[command(name = "%maxbatch", disable_version_flag = true)]
pub(super) struct Args {
    /// A built-in architecture (resnet50, vgg16, densenet121, efficientnet_b0, ...), the path
    /// of a TorchScript file, or (gpu-python kernel) a variable holding a torch.nn.Module.
    pub(super) model: String,
    /// Shape of one sample, e.g. 3x224x224 (default: the built-in's usual input).
    #[arg(long, value_name = "SHAPE", value_parser = parse_shape)]
    pub(super) input: Option<Shape>,
    /// Integer token inputs in 0..VOCAB (language models) instead of floats.
    #[arg(long, value_name = "VOCAB")]
    pub(super) vocab: Option<i64>,
    /// Precision of parameters and inputs.
    #[arg(long, value_enum, default_value = "fp32")]
    pub(super) dtype: Dtype,
    /// Mixed precision: fp32 weights and optimizer state, the forward pass autocast.
    #[arg(long, value_enum, conflicts_with = "dtype")]
    pub(super) amp: Option<Amp>,
    /// Optimizer whose state is allocated by a real step.
    #[arg(long, value_enum, default_value = "adam")]
    pub(super) optimizer: Optimizer,
    /// Forward only, no gradients (serving).
    #[arg(long)]
    pub(super) inference: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(super) device: usize,
    /// Answer for a card of this size (e.g. 24GiB, 80GB) while running on a bigger one.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub(super) limit: Option<u64>,
    /// Safety margin below the maximum for the recommendation, in percent.
    #[arg(long, value_name = "PCT", default_value_t = 5.0)]
    pub(super) margin: f64,
    /// Largest batch worth trying.
    #[arg(long, value_name = "N", default_value_t = 65536)]
    pub(super) max: u64,
    /// Search to the exact sample instead of within 1% (a few more trials near the limit).
    #[arg(long)]
    pub(super) exact: bool,
    /// Also time training at batch sizes up to the recommendation and recommend the fastest.
    #[arg(long)]
    pub(super) throughput: bool,
    /// Return the result as JSON (the cell's value).
    #[arg(long)]
    pub(super) json: bool,
}

/// One sample's shape (a newtype: clap would read a bare `Vec` as several values).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Shape(pub(super) Vec<i64>);

fn parse_shape(text: &str) -> Result<Shape, String> {
    let dims: Result<Vec<i64>, _> = text
        .split(['x', ',', ' '])
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<i64>())
        .collect();
    match dims {
        Ok(dims) if !dims.is_empty() && dims.iter().all(|d| *d > 0) => Ok(Shape(dims)),
        _ => Err(format!("{text:?} is not a shape like 3x224x224")),
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

pub struct MaxBatch;

impl Magic for MaxBatch {
    fn name(&self) -> &'static str {
        "maxbatch"
    }

    fn summary(&self) -> &'static str {
        "The largest batch whose training step fits on the GPU, in a few real steps, with a safe recommendation and a chart."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        let (model, exported) = model_source(&args, ctx)?;
        let request = MaxBatchRequest {
            model,
            input: args.input.clone().map(|s| s.0),
            vocab: args.vocab,
            dtype: match args.dtype {
                Dtype::Fp32 => None,
                Dtype::Fp16 => Some(Precision::Fp16),
                Dtype::Bf16 => Some(Precision::Bf16),
            },
            amp: args.amp.map(|a| match a {
                Amp::Fp16 => Precision::Fp16,
                Amp::Bf16 => Precision::Bf16,
            }),
            optimizer: match args.optimizer {
                Optimizer::None => OptimizerKind::None,
                Optimizer::Sgd => OptimizerKind::Sgd,
                Optimizer::Adam => OptimizerKind::Adam,
                Optimizer::Adamw => OptimizerKind::Adamw,
            },
            inference: args.inference,
            device: args.device,
            limit: args.limit,
            max_batch: args.max.max(1),
            max_trials: 12,
            tolerance: if args.exact { 0.0 } else { TOLERANCE },
            baseline_search: false,
        };
        let result = run_search(&args, &request, exported.as_ref(), ctx);
        drop(exported); // the private TorchScript file goes now, whatever happened
        result
    }
}

/// How close to the true maximum the search goes by default: the recommendation takes a
/// margin of several percent off anyway, and each trial near the limit is the slowest.
const TOLERANCE: f64 = 0.01;

/// A module exported from the notebook: its private TorchScript file, removed on drop.
pub(super) struct Exported {
    pub(super) module: ExportedModule,
}

impl Drop for Exported {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.module.path);
    }
}

fn model_source(
    args: &Args,
    ctx: &MagicContext,
) -> Result<(ModelSource, Option<Exported>), MagicError> {
    if BUILTIN_MODELS.contains(&args.model.as_str()) {
        let name = args.model.clone();
        return Ok((ModelSource::Builtin { name }, None));
    }
    if std::path::Path::new(&args.model).is_file() {
        let path = args.model.clone();
        return Ok((ModelSource::TorchScript { path }, None));
    }
    match ctx.python {
        Some(python) if is_variable_name(&args.model) => {
            let input = args.input.as_ref().map(|s| s.0.as_slice());
            let module = python
                .export_module(&args.model, input, args.vocab, !args.inference)
                .map_err(|e| {
                    MagicError::usage(format!(
                        "%maxbatch: could not take the model from {:?}: {e}",
                        args.model
                    ))
                })?;
            let path = module.path.clone();
            Ok((ModelSource::TorchScript { path }, Some(Exported { module })))
        }
        _ => Err(MagicError::usage(format!(
            "%maxbatch: {:?} is neither a built-in model nor a TorchScript file{}. Built-ins: {}.",
            args.model,
            if ctx.python.is_some() {
                " nor a notebook variable"
            } else {
                " (notebook variables work in the gpu-python kernel)"
            },
            BUILTIN_MODELS.join(", ")
        ))),
    }
}

#[cfg(not(feature = "torch"))]
fn run_search(
    _: &Args,
    _: &MaxBatchRequest,
    _: Option<&Exported>,
    _: &MagicContext,
) -> Result<(), MagicError> {
    Err(MagicError::new(
        "NoLibtorch",
        "this build of gpukernel has no libtorch: %maxbatch needs gpukernel built with \
         --features torch and libgpuprobe_torch.so beside it",
    ))
}

#[cfg(feature = "torch")]
fn run_search(
    args: &Args,
    request: &MaxBatchRequest,
    exported: Option<&Exported>,
    ctx: &MagicContext,
) -> Result<(), MagicError> {
    use super::maxbatch_report::{self, throughput_candidates, Throughput, THROUGHPUT_STEPS};
    use super::Output;
    use gpuprobe::plugin_api::{MaxBatchReport, Request, ThroughputPoint};
    use serde_json::{json, Value};
    let failed =
        |e: crate::torch_plugin::PluginError| MagicError::new("MaxBatchError", e.to_string());
    let plugin = crate::torch_plugin::plugin().map_err(failed)?;
    let info = plugin.request(&Request::Info).map_err(failed)?;
    if let Some(e) = exported {
        ctx.stdout(maxbatch_report::exported_line(&args.model, &e.module));
    }
    if info["cuda_available"] != Value::Bool(true) {
        let said = plugin
            .request(&Request::ValidateOnCpu(request.clone()))
            .map_err(failed)?;
        ctx.stdout(format!(
            "No CUDA GPU is visible to libtorch here, so there is no GPU memory to size against.\n\
             Validated the model instead: {}.\nRun %maxbatch on a GPU machine for the search.\n",
            said.as_str().unwrap_or("ok")
        ));
        return Ok(());
    }
    let display_id = format!("maxbatch-{}", uuid::Uuid::new_v4());
    let events = std::sync::Mutex::new(Vec::<Value>::new());
    ctx.out.emit(Output::Display {
        data: maxbatch_report::progress(&[]),
        display_id: Some(display_id.clone()),
    });
    let mut on_event = |event: &str| -> bool {
        if let Ok(event) = serde_json::from_str::<Value>(event) {
            let mut events = events
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            events.push(event);
            ctx.out.emit(Output::Update {
                data: maxbatch_report::progress(&events),
                display_id: display_id.clone(),
            });
        }
        ctx.cancel.is_cancelled()
    };
    let report = plugin
        .call(&Request::MaxBatch(request.clone()), &mut on_event)
        .map_err(failed)?;
    let report: MaxBatchReport = serde_json::from_value(report)
        .map_err(|e| MagicError::new("MaxBatchError", format!("unreadable report: {e}")))?;
    if report.search["stopped"] == json!("cancelled") {
        return Err(MagicError::interrupted());
    }
    let max = report.search["max_fit"].as_u64();
    let throughput = match max {
        Some(max) if args.throughput => {
            let recommended = gpuprobe::search::recommend(max, args.margin / 100.0);
            let batches = throughput_candidates(recommended);
            let points = plugin
                .call(
                    &Request::Throughput {
                        setup: request.clone(),
                        batches,
                        steps: THROUGHPUT_STEPS,
                    },
                    &mut on_event,
                )
                .map_err(failed)?;
            if ctx.cancel.is_cancelled() {
                return Err(MagicError::interrupted());
            }
            let points: Vec<ThroughputPoint> = serde_json::from_value(points).map_err(|e| {
                MagicError::new("MaxBatchError", format!("unreadable timings: {e}"))
            })?;
            Some(Throughput::from_points(points))
        }
        _ => None,
    };
    let data = maxbatch_report::summary(
        args,
        &report,
        exported.map(|e| &e.module),
        throughput.as_ref(),
    );
    ctx.out.emit(Output::value_or_display(data, args.json));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(parse_shape("3xx").is_ok());
        assert!(parse_shape("3x-1").is_err());
    }
}
