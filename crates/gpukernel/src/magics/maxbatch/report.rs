//! What `%maxbatch` shows, whichever engine ran the trials: live progress (every trial, the
//! running one with its time so far), then the answer, what it assumed, what the user's
//! process held, and an SVG chart of peak memory against batch size.

use crate::magics::{bundle, html_escape, Bundle, Output, OutputSink};
use gpuprobe::search::{Outcome, Phase, SearchResult};
use gpuprobe::stranded::Room;
use gpuprobe::units::human_bytes;
use serde::Serialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// One line of the live progress.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Line {
    Running {
        batch: u64,
        elapsed: Duration,
    },
    Trial {
        batch: u64,
        outcome: Outcome,
        fits: bool,
        ms: f64,
    },
    Timing {
        batch: u64,
        samples_per_s: Option<f64>,
    },
}

/// The live display of a search: one display, updated in place (from a ticker thread too).
pub(super) struct Live<'a> {
    out: &'a dyn OutputSink,
    display_id: String,
    title: String,
    lines: Mutex<Vec<Line>>,
}

impl<'a> Live<'a> {
    pub(super) fn start(out: &'a dyn OutputSink, title: String) -> Self {
        let live = Self {
            out,
            display_id: format!("maxbatch-{}", uuid::Uuid::new_v4()),
            title,
            lines: Mutex::new(Vec::new()),
        };
        live.out.emit(Output::Display {
            data: progress(&live.title, &[]),
            display_id: Some(live.display_id.clone()),
        });
        live
    }

    /// Shows `line`, replacing the running trial's line if there is one.
    pub(super) fn show(&self, line: Line) {
        let data = {
            let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
            if matches!(lines.last(), Some(Line::Running { .. })) {
                lines.pop();
            }
            lines.push(line);
            progress(&self.title, &lines)
        };
        self.out.emit(Output::Update {
            data,
            display_id: self.display_id.clone(),
        });
    }
}

pub(super) fn progress(title: &str, lines: &[Line]) -> Bundle {
    let mut text = format!("{title}\n");
    for line in lines {
        text.push_str(&match line {
            Line::Running { batch, elapsed } => {
                format!(
                    "  batch {batch:>6}: running ({:.0} s)\n",
                    elapsed.as_secs_f64()
                )
            }
            Line::Trial {
                batch,
                outcome,
                fits,
                ms,
            } => {
                let what = match outcome {
                    Outcome::OutOfMemory { .. } => "out of memory".to_string(),
                    Outcome::Ran { peak, .. } => format!(
                        "fits, peak {}{}",
                        human_bytes(*peak),
                        if *fits { "" } else { " (over the limit)" }
                    ),
                };
                format!("  batch {batch:>6}: {what:<32} {ms:>8.0} ms\n")
            }
            Line::Timing {
                batch,
                samples_per_s,
            } => match samples_per_s {
                Some(v) => format!("  timing {batch:>6}: {v:.0} samples/s\n"),
                None => format!("  timing {batch:>6}: out of memory\n"),
            },
        });
    }
    let html = format!("<pre>{}</pre>", html_escape(&text));
    bundle(text, Some(html))
}

/// Which engine ran the trials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum EngineKind {
    /// The user's own eager steps in their Python kernel.
    Python,
    /// gpukernel's in-process libtorch harness.
    #[cfg_attr(not(feature = "torch"), allow(dead_code))]
    Libtorch,
}

/// What the trials ran, in the user's words.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Assumptions {
    pub(super) engine: EngineKind,
    /// What one trial step is.
    pub(super) step: String,
    pub(super) loss: Option<String>,
    pub(super) precision: String,
    pub(super) optimizer: String,
    pub(super) input: Option<String>,
}

/// Memory the user's process held when the search started: counted in every trial.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Held {
    pub(super) who: String,
    pub(super) allocated: u64,
    pub(super) reserved: u64,
}

/// `--throughput`'s timings and its pick.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Throughput {
    pub(super) points: Vec<(u64, Option<f64>)>,
    /// The fastest batch; a smaller one within 2% of it wins (less memory, more updates).
    pub(super) best: Option<u64>,
}

impl Throughput {
    pub(super) fn from_points(points: Vec<(u64, Option<f64>)>) -> Self {
        let fastest = points
            .iter()
            .filter_map(|p| p.1)
            .fold(None, |best: Option<f64>, v| {
                Some(best.map_or(v, |b| b.max(v)))
            });
        let best = fastest.and_then(|top| {
            points
                .iter()
                .filter(|p| p.1.is_some_and(|v| v >= 0.98 * top))
                .map(|p| p.0)
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

/// `--limit`: the card size asked about and the CUDA context taken off it (`None` where NVML
/// could not say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Card {
    pub(super) bytes: u64,
    pub(super) context: Option<u64>,
}

/// Everything the answer shows.
#[derive(Debug, Clone)]
pub(super) struct Findings {
    /// What was sized, as the user named it.
    pub(super) model: String,
    pub(super) search: SearchResult,
    pub(super) assumptions: Assumptions,
    /// Bytes a trial may peak at.
    pub(super) limit: u64,
    pub(super) device_total: u64,
    /// `--limit`: the card asked about.
    pub(super) card: Option<Card>,
    pub(super) elapsed_ms: f64,
    pub(super) trial_ms: Vec<(u64, f64)>,
    /// Steps each trial ran (it ends once a step repeats the one before).
    pub(super) trial_steps: Vec<(u64, u32)>,
    pub(super) trial_reserved: Vec<(u64, u64)>,
    pub(super) held: Option<Held>,
    /// One line on what is left afterwards.
    pub(super) after: String,
    pub(super) notes: Vec<String>,
    pub(super) margin_percent: f64,
    pub(super) throughput: Option<Throughput>,
    /// The recommendation run as a trial of its own (python engine, unless `--no-confirm`).
    pub(super) confirmation: Option<Confirmation>,
    /// The room left for a block the cache strands (default allocator, either engine).
    pub(super) room: Option<Room>,
    pub(super) timings: Option<Timings>,
}

/// Where a python-engine search's time went, in ms: each side-channel call end to end, and
/// what the Python side measured inside the trials (summed over the search's and the
/// confirmation's). What a call took beyond its Python-side parts is the side channel's.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Timings {
    pub(super) prepare: f64,
    pub(super) set_loss: f64,
    pub(super) close: f64,
    pub(super) trial_calls: f64,
    /// Inside the trials: the steps themselves, the cache emptied before the first, the
    /// step's garbage collected, the cache emptied after it, the state put back.
    pub(super) steps: f64,
    /// Reading the cache's segments after each trial that ran (the largest block).
    pub(super) segments: f64,
    pub(super) settle: f64,
    pub(super) collect: f64,
    pub(super) empty_cache: f64,
    pub(super) restore: f64,
    /// The Python side's own laps of `prepare` and `close`.
    pub(super) prepare_laps: BTreeMap<String, f64>,
    pub(super) close_laps: BTreeMap<String, f64>,
}

/// The trials that ran the recommendation itself, from the state the user's training starts in.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Confirmation {
    /// The batch that ran (`None`: none of the candidates did).
    pub(super) batch: Option<u64>,
    /// Candidates below the maximum that ran out of memory first, largest first.
    pub(super) failed: Vec<u64>,
    pub(super) steps: u32,
    pub(super) ms: f64,
    /// The batch that ran was one of the search's own trials (no trial of its own).
    pub(super) during_search: bool,
}

impl Findings {
    pub(super) fn recommended(&self) -> Option<u64> {
        if self.search.flat_memory().is_some() {
            return None; // the trials sized no batch
        }
        match &self.confirmation {
            Some(c) => c.batch,
            None => self
                .search
                .max_fit
                .map(|m| gpuprobe::stranded::recommend(m, self.margin_percent / 100.0, self.room)),
        }
    }

    /// The margin's batch below the maximum, before any room.
    fn margin_batch(&self) -> Option<u64> {
        let max = self.search.max_fit?;
        Some(gpuprobe::search::recommend(
            max,
            self.margin_percent / 100.0,
        ))
    }

    /// What the report says of the room for a stranded block, if anything. A bound below half
    /// the margin's batch is out of reach (a note only); else one below the margin's batch
    /// holds the recommendation (its own line); else one the maximum lies beyond by more
    /// than the search's tolerance gets a note on the batches between, unless the
    /// recommendation itself failed, whose line says what fragmentation did.
    fn room_says(&self) -> Option<(RoomSays, Room)> {
        let room = self.room?;
        let max = self.search.max_fit?;
        let margin = self.margin_batch()?;
        if room.out_of_reach(margin) {
            return Some((RoomSays::OutOfReach, room));
        }
        self.recommended()?;
        if room.holds(margin).is_some() {
            return Some((RoomSays::HoldsTheRecommendation, room));
        }
        let failed = self
            .confirmation
            .as_ref()
            .is_some_and(|c| !c.failed.is_empty());
        let precision = ((max as f64 * super::TOLERANCE).ceil() as u64).max(1);
        (!failed && max.saturating_sub(room.largest_batch) > precision)
            .then_some((RoomSays::ShortOfMax, room))
    }

    /// Whether the room held the recommendation below the margin's batch.
    fn room_held(&self) -> bool {
        matches!(
            self.room_says(),
            Some((RoomSays::HoldsTheRecommendation, _))
        )
    }
}

/// What the report says of the room for a stranded block (`Findings::room_says`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RoomSays {
    HoldsTheRecommendation,
    ShortOfMax,
    OutOfReach,
}

/// The result: maximum, recommendation, assumptions, and the chart.
pub(super) fn summary(f: &Findings) -> Bundle {
    let search = &f.search;
    let mut text = headline(f);
    text.push_str(&flat_memory_line(search).unwrap_or_default());
    if let Some((says, room)) = f.room_says() {
        text.push_str(&match says {
            RoomSays::HoldsTheRecommendation => room_line(&room),
            RoomSays::ShortOfMax => room_short_of_max_line(&room),
            RoomSays::OutOfReach => room_out_of_reach_line(&room),
        });
    }
    // A step whose memory did not grow had no batch sized, so none confirmed either.
    if let Some(c) = f
        .confirmation
        .as_ref()
        .filter(|_| search.flat_memory().is_none())
    {
        text.push_str(&confirmation_line(c, search.max_fit));
    }
    if let Some(t) = &f.throughput {
        text.push_str(&throughput_lines(t));
    }
    text.push_str(&format!(
        "  {} trials in {:.1} s; memory limit {}{} on a {} GPU\n",
        search.trials.len(),
        f.elapsed_ms / 1000.0,
        human_bytes(f.limit),
        card_text(f.card),
        human_bytes(f.device_total)
    ));
    if let Some((fixed, per)) = search.fit {
        // Split trials fit the peak outside the optimizer's step (search::PhasePeaks).
        let split = search
            .trials
            .first()
            .and_then(|t| t.outcome.peak_in(Phase::Optimizer))
            .is_some();
        text.push_str(&format!(
            "  allocated ~ {} fixed + {} per sample (fit of the first two trials{})\n",
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(per.max(0.0) as u64),
            if split {
                ", outside the optimizer's step"
            } else {
                ""
            }
        ));
    }
    text.push_str(&assumption_lines(&f.assumptions));
    if let Some(h) = &f.held {
        text.push_str(&format!(
            "  {} held {} allocated ({} reserved) when the search began, counted in every trial\n",
            h.who,
            human_bytes(h.allocated),
            human_bytes(h.reserved)
        ));
    }
    text.push_str(&format!("  {}\n", f.after));
    for note in &f.notes {
        text.push_str(&format!("  note: {note}\n"));
    }
    let mut html = format!("<pre>{}</pre>", html_escape(&text));
    html.push_str(&chart(search, &f.trial_reserved, f.limit));
    let mut data = bundle(text, Some(html));
    data.insert("application/json".into(), summary_json(f));
    data
}

/// Where the step's peak hardly grew with the batch (`SearchResult::flat_memory`): the trials
/// did not size a batch, so nothing is recommended.
fn flat_memory_line(search: &SearchResult) -> Option<String> {
    let (small, large) = search.flat_memory()?;
    Some(format!(
        "  its peak hardly grew with the batch: {} at batch {}, {} at batch {}, so these \
         trials sized no batch. Does the step make its batch from the size it is given? A \
         --step FN that ignores its argument (a batch drawn at a size of its own, a \
         DataLoader made once) trains at its own size whatever is asked\n",
        human_bytes(small.1),
        small.0,
        human_bytes(large.1),
        large.0
    ))
}

/// The answer's first line: the maximum, how exact it is, and the recommendation.
fn headline(f: &Findings) -> String {
    let search = &f.search;
    let Some(max) = search.max_fit else {
        return format!(
            "%maxbatch {}: not even a batch of 1 fits in {}.\n",
            f.model,
            human_bytes(f.limit)
        );
    };
    let found = if search.capped {
        format!(
            "every batch tried fits, up to {max} (--max, the largest this search tries: raise \
             it to search further)"
        )
    } else if search.exact {
        format!("largest batch that fits: {max}")
    } else if search.settled {
        format!("largest batch that fits: {max} (within 1.5%: --exact for the last sample)")
    } else {
        format!("largest batch that fits: {max} (not confirmed: trial budget reached)")
    };
    let recommendation = match f.recommended() {
        Some(rec) => format!(
            "recommended: {rec} ({}% {}{}{})",
            f.margin_percent,
            if search.capped {
                "below the cap"
            } else {
                "margin"
            },
            if f.room_held() {
                " and room for a stranded block"
            } else {
                ""
            },
            if rec % 8 == 0 && rec >= 16 {
                ", multiple of 8"
            } else {
                ""
            },
        ),
        None if search.flat_memory().is_some() => "no recommendation (see below)".to_string(),
        None => "no recommendation: the batches below it that were run did not fit (see below)"
            .to_string(),
    };
    format!("%maxbatch {}: {found}; {recommendation}\n", f.model)
}

/// Why the recommendation sits lower than the margin alone would put it.
fn room_line(room: &Room) -> String {
    format!(
        "  the recommendation leaves room for one more of your step's largest allocations ({}): \
         PyTorch's default allocator can strand one as its cache fragments, so above {} your \
         loop can run out of memory at any step from its second on, although {} ran here. \
         {EXPANDABLE}, and %maxbatch recommends from the margin alone\n",
        block_text(room),
        room.largest_batch,
        room.at_batch,
    )
}

/// Where the margin alone leaves the room, but batches above the room's bound ran: they are
/// not safe to train at either (a Hugging Face GPT-2 on an H100: 76 ran in the trials, the
/// loop's own maximum was 73, the bound 73; maxbatch-truth-2026-12-07j).
fn room_short_of_max_line(room: &Room) -> String {
    format!(
        "  note: above {} your loop can run out of memory at any step from its second on, \
         although {} ran here: PyTorch's default allocator can strand one of your step's \
         largest allocations ({}) as its cache fragments, and the recommendation leaves room \
         for it. {EXPANDABLE}\n",
        room.largest_batch,
        room.at_batch,
        block_text(room),
    )
}

/// Where no batch near the margin's leaves room for a stranded block.
fn room_out_of_reach_line(room: &Room) -> String {
    format!(
        "  note: your step's largest allocation ({}) barely shrinks with the batch, and \
         PyTorch's default allocator can strand one as its cache fragments: then a batch below \
         the maximum can fail after a few steps, which no batch near this recommendation \
         leaves room for. {EXPANDABLE}\n",
        block_text(room),
    )
}

/// How the cache is kept from stranding blocks.
const EXPANDABLE: &str =
    "Restart the kernel with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
     set and it strands none";

/// A stranded block's size, where it was measured, and its growth per sample.
fn block_text(room: &Room) -> String {
    let per_sample = if room.block_per_sample >= 1.0 {
        format!(", {} a sample", human_bytes(room.block_per_sample as u64))
    } else {
        String::new()
    };
    format!(
        "{} at batch {}{per_sample}",
        human_bytes(room.block),
        room.at_batch
    )
}

/// Samples per second at each batch `--throughput` ran, the fastest marked.
fn throughput_lines(t: &Throughput) -> String {
    let mut text = String::new();
    for (batch, speed) in &t.points {
        let speed = speed.map_or("out of memory".to_string(), |v| format!("{v:.0} samples/s"));
        let mark = if Some(*batch) == t.best {
            "  <- fastest"
        } else {
            ""
        };
        text.push_str(&format!("  batch {batch:>6}: {speed}{mark}\n"));
    }
    text
}

/// The card a `--limit` answer is for, as " (a 24 GiB card less 500 MiB of CUDA context)".
fn card_text(card: Option<Card>) -> String {
    match card {
        Some(Card {
            bytes,
            context: Some(ctx),
        }) => format!(
            " (a {} card less {} of CUDA context)",
            human_bytes(bytes),
            human_bytes(ctx)
        ),
        Some(Card {
            bytes,
            context: None,
        }) => format!(" (a {} card)", human_bytes(bytes)),
        None => String::new(),
    }
}

/// The report as `--json` gives it.
fn summary_json(f: &Findings) -> serde_json::Value {
    let search = &f.search;
    let recommended = f.recommended();
    json!({
        "model": f.model, "max_batch": search.max_fit, "exact": search.exact,
        "settled": search.settled, "capped": search.capped, "recommended": recommended,
        "margin_percent": f.margin_percent, "margin_batch": f.margin_batch(),
        "room_held": f.room_held(), "limit_bytes": f.limit,
        "device_total_bytes": f.device_total,
        "card_bytes": f.card.map(|c| c.bytes), "context_bytes": f.card.and_then(|c| c.context),
        "fit": {"fixed_bytes": search.fit.map(|x| x.0), "bytes_per_sample": search.fit.map(|x| x.1)},
        "engine": f.assumptions.engine, "assumptions": f.assumptions, "held": f.held,
        "throughput": f.throughput.as_ref().map(|t| json!({"points": t.points, "fastest": t.best})),
        "trials": search.trials, "stopped": search.stopped, "trial_ms": f.trial_ms, "trial_steps": f.trial_steps,
        "trial_reserved": f.trial_reserved, "elapsed_ms": f.elapsed_ms, "notes": f.notes,
        "confirmation": f.confirmation, "room": f.room, "timings_ms": f.timings,
    })
}

/// The report's lines on the engine, the step and what the trials assumed (precision, loss,
/// optimizer, input), each indented and ending in a newline.
pub(super) fn assumption_lines(a: &Assumptions) -> String {
    let engine = match a.engine {
        EngineKind::Python => "python (in your Python kernel)",
        EngineKind::Libtorch => "libtorch (in gpukernel)",
    };
    let mut assumed = vec![format!("precision {}", a.precision)];
    if let Some(loss) = &a.loss {
        assumed.push(format!("loss {loss}"));
    }
    assumed.push(format!("optimizer {}", a.optimizer));
    if let Some(input) = &a.input {
        assumed.push(format!("input {input}"));
    }
    format!(
        "  engine: {engine}; step: {}\n  assumed: {}\n",
        a.step,
        assumed.join("; ")
    )
}

/// What running the recommendation showed.
fn confirmation_line(c: &Confirmation, max: Option<u64>) -> String {
    let failed = c
        .failed
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let fragmented = format!(
        "  {failed} ran out of memory although {} fits: the allocator's fragmentation, which \
         depends on the exact tensor sizes; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
         (set before torch starts) makes memory grow with the batch again\n",
        max.map_or("a larger batch".to_string(), |m| m.to_string())
    );
    match (c.batch, c.failed.is_empty()) {
        (Some(batch), true) => format!(
            "  confirmed: {} steps at batch {batch} ran from a fresh optimizer{} ({:.0} ms)\n",
            c.steps,
            if c.during_search {
                ", in the search's own trials"
            } else {
                ""
            },
            c.ms
        ),
        (Some(batch), false) => format!(
            "{fragmented}  confirmed instead: {} steps at batch {batch} ran from a fresh optimizer\n",
            c.steps
        ),
        (None, _) => fragmented,
    }
}

/// Peak memory against batch size: trials, the fitted line and the limit, as inline SVG.
fn chart(search: &SearchResult, reserved: &[(u64, u64)], limit: u64) -> String {
    let (w, h, pad) = (480.0, 240.0, 40.0);
    let max_b = search
        .trials
        .iter()
        .map(|t| t.batch as f64)
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
    if let Some((c, s)) = search.fit {
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
    for t in &search.trials {
        let b = t.batch as f64;
        match t.outcome {
            Outcome::Ran { peak, .. } => svg.push_str(&format!(
                "<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"{}\"><title>batch {b}: {:.2} GiB</title></circle>",
                x(b),
                y(peak as f64),
                if t.fits { "#5cb85c" } else { "#f0ad4e" },
                peak as f64 / gib
            )),
            Outcome::OutOfMemory { .. } => svg.push_str(&format!(
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
    use gpuprobe::search::Trial;

    fn findings() -> Findings {
        let ran = |batch, peak| Trial {
            batch,
            outcome: Outcome::Ran {
                peak,
                reserved: peak,
                phases: None,
            },
            fits: true,
        };
        Findings {
            model: "model".into(),
            search: SearchResult {
                max_fit: Some(1705),
                min_fail: Some(1706),
                exact: true,
                settled: true,
                capped: false,
                trials: vec![
                    ran(4, 573_000_000),
                    ran(64, 1_787_000_000),
                    ran(1705, 148_000_000_000),
                    Trial {
                        batch: 1706,
                        outcome: Outcome::OutOfMemory { peak: None },
                        fits: false,
                    },
                ],
                fit: Some((4.0e8, 8.67e7)),
                stopped: None,
            },
            assumptions: Assumptions {
                engine: EngineKind::Python,
                step: "a standard step of model".into(),
                loss: Some("cross-entropy over the last dimension (1000 classes)".into()),
                precision: "fp32".into(),
                optimizer: "the notebook's opt (AdamW)".into(),
                input: Some("3x224x224".into()),
            },
            limit: 150_000_000_000,
            device_total: 150_000_000_000,
            card: None,
            elapsed_ms: 3000.0,
            trial_ms: vec![(4, 100.0)],
            trial_steps: vec![(4, 2)],
            trial_reserved: vec![(4, 600_000_000)],
            held: Some(Held {
                who: "your Python kernel (pid 7)".into(),
                allocated: 1 << 30,
                reserved: 2 << 30,
            }),
            after:
                "afterwards: your model, its optimizer and the random generators are as they were"
                    .into(),
            notes: vec![],
            margin_percent: 5.0,
            throughput: None,
            confirmation: None,
            room: None,
            timings: None,
        }
    }

    #[test]
    fn a_recommendation_the_room_holds_down_says_so_and_one_it_does_not_is_silent() {
        let mut f = findings();
        f.room = Some(Room {
            block: 20_000_000_000,
            at_batch: 1705,
            block_per_sample: 11.7e6,
            largest_batch: 1530,
        });
        let data = summary(&f);
        let text = data["text/plain"].as_str().unwrap();
        assert!(
            text.contains(
                "recommended: 1528 (5% margin and room for a stranded block, multiple of 8)"
            ),
            "{text}"
        );
        assert!(
            text.contains("room for one more of your step's largest allocations (18.6 GiB at batch 1705, 11.2 MiB a sample)"),
            "{text}"
        );
        assert!(
            text.contains("so above 1530 your loop can run out of memory at any step from its second on, although 1705 ran here. Restart the kernel with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
            "{text}"
        );
        assert_eq!(data["application/json"]["recommended"], 1528);
        assert_eq!(data["application/json"]["room"]["largest_batch"], 1530);
        assert_eq!(data["application/json"]["margin_batch"], 1616);
        assert_eq!(data["application/json"]["room_held"], true);
        let room = f.room.unwrap();
        // Room to spare at the margin's batch: the margin alone, and a note that the batches
        // above the bound, which ran here, can still fail in the loop.
        let text = with_bound(&mut f, room, 1650);
        assert!(
            text.contains("recommended: 1616 (5% margin, multiple of 8)"),
            "{text}"
        );
        assert!(
            text.contains("note: above 1650 your loop can run out of memory at any step from its second on, although 1705 ran here"),
            "{text}"
        );
        assert!(!text.contains("leaves room for one more"), "{text}");
        // The margin's batch at the bound itself: the margin alone, and the note.
        let text = with_bound(&mut f, room, 1616);
        assert!(
            text.contains("recommended: 1616 (5% margin, multiple of 8)"),
            "{text}"
        );
        assert!(text.contains("note: above 1616 your loop"), "{text}");
        // One below it: the room holds the recommendation, and its own line says why.
        let text = with_bound(&mut f, room, 1615);
        assert!(text.contains("leaves room for one more"), "{text}");
        assert!(!text.contains("note: above"), "{text}");
        // Within the search's own precision of the maximum (1.5%: 26 samples at 1705), or at
        // it: nothing to say (nanoGPT in -07j: bound 55, maximum 56, its loop's maximum 56).
        for bound in [1680, 1705] {
            let text = with_bound(&mut f, room, bound);
            assert!(!text.contains("note: above"), "{text}");
            assert!(!text.contains("expandable_segments"), "{text}");
        }
        // A recommendation that itself failed has its own line on fragmentation: no note.
        f.confirmation = Some(confirmation(Some(1608), vec![1616], 2700.0, false));
        let text = with_bound(&mut f, room, 1650);
        assert!(!text.contains("note: above"), "{text}");
        f.confirmation = None;
        // No batch near the margin's leaves room (a block of fixed size): the margin's batch,
        // and a note that only expandable segments avoid the failure.
        f.room = Some(Room {
            largest_batch: 600,
            block_per_sample: 0.0,
            ..room
        });
        let text = summary(&f)["text/plain"].as_str().unwrap().to_string();
        assert!(
            text.contains("recommended: 1616 (5% margin, multiple of 8)"),
            "{text}"
        );
        assert!(
            text.contains("note: your step's largest allocation (18.6 GiB at batch 1705) barely shrinks with the batch"),
            "{text}"
        );
        // Every candidate failed: no recommendation, so no room line either.
        f.room = Some(room);
        f.confirmation = Some(confirmation(None, vec![1528, 1520, 1512], 2700.0, false));
        let text = summary(&f)["text/plain"].as_str().unwrap().to_string();
        assert!(text.contains("no recommendation"), "{text}");
        assert!(!text.contains("leaves room"), "{text}");
    }

    /// The report's text with `room` bounded at `largest_batch`.
    fn with_bound(f: &mut Findings, room: Room, largest_batch: u64) -> String {
        f.room = Some(Room {
            largest_batch,
            ..room
        });
        summary(f)["text/plain"].as_str().unwrap().to_string()
    }

    /// A confirmation of 3 steps.
    fn confirmation(
        batch: Option<u64>,
        failed: Vec<u64>,
        ms: f64,
        during_search: bool,
    ) -> Confirmation {
        Confirmation {
            batch,
            failed,
            steps: 3,
            ms,
            during_search,
        }
    }

    #[test]
    fn a_confirmed_recommendation_is_the_one_shown_and_a_step_down_says_why() {
        let mut f = findings();
        f.confirmation = Some(confirmation(Some(1616), vec![], 900.0, false));
        let text = summary(&f)["text/plain"].as_str().unwrap().to_string();
        assert!(
            text.contains("confirmed: 3 steps at batch 1616 ran"),
            "{text}"
        );
        f.confirmation = Some(confirmation(Some(1616), vec![], 900.0, true));
        let text = summary(&f)["text/plain"].as_str().unwrap().to_string();
        assert!(
            text.contains("at batch 1616 ran from a fresh optimizer, in the search's own trials"),
            "{text}"
        );
        f.confirmation = Some(confirmation(Some(1608), vec![1616], 1800.0, false));
        let data = summary(&f);
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("recommended: 1608"), "{text}");
        assert!(
            text.contains("1616 ran out of memory although 1705 fits"),
            "{text}"
        );
        assert!(text.contains("expandable_segments:True"), "{text}");
        assert_eq!(data["application/json"]["recommended"], 1608);
        f.confirmation = Some(confirmation(None, vec![1616, 1608, 1600], 2700.0, false));
        let data = summary(&f);
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("no recommendation"), "{text}");
        assert!(data["application/json"]["recommended"].is_null());
    }

    #[test]
    fn the_fit_line_says_which_peak_it_fits() {
        let text = |f: &Findings| summary(f)["text/plain"].as_str().unwrap().to_string();
        let mut f = findings();
        assert!(
            text(&f).contains("(fit of the first two trials)\n"),
            "{}",
            text(&f)
        );
        f.search.trials[0].outcome = Outcome::Ran {
            peak: 573_000_000,
            reserved: 600_000_000,
            phases: Some(gpuprobe::search::PhasePeaks {
                outside: 500_000_000,
                optimizer: 573_000_000,
            }),
        };
        assert!(
            text(&f).contains("(fit of the first two trials, outside the optimizer's step)"),
            "{}",
            text(&f)
        );
    }

    #[test]
    fn where_the_time_went_is_in_the_json_only() {
        let mut f = findings();
        assert!(summary(&f)["application/json"]["timings_ms"].is_null());
        f.timings = Some(Timings {
            prepare: 310.0,
            steps: 2500.0,
            collect: 2.0,
            prepare_laps: [("session".to_string(), 9.0)].into(),
            ..Timings::default()
        });
        let data = summary(&f);
        let t = &data["application/json"]["timings_ms"];
        assert_eq!(t["prepare"], 310.0);
        assert_eq!(t["steps"], 2500.0);
        assert_eq!(t["prepare_laps"]["session"], 9.0);
        let text = data["text/plain"].as_str().unwrap();
        assert!(!text.contains("prepare"), "{text}");
    }

    #[test]
    fn summary_states_the_answer_its_assumptions_and_draws_the_trials() {
        let data = summary(&findings());
        let text = data["text/plain"].as_str().unwrap();
        assert!(text.contains("largest batch that fits: 1705"), "{text}");
        assert!(text.contains("recommended: 1616"), "{text}");
        assert!(text.contains("engine: python"), "{text}");
        assert!(text.contains("loss cross-entropy"), "{text}");
        assert!(
            text.contains("optimizer the notebook's opt (AdamW)"),
            "{text}"
        );
        assert!(text.contains("held 1.00 GiB allocated"), "{text}");
        let html = data["text/html"].as_str().unwrap();
        assert_eq!(html.matches("<circle").count(), 4); // 3 allocated peaks, 1 reserved
        assert!(html.contains("out of memory"));
        let value = &data["application/json"];
        assert_eq!(value["recommended"], 1616);
        assert_eq!(value["engine"], "python");
        assert_eq!(value["trials"][3]["outcome"]["result"], "out_of_memory");
    }

    /// Findings where every trial fitted up to `--max` (65536), each peak given by `peak`.
    fn capped(peak: impl Fn(u64) -> u64) -> Findings {
        let mut f = findings();
        f.search.trials = [4u64, 1024, 65536]
            .into_iter()
            .map(|batch| Trial {
                batch,
                outcome: Outcome::Ran {
                    peak: peak(batch),
                    reserved: peak(batch),
                    phases: None,
                },
                fits: true,
            })
            .collect();
        (f.search.max_fit, f.search.min_fail) = (Some(65536), None);
        (f.search.capped, f.search.exact, f.search.settled) = (true, false, false);
        f
    }

    #[test]
    fn every_batch_fitting_up_to_the_cap_is_not_called_the_largest_that_fits() {
        let text = |f: &Findings| summary(f)["text/plain"].as_str().unwrap().to_string();
        // A step whose memory grows: the cap is named, the margin below it.
        let data = summary(&capped(|b| 2_000_000_000 + b * 100_000));
        let shown = data["text/plain"].as_str().unwrap();
        assert!(!shown.contains("largest batch that fits"), "{shown}");
        assert!(
            shown.contains(
                "every batch tried fits, up to 65536 (--max, the largest this search tries: \
                 raise it to search further); recommended: 62256 (5% below the cap, multiple \
                 of 8)"
            ),
            "{shown}"
        );
        assert!(!shown.contains("hardly grew"), "{shown}");
        assert_eq!(data["application/json"]["capped"], true);
        assert_eq!(data["application/json"]["recommended"], 62256);
        // A step that makes its batch at a size of its own: its memory stays put, and no
        // batch is recommended, even one a confirming trial ran.
        let mut flat = capped(|b| 2_000_000_000 + b % 7 * 1000);
        flat.confirmation = Some(confirmation(Some(62256), vec![], 50.0, false));
        let data = summary(&flat);
        let shown = data["text/plain"].as_str().unwrap();
        assert!(
            shown.contains(
                "up to 65536 (--max, the largest this search tries: raise it to \
                            search further); no recommendation (see below)"
            ),
            "{shown}"
        );
        assert!(
            shown.contains("its peak hardly grew with the batch: 1.86 GiB at batch 4"),
            "{shown}"
        );
        assert!(
            shown.contains("--step FN that ignores its argument"),
            "{shown}"
        );
        assert!(data["application/json"]["recommended"].is_null());
        // The same step where the trial budget ran out before the cap: still no batch sized.
        flat.search.capped = false;
        let shown = text(&flat);
        assert!(
            shown.contains(
                "65536 (not confirmed: trial budget reached); no recommendation (see below)"
            ),
            "{shown}"
        );
        // A search that found its maximum, and one short of it whose memory grew: neither
        // names a cap nor asks about the step.
        let mut short = capped(|b| 2_000_000_000 + b * 100_000);
        short.search.capped = false;
        for f in [findings(), short] {
            let shown = text(&f);
            assert!(!shown.contains("every batch tried") && !shown.contains("hardly grew"));
            assert!(shown.contains("recommended: "), "{shown}");
        }
    }

    #[test]
    fn progress_replaces_the_running_line() {
        let lines = [
            Line::Trial {
                batch: 4,
                outcome: Outcome::Ran {
                    peak: 1 << 30,
                    reserved: 1 << 30,
                    phases: None,
                },
                fits: true,
                ms: 12.0,
            },
            Line::Running {
                batch: 64,
                elapsed: Duration::from_secs(3),
            },
        ];
        let text = progress("%maxbatch", &lines)["text/plain"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(text.contains("batch      4: fits, peak 1.00 GiB"), "{text}");
        assert!(text.contains("batch     64: running (3 s)"), "{text}");
    }

    #[test]
    fn throughput_picks_the_fastest_and_prefers_the_smaller_on_a_tie() {
        let t = Throughput::from_points(vec![
            (1568, Some(2990.0)),
            (1176, Some(3000.0)),
            (784, Some(2950.0)),
            (392, Some(2500.0)),
        ]);
        assert_eq!(t.best, Some(784));
        let t = Throughput::from_points(vec![(64, None), (32, Some(10.0))]);
        assert_eq!(t.best, Some(32));
        assert_eq!(Throughput::from_points(vec![(64, None)]).best, None);
    }

    #[test]
    fn throughput_candidates_are_multiples_of_eight_below_the_recommendation() {
        assert_eq!(throughput_candidates(1568), vec![1568, 1176, 784, 392]);
        assert_eq!(throughput_candidates(8), vec![8, 6, 4, 2]);
        assert_eq!(throughput_candidates(1), vec![1]);
    }
}
