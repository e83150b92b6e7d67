//! What `%maxbatch` shows: live trial progress, then the answer, its assumptions and an SVG
//! chart of peak memory against batch size (torch builds only).

use super::maxbatch::Args;
use super::python::ExportedModule;
use super::{bundle, html_escape, Bundle};
use gpuprobe::plugin_api::{MaxBatchReport, ThroughputPoint};
use gpuprobe::units::human_bytes;
use serde_json::{json, Value};

pub(super) fn progress(events: &[Value]) -> Bundle {
    let mut text = String::from("%maxbatch: trying batch sizes\n");
    for e in events {
        let line = if e["event"] == "throughput" {
            let speed = match e["samples_per_s"].as_f64() {
                Some(v) => format!("{v:.0} samples/s"),
                None => "out of memory".to_string(),
            };
            format!("  timing {:>6}: {speed}\n", e["batch"])
        } else {
            let outcome = match e["outcome"]["result"].as_str() {
                Some("out_of_memory") => "out of memory".to_string(),
                _ => format!(
                    "fits, peak {}{}",
                    human_bytes(e["outcome"]["peak"].as_u64().unwrap_or(0)),
                    if e["fits"] == Value::Bool(true) {
                        ""
                    } else {
                        " (over the limit)"
                    }
                ),
            };
            format!(
                "  batch {:>6}: {:<32} {:>8.0} ms\n",
                e["batch"],
                outcome,
                e["ms"].as_f64().unwrap_or(0.0)
            )
        };
        text.push_str(&line);
    }
    let html = format!("<pre>{}</pre>", html_escape(&text));
    bundle(text, Some(html))
}

/// The line saying where a notebook module came from.
pub(super) fn exported_line(name: &str, module: &ExportedModule) -> String {
    format!(
        "%maxbatch: {name} ({} parameters) saved as TorchScript by torch.jit.{} for the trials; \
         the notebook's module is untouched\n",
        module.parameters, module.method
    )
}

/// `--throughput`'s timings and its pick.
pub(super) struct Throughput {
    pub(super) points: Vec<ThroughputPoint>,
    /// The fastest batch; a smaller one within 2% of it wins (less memory, more updates).
    pub(super) best: Option<u64>,
}

impl Throughput {
    pub(super) fn from_points(points: Vec<ThroughputPoint>) -> Self {
        let fastest = points
            .iter()
            .filter_map(|p| p.samples_per_s)
            .fold(None, |best: Option<f64>, v| {
                Some(best.map_or(v, |b| b.max(v)))
            });
        let best = fastest.and_then(|top| {
            points
                .iter()
                .filter(|p| p.samples_per_s.is_some_and(|v| v >= 0.98 * top))
                .map(|p| p.batch)
                .min()
        });
        Self { points, best }
    }
}

/// Batch sizes `--throughput` times: the recommendation and fractions of it, multiples of 8.
pub(super) fn throughput_candidates(recommended: u64) -> Vec<u64> {
    let mut batches: Vec<u64> = [1.0, 0.75, 0.5, 0.25]
        .iter()
        .map(|f| {
            let b = (recommended as f64 * f) as u64;
            if b >= 16 {
                b - b % 8
            } else {
                b.max(1)
            }
        })
        .collect();
    batches.dedup();
    batches
}

/// Timed steps per `--throughput` candidate (after two warm-up steps).
pub(super) const THROUGHPUT_STEPS: u32 = 5;

/// The result: maximum, recommendation, assumptions, and the chart.
pub(super) fn summary(
    args: &Args,
    report: &MaxBatchReport,
    exported: Option<&ExportedModule>,
    throughput: Option<&Throughput>,
) -> Bundle {
    let search = &report.search;
    let max = search["max_fit"].as_u64();
    let exact = search["exact"] == Value::Bool(true);
    let settled = search["settled"] == Value::Bool(true); // implied by `exact`
    let trials = search["trials"].as_array().cloned().unwrap_or_default();
    let recommended = max.map(|m| gpuprobe::search::recommend(m, args.margin / 100.0));
    let per_sample = search["fit"][1].as_f64();
    let fixed = search["fit"][0].as_f64();
    let precision = match args.amp {
        Some(amp) => format!("fp32 weights, {amp:?} autocast").to_lowercase(),
        None => format!("{:?}", args.dtype).to_lowercase(),
    };
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
    let accuracy = if exact {
        String::new()
    } else if settled {
        " (within 1%: --exact for the last sample)".to_string()
    } else {
        " (not confirmed: trial budget reached)".to_string()
    };
    let mut text = match (max, recommended) {
        (Some(max), Some(rec)) => format!(
            "%maxbatch {}: largest batch that fits: {max}{accuracy}; recommended: {rec} ({}% margin{})\n",
            args.model,
            args.margin,
            if rec % 8 == 0 && rec >= 16 { ", multiple of 8" } else { "" },
        ),
        _ => format!(
            "%maxbatch {}: not even a batch of 1 fits in {}.\n",
            args.model,
            human_bytes(report.limit)
        ),
    };
    if let Some(t) = throughput {
        for p in &t.points {
            let speed = p
                .samples_per_s
                .map_or("out of memory".to_string(), |v| format!("{v:.0} samples/s"));
            let mark = if Some(p.batch) == t.best {
                "  <- fastest"
            } else {
                ""
            };
            text.push_str(&format!("  batch {:>6}: {speed}{mark}\n", p.batch));
        }
    }
    let card = match (args.limit, report.context_bytes) {
        (Some(card), Some(ctx)) => format!(
            " (a {} card less {} of CUDA context)",
            human_bytes(card),
            human_bytes(ctx)
        ),
        (Some(card), None) => format!(" (a {} card)", human_bytes(card)),
        _ => String::new(),
    };
    text.push_str(&format!(
        "  {} trials in {:.1} s; memory limit {}{card} on a {} GPU\n",
        trials.len(),
        report.elapsed_ms / 1000.0,
        human_bytes(report.limit),
        human_bytes(report.device_total)
    ));
    if let (Some(fixed), Some(per)) = (fixed, per_sample) {
        text.push_str(&format!(
            "  allocated ~ {} fixed + {} per sample (fit of the first two trials)\n",
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(per.max(0.0) as u64)
        ));
    }
    let model = match exported {
        Some(m) => format!(", model from the notebook (torch.jit.{})", m.method),
        None => String::new(),
    };
    text.push_str(&format!(
        "  assumed: {precision}, optimizer {optimizer}, input {input} per sample{}{model}\n",
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
    html.push_str(&chart(
        &trials,
        &report.trial_reserved,
        report.limit,
        fixed,
        per_sample,
    ));
    let mut data = bundle(text, Some(html));
    let value = json!({
        "model": args.model, "max_batch": max, "exact": exact, "settled": settled,
        "recommended": recommended,
        "margin_percent": args.margin, "limit_bytes": report.limit,
        "context_bytes": report.context_bytes,
        "fit": {"fixed_bytes": fixed, "bytes_per_sample": per_sample},
        "assumptions": {"precision": precision, "optimizer": optimizer, "input": input,
                        "vocab": args.vocab, "exported_by": exported.map(|m| m.method.clone())},
        "throughput": throughput.map(|t| json!({"points": t.points, "fastest": t.best})),
        "trials": trials, "trial_ms": report.trial_ms, "trial_reserved": report.trial_reserved,
        "elapsed_ms": report.elapsed_ms,
        "after_allocated_bytes": report.after_allocated,
    });
    data.insert("application/json".into(), value);
    data
}

/// Peak memory against batch size: trials, the fitted line and the limit, as inline SVG.
fn chart(
    trials: &[Value],
    reserved: &[(u64, u64)],
    limit: u64,
    fixed: Option<f64>,
    per_sample: Option<f64>,
) -> String {
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
    // The cache's reserved peaks, hollow: what the device held beside what was allocated.
    for &(b, r) in reserved {
        svg.push_str(&format!(
            "<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"none\" stroke=\"#999\"><title>batch {b}: {:.2} GiB reserved</title></circle>",
            x(b as f64),
            y(r as f64),
            r as f64 / gib
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
    use clap::Parser;

    #[test]
    fn summary_states_the_answer_and_draws_the_trials() {
        let args = Args::try_parse_from(["%maxbatch", "resnet50", "--margin", "5"]).unwrap();
        let report = MaxBatchReport {
            search: json!({
                "max_fit": 1705, "min_fail": 1706, "exact": true, "settled": true,
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
            trial_reserved: vec![(2, 600_000_000)],
            elapsed_ms: 3000.0,
            device_total: 150_000_000_000,
            context_bytes: None,
        };
        let data = summary(&args, &report, None, None);
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("largest batch that fits: 1705"), "{text}");
        assert!(text.contains("recommended: 1616"), "{text}");
        assert!(text.contains("optimizer adam"), "{text}");
        let html = data["text/html"].as_str().unwrap();
        assert_eq!(html.matches("<circle").count(), 4); // 3 allocated peaks, 1 reserved
        assert!(html.contains("out of memory"));
        assert_eq!(data["application/json"]["recommended"], 1616);
    }

    #[test]
    fn throughput_picks_the_fastest_and_prefers_the_smaller_on_a_tie() {
        let point = |batch, v: Option<f64>| ThroughputPoint {
            batch,
            samples_per_s: v,
        };
        let t = Throughput::from_points(vec![
            point(1568, Some(2990.0)),
            point(1176, Some(3000.0)),
            point(784, Some(2950.0)),
            point(392, Some(2500.0)),
        ]);
        assert_eq!(t.best, Some(784));
        let t = Throughput::from_points(vec![point(64, None), point(32, Some(10.0))]);
        assert_eq!(t.best, Some(32));
        assert_eq!(Throughput::from_points(vec![point(64, None)]).best, None);
    }

    #[test]
    fn throughput_candidates_are_multiples_of_eight_below_the_recommendation() {
        assert_eq!(throughput_candidates(1568), vec![1568, 1176, 784, 392]);
        assert_eq!(throughput_candidates(8), vec![8, 6, 4, 2]);
        assert_eq!(throughput_candidates(1), vec![1]);
    }
}
