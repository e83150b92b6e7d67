//! The live `%gpumem --watch` gauge: used memory per GPU with a short history sparkline.
//! NVML only: it never asks the Python kernel anything, so it cannot slow it down.

use super::{bundle, html_escape, Bundle, CancelToken, GpuState, Output, OutputSink};
use gpuprobe::units::human_bytes;
use gpuprobe::{GpuSnapshot, ProbeError};
use std::time::Duration;

/// Samples kept per GPU for the sparkline.
const HISTORY: usize = 40;
const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// The gauge's memory of past samples (used fraction per GPU).
#[derive(Default)]
pub struct Gauge {
    history: Vec<Vec<f64>>,
    interval: f64,
    /// Samples taken so far, and how many there will be (`--count`): shown so the gauge is
    /// visibly alive even when nothing it measures changes (no driver yet, an idle card).
    samples: u64,
    count: Option<u64>,
}

fn sparkline(samples: &[f64]) -> String {
    samples
        .iter()
        .map(|f| BARS[((f.clamp(0.0, 1.0) * 7.0).round()) as usize])
        .collect()
}

fn svg(samples: &[f64]) -> String {
    let points: Vec<String> = samples
        .iter()
        .enumerate()
        .map(|(i, f)| format!("{},{:.1}", i * 3, 20.0 - 20.0 * f.clamp(0.0, 1.0)))
        .collect();
    format!(
        "<svg width=\"{}\" height=\"20\" style=\"vertical-align:middle;background:#f4f4f4\">\
         <polyline fill=\"none\" stroke=\"#76b900\" stroke-width=\"1.5\" points=\"{}\"/></svg>",
        HISTORY * 3,
        points.join(" ")
    )
}

impl Gauge {
    pub fn new(interval: f64, count: Option<u64>) -> Self {
        Self {
            history: Vec::new(),
            interval,
            samples: 0,
            count,
        }
    }

    /// "sample 2 of 4", or "sample 2" without a count.
    fn progress(&self) -> String {
        match self.count {
            Some(n) => format!("sample {} of {n}", self.samples),
            None => format!("sample {}", self.samples),
        }
    }

    /// Adds a sample and renders the gauge.
    pub fn render(&mut self, snapshot: &Result<GpuSnapshot, ProbeError>) -> Bundle {
        self.samples += 1;
        let snapshot = match snapshot {
            Ok(s) => s,
            Err(e) => {
                let text = format!(
                    "GPU gauge: {e}; retrying every {} s ({}).",
                    self.interval,
                    self.progress()
                );
                return bundle(
                    text.clone(),
                    Some(format!("<pre>{}</pre>", html_escape(&text))),
                );
            }
        };
        self.history.resize_with(snapshot.gpus.len(), Vec::new);
        let mut text = String::new();
        let mut html = String::from("<table><tbody>");
        for (gpu, history) in snapshot.gpus.iter().zip(self.history.iter_mut()) {
            let fraction = if gpu.memory_total == 0 {
                0.0
            } else {
                gpu.memory_used as f64 / gpu.memory_total as f64
            };
            history.push(fraction);
            if history.len() > HISTORY {
                history.remove(0);
            }
            let util = gpu
                .utilization_gpu
                .map(|u| format!("{u}%"))
                .unwrap_or_else(|| "n/a".into());
            text.push_str(&format!(
                "GPU {} {:>10} / {:>10} ({:>5.1}%) util {:>4}  {}\n",
                gpu.index,
                human_bytes(gpu.memory_used),
                human_bytes(gpu.memory_total),
                fraction * 100.0,
                util,
                sparkline(history)
            ));
            html.push_str(&format!(
                "<tr><td>GPU {}</td><td>{} / {}</td><td>{:.1}%</td><td>util {}</td><td>{}</td></tr>",
                gpu.index,
                human_bytes(gpu.memory_used),
                human_bytes(gpu.memory_total),
                fraction * 100.0,
                util,
                svg(history)
            ));
        }
        html.push_str("</tbody></table>");
        text.push_str(&format!(
            "({}, every {} s; %gpumem --stop ends it)\n",
            self.progress(),
            self.interval
        ));
        bundle(text, Some(html))
    }
}

/// Runs a gauge until `cancel` or `count` updates; returns false if it was cancelled.
pub fn run(
    gpu: &GpuState,
    out: &dyn OutputSink,
    cancel: &CancelToken,
    interval: f64,
    count: Option<u64>,
) -> bool {
    let mut gauge = Gauge::new(interval, count);
    let display_id = format!("gpumem-watch-{}", uuid::Uuid::new_v4());
    out.emit(Output::Display {
        data: gauge.render(&gpu.snapshot()),
        display_id: Some(display_id.clone()),
    });
    let mut updates = 1;
    while count.is_none_or(|n| updates < n) {
        if !cancel.sleep(Duration::from_secs_f64(interval)) {
            return false;
        }
        out.emit(Output::Update {
            data: gauge.render(&gpu.snapshot()),
            display_id: display_id.clone(),
        });
        updates += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparkline_spans_empty_to_full() {
        assert_eq!(sparkline(&[0.0, 0.5, 1.0, 2.0]), "▁▅██");
    }

    #[test]
    fn every_sample_without_a_driver_says_which_it_is() {
        let mut gauge = Gauge::new(0.5, Some(4));
        let texts: Vec<String> = (0..4)
            .map(|_| {
                let data = gauge.render(&Err(ProbeError::NoDriver("libnvidia-ml".into())));
                data.get("text/plain")
                    .map(ToString::to_string)
                    .unwrap_or_default()
            })
            .collect();
        assert!(texts[0].contains("(sample 1 of 4)"), "{texts:?}");
        assert!(texts[3].contains("(sample 4 of 4)"), "{texts:?}");
    }

    #[test]
    fn gauge_keeps_a_bounded_history() {
        use gpuprobe::GpuInfo;
        let mut gauge = Gauge::new(1.0, None);
        let snap = GpuSnapshot {
            driver_version: "1".into(),
            cuda_driver_version: None,
            gpus: vec![GpuInfo {
                index: 0,
                name: "G".into(),
                uuid: "u".into(),
                pci_bus_id: "b".into(),
                memory_used: 50,
                memory_free: 50,
                memory_total: 100,
                utilization_gpu: Some(3),
                processes: vec![],
            }],
        };
        for _ in 0..100 {
            gauge.render(&Ok(snap.clone()));
        }
        assert_eq!(gauge.history[0].len(), HISTORY);
        let text = gauge
            .render(&Ok(snap.clone()))
            .get("text/plain")
            .cloned()
            .unwrap_or_default();
        assert!(text.to_string().contains("sample 101,"), "{text}");
        let text = gauge.render(&Ok(snap)).get("text/plain").cloned().unwrap();
        assert!(text.as_str().unwrap().contains("50.0%"));
    }
}
