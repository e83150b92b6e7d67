//! `%maxbatch MODEL`: the largest batch whose full training step fits, found in a few real
//! steps in-process with libtorch (through `libgpuprobe_torch.so`), with a safe recommendation
//! and a chart. Parsing and presentation live here; the steps and the search in gpuprobe.

use super::{bundle, html_escape, parse_args, Bundle, Magic, MagicContext, MagicError, Output};
use clap::{CommandFactory, Parser, ValueEnum};
use gpuprobe::plugin_api::{
    MaxBatchReport, MaxBatchRequest, ModelSource, OptimizerKind, Precision, BUILTIN_MODELS,
};
use gpuprobe::units::human_bytes;
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    Fp32,
    Fp16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Optimizer {
    None,
    Sgd,
    Adam,
    Adamw,
}

/// Find the largest batch whose full training step (forward, backward, optimizer) fits on the
/// GPU, in a handful of real steps, and recommend a safe one.
#[derive(Parser, Debug)]
#[command(name = "%maxbatch", disable_version_flag = true)]
struct Args {
    /// A built-in architecture (resnet50, vgg16, densenet121, efficientnet_b0, ...) or the
    /// path of a TorchScript file.
    model: String,
    /// Shape of one sample, e.g. 3x224x224 (default: the built-in's usual input).
    #[arg(long, value_name = "SHAPE", value_parser = parse_shape)]
    input: Option<Shape>,
    /// Integer token inputs in 0..VOCAB (language models) instead of floats.
    #[arg(long, value_name = "VOCAB")]
    vocab: Option<i64>,
    /// Precision of parameters and inputs.
    #[arg(long, value_enum, default_value = "fp32")]
    dtype: Dtype,
    /// Optimizer whose state is allocated by a real step.
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: Optimizer,
    /// Forward only, no gradients (serving).
    #[arg(long)]
    inference: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Answer for a card of this size (e.g. 24GiB, 80GB) while running on a bigger one.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    limit: Option<u64>,
    /// Safety margin below the maximum for the recommendation, in percent.
    #[arg(long, value_name = "PCT", default_value_t = 5.0)]
    margin: f64,
    /// Largest batch worth trying.
    #[arg(long, value_name = "N", default_value_t = 65536)]
    max: u64,
    /// Return the result as JSON (the cell's value).
    #[arg(long)]
    json: bool,
}

/// One sample's shape (a newtype: clap would read a bare `Vec` as several values).
#[derive(Clone, Debug, PartialEq)]
struct Shape(Vec<i64>);

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
        let model = model_source(&args, ctx)?;
        let request = MaxBatchRequest {
            model,
            input: args.input.clone().map(|s| s.0),
            vocab: args.vocab,
            dtype: match args.dtype {
                Dtype::Fp32 => None,
                Dtype::Fp16 => Some(Precision::Fp16),
                Dtype::Bf16 => Some(Precision::Bf16),
            },
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
            baseline_search: false,
        };
        run_search(&args, &request, ctx)
    }
}

fn model_source(args: &Args, ctx: &MagicContext) -> Result<ModelSource, MagicError> {
    if BUILTIN_MODELS.contains(&args.model.as_str()) {
        return Ok(ModelSource::Builtin {
            name: args.model.clone(),
        });
    }
    if std::path::Path::new(&args.model).is_file() {
        return Ok(ModelSource::TorchScript {
            path: args.model.clone(),
        });
    }
    let python_hint = if ctx.python.is_some() {
        " To size a model from this notebook, save it as TorchScript first \
         (torch.jit.script(model).save('model.pt')) and pass the path."
    } else {
        ""
    };
    Err(MagicError::usage(format!(
        "%maxbatch: {:?} is neither a built-in model nor a TorchScript file. Built-ins: {}.{python_hint}",
        args.model,
        BUILTIN_MODELS.join(", ")
    )))
}

#[cfg(not(feature = "torch"))]
fn run_search(_: &Args, _: &MaxBatchRequest, _: &MagicContext) -> Result<(), MagicError> {
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
    ctx: &MagicContext,
) -> Result<(), MagicError> {
    use gpuprobe::plugin_api::Request;
    let failed =
        |e: crate::torch_plugin::PluginError| MagicError::new("MaxBatchError", e.to_string());
    let plugin = crate::torch_plugin::plugin().map_err(failed)?;
    let info = plugin.request(&Request::Info).map_err(failed)?;
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
    let trials = std::sync::Mutex::new(Vec::<Value>::new());
    ctx.out.emit(Output::Display {
        data: progress(&[]),
        display_id: Some(display_id.clone()),
    });
    let mut on_event = |event: &str| -> bool {
        if let Ok(event) = serde_json::from_str::<Value>(event) {
            let mut trials = trials
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            trials.push(event);
            ctx.out.emit(Output::Update {
                data: progress(&trials),
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
    let data = summary(args, &report);
    ctx.out.emit(if args.json {
        Output::Result { data }
    } else {
        Output::Display {
            data,
            display_id: None,
        }
    });
    Ok(())
}

fn progress(trials: &[Value]) -> Bundle {
    let mut text = String::from("%maxbatch: trying batch sizes\n");
    for t in trials {
        let outcome = match t["outcome"]["result"].as_str() {
            Some("out_of_memory") => "out of memory".to_string(),
            _ => format!(
                "peak {}{}",
                human_bytes(t["outcome"]["peak"].as_u64().unwrap_or(0)),
                if t["fits"] == Value::Bool(true) {
                    ""
                } else {
                    " (over the limit)"
                }
            ),
        };
        text.push_str(&format!(
            "  batch {:>6}: {:<28} {:>8.0} ms\n",
            t["batch"],
            outcome,
            t["ms"].as_f64().unwrap_or(0.0)
        ));
    }
    let html = format!("<pre>{}</pre>", html_escape(&text));
    bundle(text, Some(html))
}

/// The result: maximum, recommendation, assumptions, and the chart.
fn summary(args: &Args, report: &MaxBatchReport) -> Bundle {
    let search = &report.search;
    let max = search["max_fit"].as_u64();
    let exact = search["exact"] == Value::Bool(true);
    let trials = search["trials"].as_array().cloned().unwrap_or_default();
    let recommended = max.map(|m| gpuprobe::search::recommend(m, args.margin / 100.0));
    let per_sample = search["fit"][1].as_f64();
    let fixed = search["fit"][0].as_f64();
    let dtype = format!("{:?}", args.dtype).to_lowercase();
    let optimizer = if args.inference {
        "none (inference, no gradients)".to_string()
    } else {
        format!("{:?}", args.optimizer).to_lowercase()
    };
    let input = args
        .input
        .as_ref()
        .map(|s| {
            s.0.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("x")
        })
        .unwrap_or_else(|| "the model's default".into());
    let mut text =
        match (max, recommended) {
            (Some(max), Some(rec)) => format!(
            "%maxbatch {}: largest batch that fits: {max}{}; recommended: {rec} ({}% margin{})\n",
            args.model,
            if exact { "" } else { " (not confirmed: trial budget reached)" },
            args.margin,
            if rec % 8 == 0 && rec >= 16 { ", multiple of 8" } else { "" },
        ),
            _ => format!(
                "%maxbatch {}: not even a batch of 1 fits in {}.\n",
                args.model,
                human_bytes(report.limit)
            ),
        };
    text.push_str(&format!(
        "  {} trials in {:.1} s; memory limit {} of {}\n",
        trials.len(),
        report.elapsed_ms / 1000.0,
        human_bytes(report.limit),
        human_bytes(report.device_total)
    ));
    if let (Some(fixed), Some(per)) = (fixed, per_sample) {
        text.push_str(&format!(
            "  memory ~ {} fixed + {} per sample (fit of the first two steps)\n",
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(per.max(0.0) as u64)
        ));
    }
    text.push_str(&format!(
        "  assumed: dtype {dtype}, optimizer {optimizer}, input {input} per sample{}\n",
        args.vocab
            .map(|v| format!(", token ids < {v}"))
            .unwrap_or_default()
    ));
    text.push_str(&format!(
        "  afterwards gpukernel holds {} allocated, {} reserved (cache emptied)\n",
        human_bytes(report.after_allocated),
        human_bytes(report.after_reserved)
    ));
    let mut html = format!("<pre>{}</pre>", html_escape(&text));
    html.push_str(&chart(&trials, report.limit, fixed, per_sample));
    let mut data = bundle(text, Some(html));
    let value = json!({
        "model": args.model, "max_batch": max, "exact": exact, "recommended": recommended,
        "margin_percent": args.margin, "limit_bytes": report.limit,
        "fit": {"fixed_bytes": fixed, "bytes_per_sample": per_sample},
        "assumptions": {"dtype": dtype, "optimizer": optimizer, "input": input, "vocab": args.vocab},
        "trials": trials, "trial_ms": report.trial_ms, "elapsed_ms": report.elapsed_ms,
        "after_allocated_bytes": report.after_allocated,
    });
    data.insert("application/json".into(), value);
    data
}

/// Peak memory against batch size: trials, the fitted line and the limit, as inline SVG.
fn chart(trials: &[Value], limit: u64, fixed: Option<f64>, per_sample: Option<f64>) -> String {
    let (w, h, pad) = (480.0, 240.0, 40.0);
    let max_b = trials
        .iter()
        .filter_map(|t| t["batch"].as_f64())
        .fold(1.0, f64::max)
        * 1.05;
    let max_m = limit as f64 * 1.15;
    let x = |b: f64| pad + (w - 2.0 * pad) * b / max_b;
    let y = |m: f64| h - pad - (h - 2.0 * pad) * (m / max_m).min(1.0);
    let gib = 1024f64.powi(3);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" style=\"font:11px sans-serif\">\
         <line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#888\"/>\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"#888\"/>\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">batch size</text>\
         <text x=\"4\" y=\"{}\">GiB</text>",
        h - pad, w - pad, h - pad, h - pad, w / 2.0, h - 8.0, pad - 8.0
    );
    svg.push_str(&format!(
        "<line x1=\"{pad}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"#d9534f\" stroke-dasharray=\"4\"/>\
         <text x=\"{}\" y=\"{}\" fill=\"#d9534f\" text-anchor=\"end\">limit {:.1} GiB</text>",
        w - pad,
        w - pad,
        y(limit as f64) - 4.0,
        limit as f64 / gib,
        ly = y(limit as f64)
    ));
    if let (Some(c), Some(s)) = (fixed, per_sample) {
        svg.push_str(&format!(
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#5b8def\" stroke-dasharray=\"2\"/>",
            x(0.0),
            y(c.max(0.0)),
            x(max_b),
            y(c + s * max_b)
        ));
    }
    for t in trials {
        let b = t["batch"].as_f64().unwrap_or(0.0);
        match t["outcome"]["peak"].as_f64() {
            Some(peak) => svg.push_str(&format!(
                "<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"{}\"><title>batch {b}: {:.2} GiB</title></circle>",
                x(b),
                y(peak),
                if t["fits"] == Value::Bool(true) { "#5cb85c" } else { "#f0ad4e" },
                peak / gib
            )),
            None => svg.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" fill=\"#d9534f\" text-anchor=\"middle\">✕<title>batch {b}: out of memory</title></text>",
                x(b),
                pad - 2.0
            )),
        }
    }
    svg.push_str("</svg>");
    svg
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

    #[test]
    fn summary_states_the_answer_and_draws_the_trials() {
        let args = Args::try_parse_from(["%maxbatch", "resnet50", "--margin", "5"]).unwrap();
        let report = MaxBatchReport {
            search: json!({
                "max_fit": 1705, "min_fail": 1706, "exact": true,
                "fit": [4.0e8, 8.67e7],
                "trials": [
                    {"batch": 2, "outcome": {"result": "ran", "peak": 573000000u64}, "fits": true},
                    {"batch": 16, "outcome": {"result": "ran", "peak": 1787000000u64}, "fits": true},
                    {"batch": 1705, "outcome": {"result": "ran", "peak": 148000000000u64}, "fits": true},
                    {"batch": 1706, "outcome": {"result": "out_of_memory"}, "fits": false}
                ],
                "stopped": null
            }),
            limit: 150_000_000_000,
            baseline_allocated: 100_000_000,
            after_allocated: 0,
            after_reserved: 0,
            trial_ms: vec![(2, 100.0)],
            elapsed_ms: 3000.0,
            device_total: 150_000_000_000,
        };
        let data = summary(&args, &report);
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("largest batch that fits: 1705"), "{text}");
        assert!(text.contains("recommended: 1616"), "{text}");
        assert!(text.contains("optimizer adam"), "{text}");
        let html = data["text/html"].as_str().unwrap();
        assert_eq!(html.matches("<circle").count(), 3);
        assert!(html.contains("out of memory"));
        assert_eq!(data["application/json"]["recommended"], 1616);
    }
}
