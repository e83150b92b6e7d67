//! The search replayed against memory curves measured in users' own training loops on an H200
//! and an H100 (`bench/gpu/maxbatch_truth.py`, committed under `bench/results/`: the runs named
//! in `RUNS`, every one that recorded the truth's curve up to 2026-12-07y, 280 model runs of
//! 55 models whose maxima moved between runs; the first 112 runs, of 17 models, up to
//! 2026-12-04f). Each curve is the peak allocated and reserved bytes of the notebook's loop at
//! a set of batch sizes, and its true maximum from an exact bisection of that loop. A replayed
//! trial interpolates the curve; a batch above the true maximum runs out of memory. From
//! 2026-12-06n on, the runs also recorded the search's own trials with their peaks apart
//! outside and inside the optimizer's step, which the live search fits a line to each; the
//! replay interpolates those too (without them it took 11 trials on the LSTM at 76 GiB, whose
//! live search took 8, and the trials it retraces now). The search targets hold here:
//! every answer within 1.5% below the truth, at most 10 trials, 6 in the median. Its time
//! target (a third of Lightning's double-then-bisect to the exact maximum) does not: by the
//! cost model below the search alone costs 0.357 of the baseline's compute on the same
//! curves, and 0.463 with the trial %maxbatch adds to run its recommendation (unless the search
//! ran that batch). Both are guarded at their level, not passed off as the target.
//!
//! History of those two figures: 0.391 and 0.494 over the 207 runs through -06w, replayed
//! without phases; over the 249 runs through -07j, 0.387 and 0.492 before the search followed
//! the cache's line near the limit, 0.355 and 0.460 after (2026-12-07: 54 runs took fewer
//! trials, 13 one more; `search.rs`'s `reserved_reach`); 0.354 and 0.460 over the 275 runs
//! through -07u, which added four models no run had tried (a Qwen2-shaped LM in three loops,
//! torchvision's ViT-B/16); 0.356 and 0.462 over the 278 through -07v; 0.355 and 0.461 over
//! the 279 through -07w (timm's ViT-B/16); 0.357 and 0.463 over the 280 through -07y (timm's
//! ConvNeXt-T under gradient checkpointing, whose allocated peak at its maximum sat at 0.755 of
//! the limit, below the band: three failures before the lowered band, 10 trials); 0.356 and
//! 0.461 over the same 280 since the first fit that fills the cache (its reserved peak at 0.985
//! of the limit or above) puts the next trial at most 3% above it (2026-12-08, `search.rs`'s
//! `FULL_CACHE`): the ConvNeXt took 8 trials, at 0.54 of the baseline's cost instead of 0.75;
//! four other runs changed a trial near the end, with the same count and cost. (On the 18
//! survey curves alone they were 0.340 and
//! 0.450; biasing the closing bisection towards the top, where a failure is cheaper than a
//! fit, moved them by under 0.01 either way, 2026-12-04.)
//!
//! What the rest of the cost buys (2026-12-05): a search that knew each true maximum would,
//! after the same two openings, spend 0.189 of the baseline's (0.187 on the first 112 runs):
//! one fit within the tolerance and one failure just above, printed by the test. The search's extra is the price of not
//! knowing where the cache's fragmentation puts the limit: on these curves the true maximum
//! lies from 0.13 to 0.87 of the way up the band the openings' line gives (10th to 90th
//! percentile), and the openings' cache overhead (reserved over allocated at the second)
//! correlates with that position at 0.09, so it cannot narrow the band. Its three or four
//! trials near the maximum are about log2 of that band over the tolerance. Retuned on these
//! curves, the search's biases did no better: [0.55, 0.3] 0.435, a closing bias of 0.8 0.384,
//! and [0.85, 0.5] or [1.0, 0.5] took 11 trials on an LSTM.
//!
//! Tried and left out (2026-12-07): setting the band from a failure's peak (the allocated
//! bytes it reached before it ran out) where that lies below the band's bottom, as timm's
//! ConvNeXt-T under checkpointing needs (its peak at the maximum at 0.755 of the limit: 10
//! trials). The maximum's peak over a failure's ran 0.96 to 1.05 (5th to 95th percentile) over
//! the curves' 960 failing probes. Replayed with failure peaks from those probes, it took the
//! ConvNeXt from 10 trials to 7 and changed no other run. On synthetic steps whose cache gives
//! out at 0.6 to 0.99 of the limit, it helped only where the failure's peak was at or above
//! the maximum's; where it was below (one large allocation's start, as an LM's logits) it took
//! up to 12 trials where the band alone took 10. The engines now record that peak
//! (`Outcome::OutOfMemory`'s `peak`), so that runs from here on give live figures for a rule.
//!
//! Cost model, in sample-steps, from the trials measured on the H200 (maxbatch-truth-2026-12-04c):
//! a trial that fits runs 3 steps of `batch` samples, or 2 where its cache peaked at most 0.95
//! of the limit (the early end of trials.py, as in our harness for both searches); one that
//! fails costs 1.25 steps (the mean over the truth's failing probes, which fail at step 2 most
//! often, the failing step counted half). It leaves out each step's fixed cost (the optimizer
//! step, launches), which makes small trials dearer than their samples on the GPU: measured
//! there, `seconds` vs `baseline_seconds` in maxbatch-truth-*.json, the ratio is higher still.
//! (With the older model, 3 steps for every fit and 1 for every failure, the survey curves gave
//! 0.331 and 0.445; with the early end at 0.9 of the limit, all curves gave 0.376 and 0.489.)

use gpuprobe::search::{
    double_then_bisect, recommend, search, Outcome, PhasePeaks, SearchConfig, SearchResult, Stop,
};
use serde::de::IgnoredAny;
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Survey {
    cap_gib: f64,
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    model: String,
    engine: String,
    true_max: u64,
    #[serde(default)]
    held: Option<Held>,
    /// (batch, fits, peak allocated, peak reserved)
    #[serde(default)]
    curve: Vec<(u64, bool, u64, u64)>,
    /// The search's own trials as the notebook ran them; from 2026-12-06n on with the peak
    /// apart outside and inside the optimizer's step.
    #[serde(default)]
    trial_list: Vec<RecordedTrial>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RecordedTrial {
    /// (batch, result, peak allocated, peak reserved, phase peaks)
    Split(u64, IgnoredAny, IgnoredAny, IgnoredAny, Option<PhasePeaks>),
    /// (batch, result, peak allocated, peak reserved): runs before 2026-12-06n.
    Whole(IgnoredAny, IgnoredAny, IgnoredAny, IgnoredAny),
}

impl Row {
    /// The phase peaks the search's own trials measured, as (batch, outside, inside the
    /// optimizer's step) ascending; empty for a run that did not split them.
    fn phase_points(&self) -> Vec<(u64, u64, u64)> {
        let mut points: Vec<(u64, u64, u64)> = self
            .trial_list
            .iter()
            .filter_map(|t| match t {
                RecordedTrial::Split(batch, _, _, _, Some(p)) => {
                    Some((*batch, p.outside, p.optimizer))
                }
                _ => None,
            })
            .collect();
        points.sort_unstable();
        points.dedup_by_key(|p| p.0);
        points
    }
}

#[derive(Deserialize)]
struct Held {
    allocated: u64,
}

/// The runs replayed, named so that a new run committed under bench/results changes nothing
/// here until it is added (and the levels below measured again).
const RUNS: [&str; 62] = [
    "maxbatch-survey-2026-12-03-run2.json",
    "maxbatch-survey-2026-12-03.json",
    "maxbatch-truth-2026-12-03-run2a.json",
    "maxbatch-truth-2026-12-03-run2b.json",
    "maxbatch-truth-2026-12-03-run3.json",
    "maxbatch-truth-2026-12-03-run4.json",
    "maxbatch-truth-2026-12-03.json",
    "maxbatch-truth-2026-12-04-compile.json",
    "maxbatch-truth-2026-12-04-convnext-own-kernel.json",
    "maxbatch-truth-2026-12-04-libtorch-budget.json",
    "maxbatch-truth-2026-12-04-lightning-run.json",
    "maxbatch-truth-2026-12-04-vit-bf16.json",
    "maxbatch-truth-2026-12-04.json",
    "maxbatch-truth-2026-12-04b.json",
    "maxbatch-truth-2026-12-04c.json",
    "maxbatch-truth-2026-12-04d.json",
    "maxbatch-truth-2026-12-04e.json",
    "maxbatch-truth-2026-12-04f.json",
    "maxbatch-truth-2026-12-04g.json",
    "maxbatch-truth-2026-12-04h.json",
    "maxbatch-truth-2026-12-04i.json",
    "maxbatch-truth-2026-12-04j.json",
    "maxbatch-truth-2026-12-04k.json",
    "maxbatch-truth-2026-12-04l.json",
    "maxbatch-truth-2026-12-06.json",
    "maxbatch-truth-2026-12-06b.json",
    "maxbatch-truth-2026-12-06c.json",
    "maxbatch-truth-2026-12-06d.json",
    "maxbatch-truth-2026-12-06e.json",
    "maxbatch-truth-2026-12-06f.json",
    "maxbatch-truth-2026-12-06g.json",
    "maxbatch-truth-2026-12-06h.json",
    "maxbatch-truth-2026-12-06i.json",
    "maxbatch-truth-2026-12-06j.json",
    "maxbatch-truth-2026-12-06k.json",
    "maxbatch-truth-2026-12-06l.json",
    "maxbatch-truth-2026-12-06n.json",
    "maxbatch-truth-2026-12-06o.json",
    "maxbatch-truth-2026-12-06p.json",
    "maxbatch-truth-2026-12-06r.json",
    "maxbatch-truth-2026-12-06u.json",
    "maxbatch-truth-2026-12-06w.json",
    "maxbatch-truth-2026-12-07.json",
    "maxbatch-truth-2026-12-07b.json",
    "maxbatch-truth-2026-12-07c.json",
    "maxbatch-truth-2026-12-07d.json",
    "maxbatch-truth-2026-12-07e.json",
    "maxbatch-truth-2026-12-07f.json",
    "maxbatch-truth-2026-12-07g.json",
    "maxbatch-truth-2026-12-07i.json",
    "maxbatch-truth-2026-12-07j.json",
    "maxbatch-truth-2026-12-07l.json",
    "maxbatch-truth-2026-12-07m.json",
    "maxbatch-truth-2026-12-07n.json",
    "maxbatch-truth-2026-12-07o.json",
    "maxbatch-truth-2026-12-07p.json",
    "maxbatch-truth-2026-12-07q.json",
    "maxbatch-truth-2026-12-07r.json",
    "maxbatch-truth-2026-12-07u.json",
    "maxbatch-truth-2026-12-07v.json",
    "maxbatch-truth-2026-12-07w.json",
    "maxbatch-truth-2026-12-07y.json",
];

/// The first run whose search trials recorded their phase peaks.
const PHASES_FROM: &str = "maxbatch-truth-2026-12-06n.json";

/// Models whose curves cannot be replayed from a run that did not record phase peaks (those
/// before 2026-12-06n): a curve holds each probe's whole peak, and at their small batches that
/// is the optimizer's update (AdamW over 112M parameters), not the forward and backward that
/// grow with the batch. The live search tells the two apart by the trials' phase peaks (7
/// trials each in maxbatch-truth-2026-12-06n, where whole peaks took 12 and 13 in -06m);
/// without them a replay would take the whole peaks' path. Their runs from -06n on are
/// replayed with phases.
const UPDATE_PEAKS_AT_SMALL_BATCHES: [&str; 5] = [
    "mae_vitb_bf16",
    "mae_vitb_bf16_held",
    "hf_vitmae_bf16",
    "mae_vitb_bf16_dropped",
    "hf_vitmae_bf16_dropped",
];

fn surveys() -> Vec<(PathBuf, Survey)> {
    // At run time, not `env!`: a test binary cargo reuses from a checkout at another path
    // (CI's and a developer's share the target cache) would look in that checkout.
    let manifest =
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    let dir = PathBuf::from(manifest).join("../../bench/results");
    RUNS.iter()
        .map(|name| {
            let path = dir.join(name);
            let text = std::fs::read_to_string(&path).expect("a run named in RUNS");
            let survey = serde_json::from_str(&text).expect("a run's JSON");
            (path, survey)
        })
        .collect()
}

/// Linear interpolation (and extrapolation from the nearest two) of the fitting points.
fn interpolate(points: &[(u64, u64, u64)], batch: u64) -> (u64, u64) {
    let i = points.partition_point(|p| p.0 < batch);
    if i < points.len() && points[i].0 == batch {
        return (points[i].1, points[i].2);
    }
    let (a, b) = match i {
        0 => (points[0], points[1]),
        i if i >= points.len() => (points[points.len() - 2], points[points.len() - 1]),
        i => (points[i - 1], points[i]),
    };
    let t = (batch as f64 - a.0 as f64) / (b.0 as f64 - a.0 as f64);
    let at = |ya: u64, yb: u64| (ya as f64 + t * (yb as f64 - ya as f64)).max(0.0) as u64;
    (at(a.1, b.1), at(a.2, b.2))
}

/// The recommendation's margin, as %maxbatch's default.
const MARGIN: f64 = 0.05;

/// Steps a trial that fits runs: 2 when its cache peaked at most this fraction of the limit
/// (trials.py's STEADY_HEADROOM: below it a trial ends once its second step repeats the first,
/// which it did in 111 of 181 fitting probes in maxbatch-truth-2026-12-04c to -04f), else 3.
const HEADROOM: f64 = 0.95;
/// Steps a failing trial costs: its step that failed counted as half, over the 43 failing
/// probes of maxbatch-truth-2026-12-04c (14 failed at step 1, 26 at step 2, 3 at step 3).
const FAILED_STEPS: f64 = 1.25;

/// Steps a trial that fits at `reserved` bytes of peak cache runs.
fn fit_steps(reserved: u64, limit: u64) -> f64 {
    if reserved as f64 <= HEADROOM * limit as f64 {
        2.0
    } else {
        3.0
    }
}

/// Sample-steps a search that knew the true maximum `truth` would spend after the same two
/// openings: one fit at the smallest batch within the tolerance of the truth, and one failure
/// just above the truth (the cheapest proof of that answer).
fn oracle_cost(result: &SearchResult, points: &[(u64, u64, u64)], truth: u64, limit: u64) -> f64 {
    let openings: f64 = result
        .trials
        .iter()
        .take(2)
        .map(|t| trial_cost(t, limit))
        .sum();
    let lo = (1..=truth)
        .find(|&b| b + (b as f64 * TOLERANCE).floor() as u64 >= truth)
        .unwrap_or(truth);
    openings
        + lo as f64 * fit_steps(interpolate(points, lo).1, limit)
        + (truth + 1) as f64 * FAILED_STEPS
}

fn trial_cost(t: &gpuprobe::search::Trial, limit: u64) -> f64 {
    let steps = match t.outcome {
        Outcome::Ran { reserved, .. } if t.fits => fit_steps(reserved, limit),
        _ => FAILED_STEPS,
    };
    t.batch as f64 * steps
}

/// The search's tolerance, as %maxbatch's default.
const TOLERANCE: f64 = 0.015;

/// Sample-steps of compute a search's trials cost (see the module doc).
fn cost(result: &SearchResult, limit: u64) -> f64 {
    result.trials.iter().map(|t| trial_cost(t, limit)).sum()
}

/// The trial %maxbatch adds to run its recommendation, unless the search ran it already
/// (below the true maximum, so it fits here): its batch, or `None`.
fn confirmation(result: &SearchResult) -> Option<u64> {
    let rec = recommend(result.max_fit?, MARGIN);
    let ran = result.trials.iter().any(|t| t.batch == rec && t.fits);
    (!ran).then_some(rec)
}

/// One row's curve replayed: our search (and its confirming trial) and the baseline's.
struct Replayed {
    /// What happened, for the log and a failure's message.
    what: String,
    /// Why it misses a target, if it does.
    wrong: Option<String>,
    trials: usize,
    /// `trials` with the confirming trial, where %maxbatch adds one.
    confirmed_trials: usize,
    /// Sample-steps: the search's, the search's and its confirming trial's, the baseline's,
    /// and an oracle's after the same openings.
    costs: (f64, f64, f64, f64),
}

/// A row's measured step as a probe: a batch above the true maximum runs out of memory; one
/// at or below it peaks where the curve (and, where recorded, the trials' phases) puts it.
struct Measured {
    /// (batch, allocated peak, reserved peak) of the batches that fitted, ascending.
    points: Vec<(u64, u64, u64)>,
    /// (batch, outside the optimizer's step, inside it) of the search's own trials.
    phase_points: Vec<(u64, u64, u64)>,
    truth: u64,
    limit: u64,
}

impl Measured {
    fn new(row: &Row, phase_points: Vec<(u64, u64, u64)>, limit: u64) -> Self {
        let mut points: Vec<(u64, u64, u64)> = row
            .curve
            .iter()
            .filter(|p| p.1)
            .map(|p| (p.0, p.2, p.3))
            .collect();
        points.sort_unstable();
        points.dedup_by_key(|p| p.0);
        // Two points interpolate; a small maximum (nanoGPT's 15) leaves the truth no more.
        assert!(points.len() >= 2, "{}: too few points", row.model);
        Self {
            points,
            phase_points,
            truth: row.true_max,
            limit,
        }
    }

    fn probe(&self, b: u64) -> Result<Outcome, Stop> {
        if b > self.truth {
            return Ok(Outcome::OutOfMemory { peak: None });
        }
        let (peak, reserved) = interpolate(&self.points, b);
        let peak = peak.min(self.limit);
        // The phases from the trials that measured them; the curve's whole peak is the
        // phase's that held the peak there.
        let phases = (self.phase_points.len() >= 2).then(|| {
            let (outside, optimizer) = interpolate(&self.phase_points, b);
            if outside >= optimizer {
                PhasePeaks {
                    outside: peak,
                    optimizer: optimizer.min(peak),
                }
            } else {
                PhasePeaks {
                    outside: outside.min(peak),
                    optimizer: peak,
                }
            }
        });
        // A batch that fits in the loop fits here too, whatever the line says.
        Ok(Outcome::Ran {
            peak,
            reserved: reserved.min(self.limit),
            phases,
        })
    }
}

fn replay(row: &Row, measured: &Measured, path: &std::path::Path) -> Replayed {
    let limit = measured.limit;
    let (points, truth) = (&measured.points, measured.truth);
    let config = SearchConfig {
        limit,
        max_batch: 1 << 16,
        tolerance: TOLERANCE,
        held: row.held.as_ref().map_or(0, |h| h.allocated),
        ..SearchConfig::default()
    };
    let probe = |b: u64| measured.probe(b);
    let result = search(&config, probe);
    let exact = SearchConfig {
        tolerance: 0.0,
        max_trials: 40,
        ..config
    };
    let baseline = double_then_bisect(&exact, 2, probe);
    assert_eq!(baseline.max_fit, Some(truth), "{}", row.model);
    let confirm = confirmation(&result);
    let confirm_cost = confirm.map_or(0.0, |b| {
        b as f64 * fit_steps(interpolate(points, b).1, limit)
    });
    let search_cost = cost(&result, limit);
    let baseline_cost = cost(&baseline, limit);
    let found = result.max_fit.unwrap_or(0);
    let tried: Vec<(u64, bool)> = result.trials.iter().map(|t| (t.batch, t.fits)).collect();
    let what = format!(
        "{} ({}): found {found}, true {truth}, cost {:.2} of the baseline's {} trials, \
         trials {tried:?}, then confirmed {confirm:?}",
        row.model,
        path.display(),
        (search_cost + confirm_cost) / baseline_cost,
        baseline.trials.len(),
    );
    let wrong = if !(found <= truth && found as f64 >= truth as f64 / (1.0 + TOLERANCE)) {
        Some(format!("outside the tolerance: {what}"))
    } else if result.trials.len() > 10 {
        Some(format!("more than 10 trials: {what}"))
    } else {
        None
    };
    Replayed {
        what,
        wrong,
        trials: result.trials.len(),
        confirmed_trials: result.trials.len() + usize::from(confirm.is_some()),
        costs: (
            search_cost,
            search_cost + confirm_cost,
            baseline_cost,
            oracle_cost(&result, points, truth, limit),
        ),
    }
}

#[test]
fn measured_curves_are_searched_to_within_tolerance_in_few_trials_at_a_guarded_cost() {
    let surveys = surveys();
    assert!(!surveys.is_empty(), "no runs to replay");
    let mut counts = Vec::new();
    let mut confirmed_counts = Vec::new();
    let mut wrong = Vec::new();
    // (the search's, the search's and its confirming trial's, the baseline's, an oracle's)
    let mut costs = (0.0, 0.0, 0.0, 0.0);
    for (path, survey) in &surveys {
        let limit = (survey.cap_gib * (1u64 << 30) as f64) as u64;
        let rows = survey.rows.iter();
        for row in rows.filter(|r| r.engine == "python" && r.curve.len() >= 3) {
            let phase_points = row.phase_points();
            if UPDATE_PEAKS_AT_SMALL_BATCHES.contains(&row.model.as_str()) && phase_points.len() < 2
            {
                continue;
            }
            // From -06n on every row recorded its trials' phase peaks: none read means the
            // entries no longer parse as `RecordedTrial::Split`.
            let name = path.file_name().map_or("".into(), |n| n.to_string_lossy());
            assert!(
                *name < *PHASES_FROM || phase_points.len() >= 2,
                "{}: no phase peaks read from its trials",
                row.model
            );
            let measured = Measured::new(row, phase_points, limit);
            let replayed = replay(row, &measured, path);
            eprintln!("{}", replayed.what);
            wrong.extend(replayed.wrong);
            counts.push(replayed.trials);
            confirmed_counts.push(replayed.confirmed_trials);
            costs.0 += replayed.costs.0;
            costs.1 += replayed.costs.1;
            costs.2 += replayed.costs.2;
            costs.3 += replayed.costs.3;
        }
    }
    counts.sort_unstable();
    confirmed_counts.sort_unstable();
    let median = counts[counts.len() / 2];
    eprintln!("search trials {counts:?}; with the confirming trial {confirmed_counts:?}");
    assert!(median <= 6, "median {median} trials: {counts:?}");
    let (search_only, confirmed) = (costs.0 / costs.2, costs.1 / costs.2);
    // What knowing the answer would save: the rest of the search's cost is the price of not
    // knowing where in the band the cache's fragmentation puts the limit.
    let oracle = costs.3 / costs.2;
    eprintln!("an oracle after the same openings: {oracle:.3} of the baseline's");
    assert!(
        oracle < search_only,
        "the oracle {oracle:.3} is no cheaper than the search"
    );
    eprintln!(
        "cost: the search {search_only:.3} of the baseline's, with the confirming trial \
         {confirmed:.3}"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The third is not met, by the search alone or with the confirming trial (a trial
    // near the maximum): guards against regressions at the levels measured, not the target
    // (0.354 and 0.460 over the runs through -07u, 0.353 and 0.459 through -07n; the runs'
    // own mix moves them by a few thousandths as curves are added).
    assert!(
        search_only <= 0.36,
        "cost {search_only:.3} of the baseline's"
    );
    assert!(
        confirmed <= 0.465,
        "cost with the confirming trial {confirmed:.3}"
    );
}
