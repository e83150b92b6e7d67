//! Finding the largest batch that fits, in a few trials.
//!
//! Memory of a training step is close to affine in the batch size (a fixed part: weights,
//! gradients, optimizer state, workspaces; plus activations per sample). So instead of doubling
//! until an OOM and then bisecting (Lightning's finder: ~20 trials), we measure the peak of two
//! small steps and fit a line. What the line cannot know is how much the allocator's cache
//! needs beyond the allocated bytes near the limit (rounding, fragmentation): measured, the
//! allocated peak at the true maximum lies between 0.87 and 0.99 of the limit. That [`BAND`]
//! gives a range of batches, searched with a bias to the top because a trial above the maximum
//! fails within its first step, while one that fits runs all of them. A bracket
//! `[largest that fits, smallest that does not]` keeps shrinking; every trial is one whose
//! outcome can settle the answer to the tolerance, and after three failures in a row the band
//! is given up for bisection in ratio. Once a trial near the limit has fitted with the cache
//! still short of it, the cache's own line (its reserved peaks) says where the limit falls:
//! where that is at or near the trial that settles the answer by fitting, that trial comes
//! next (replayed on 263 measured curves, 0.389 of the baseline's cost became 0.353:
//! `tests/search_replay.rs`). A fit that filled the cache, below a failure, is near the
//! maximum wherever its allocated peak lies: the next trial goes at most 3% above it, once.
//! The search is pure: a `probe` closure runs the real step, so tests drive it with
//! deterministic memory functions.

use serde::{Deserialize, Serialize};

/// Where the allocated peak sits at the true maximum, as a fraction of the limit; the rest is
/// the cache's block rounding and fragmentation, unknown until a trial fails. 0.87-0.99 over the
/// benchmark's models in users' loops on an H200 (bench/results/maxbatch-truth-2026-12-03);
/// never above 1, since allocated <= reserved <= limit.
pub const BAND: (f64, f64) = (0.86, 1.0);
/// Where in the band's batches to try, by trials failed in a row: high first, because a trial
/// above the maximum fails within its first step while one that fits runs all its steps (a
/// third of the cost); then lower; then, the band having missed, bisection in ratio.
const BIAS: [f64; 3] = [0.7, 0.4, 0.0];
/// Bracketed and the last trial fitted: where between the lowest trial that can settle the
/// answer (by failing) and the highest (by fitting) to try next.
const CLOSING_BIAS: f64 = 0.5;
/// A trial that fitted with its cache's peak at or above this fraction of the limit filled the
/// cache: near the maximum, wherever the allocated peak lies (timm's ConvNeXt-T under
/// checkpointing fitted 746 with the cache at 0.993 of the limit and its allocated peak at
/// 0.74; its maximum was 765). The first such fit below a failure puts the next trial at most
/// [`FULL_CACHE_STEP`] above it, instead of halfway to the failure.
const FULL_CACHE: f64 = 0.985;
/// How far above the first fit that filled the cache the next trial goes, at most: once, so
/// that a cache full well below the maximum costs one trial, not a walk.
const FULL_CACHE_STEP: f64 = 0.03;
/// Where in the limit the largest trial that fitted left the cache for its reserved peak to
/// place the maximum: near enough that the line is short, and below where the allocator
/// frees its cache and retries, so that the reserved peak stops growing with the batch.
const RESERVED_TRUSTED: (f64, f64) = (0.9, 0.985);

/// What one trial step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    /// The step ran; `peak` is its peak allocated memory in bytes, the quantity fitted against
    /// the batch size. `reserved` is what the cache held at its peak (0 if unknown), reported
    /// to the user: near the limit the allocator frees and retries, so it predicts nothing.
    Ran {
        peak: u64,
        #[serde(default)]
        reserved: u64,
        /// The peak apart outside the optimizer's step and inside it, where the trial saw one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        phases: Option<PhasePeaks>,
    },
    /// CUDA ran out of memory (detected by type, never by text). `peak`: the allocated peak
    /// the step reached before it ran out, where the trial read one. Recorded with the trials
    /// (the report's JSON, the truth's `trial_list`), not used by the search: where the cache
    /// gives out could place the band for a step whose cache needs more than it allows, but a
    /// failure's peak can also be the start of one large allocation well short of the step's
    /// (an LM's logits), and the rules tried on it took more trials there than the band alone
    /// (see `tests/search_replay.rs`).
    OutOfMemory {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peak: Option<u64>,
    },
}

/// A trial's allocated peak apart outside the optimizer's step (forward and backward: it grows
/// with the batch) and inside it (the update: weights, gradients, optimizer state and its
/// temporaries, nearly the same at every batch). Where the update is the step's peak at the
/// small opening batches, a line through whole peaks is too flat and overshoots the maximum
/// by far: a masked autoencoder (112M parameters under AdamW, 40 MB a sample, its encoder
/// seeing a quarter of the image) was put at 1119 where 579 fit. Each phase gets its own line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhasePeaks {
    pub outside: u64,
    pub optimizer: u64,
}

/// Which of a trial's peaks a line is fitted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Outside the optimizer's step: the whole peak of a trial that was not split.
    Outside,
    /// Inside the optimizer's step.
    Optimizer,
}

impl Phase {
    pub const ALL: [Phase; 2] = [Phase::Outside, Phase::Optimizer];
}

impl Outcome {
    /// The trial's peak in `phase`; `None` for a trial that failed, or that was not split
    /// (then its whole peak counts as outside).
    pub fn peak_in(&self, phase: Phase) -> Option<u64> {
        match (*self, phase) {
            (
                Outcome::Ran {
                    phases: Some(p), ..
                },
                Phase::Outside,
            ) => Some(p.outside),
            (
                Outcome::Ran {
                    phases: Some(p), ..
                },
                Phase::Optimizer,
            ) => Some(p.optimizer),
            (
                Outcome::Ran {
                    peak, phases: None, ..
                },
                Phase::Outside,
            ) => Some(peak),
            _ => None,
        }
    }
}

/// One trial as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trial {
    pub batch: u64,
    pub outcome: Outcome,
    /// Whether it fits the budget: ran and peaked at or under the limit.
    pub fits: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchConfig {
    /// Memory budget in bytes: a step fits if its peak is at or under it.
    pub limit: u64,
    /// Largest batch worth trying.
    pub max_batch: u64,
    /// Trial budget; the search stops there even if not exact.
    pub max_trials: usize,
    /// The two opening batch sizes (the line's two points).
    pub opening: (u64, u64),
    /// How close is close enough, as a fraction of the answer: the search stops once the
    /// largest batch that fits is within this of the true maximum (0: to the sample).
    /// Near the limit every trial is the most expensive one, and an answer that gets a margin
    /// taken off anyway gains nothing from the last percent.
    pub tolerance: f64,
    /// Bytes the process holds before any trial (the weights, say); 0 if unknown. With it
    /// the second opening is kept below the limit for models whose samples are large.
    pub held: u64,
}

impl Default for SearchConfig {
    fn default() -> Self {
        Self {
            limit: u64::MAX,
            max_batch: 1 << 20,
            max_trials: 12,
            opening: (4, 64),
            tolerance: 0.0,
            held: 0,
        }
    }
}

impl SearchConfig {
    /// The first opening's peak that the second is set from. The whole peak over-counts a
    /// sample's bytes by the update's temporaries, which go with the parameters: the second
    /// opening of a ViT, an LSTM and a masked autoencoder came 12% to 25% lower from it than
    /// from the peak outside the update, and their searches took a trial more
    /// (maxbatch-truth-2026-12-06q and -06r against -06o and -06n). So the outside peak,
    /// where it holds at least half of the step's bytes above `held`; the whole peak where
    /// it does not, as where an LBFGS closure runs the forward inside the optimizer's step.
    /// At half or more, the opening is at most the whole peak's own (over-counted) estimate
    /// of the maximum, where from the whole peak it is half of that: it fits on a linear
    /// step, though near that estimate the cache's fragmentation can fail it, as any trial in
    /// the band.
    fn opening_peak(&self, first: &Outcome) -> Option<u64> {
        let Outcome::Ran { peak, phases, .. } = *first else {
            return None;
        };
        let above = |bytes: u64| bytes.saturating_sub(self.held);
        Some(match phases {
            Some(p) if above(p.outside).saturating_mul(2) >= above(peak) => p.outside,
            _ => peak,
        })
    }

    /// The second opening once the first (`first` samples) peaked at `peak`: the configured
    /// one, lowered to half the batch that the first trial's bytes per sample (everything
    /// above `held`, so an over-estimate) would allow, but not below 4 times the first, so the
    /// line keeps its lever.
    fn second_opening(&self, first: u64, peak: u64) -> u64 {
        let wanted = self.opening.1;
        if self.held == 0 || peak <= self.held || first == 0 {
            return wanted;
        }
        let per_sample = (peak - self.held) as f64 / first as f64;
        let room = self.limit.saturating_sub(self.held) as f64 / per_sample;
        ((0.5 * room) as u64).clamp(4 * first, wanted.max(4 * first))
    }
}

/// Why the search stopped early.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// The caller asked to stop (an interrupt).
    Cancelled,
    /// The probe failed for another reason (message).
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// Largest batch seen to fit; `None` if not even the smallest did.
    pub max_fit: Option<u64>,
    /// Smallest batch seen not to fit.
    pub min_fail: Option<u64>,
    /// `max_fit + 1 == min_fail`: the answer is exact.
    pub exact: bool,
    /// The answer is within the tolerance of the true maximum (`exact` implies it).
    pub settled: bool,
    /// `max_fit` is the largest batch the search may try (`SearchConfig::max_batch`) and no
    /// batch failed: the true maximum is that or above it, not found (neither `exact` nor
    /// `settled`).
    #[serde(default)]
    pub capped: bool,
    pub trials: Vec<Trial>,
    /// Fixed bytes and bytes per sample of the line through the two opening trials (their
    /// peaks outside the optimizer's step, where split).
    pub fit: Option<(f64, f64)>,
    pub stopped: Option<Stop>,
}

/// Growth of the peak, as a fraction of the smallest trial's, at or below which a step's
/// memory is taken not to depend on the batch: at 4 times the batch or more, the batch's own
/// activations are seldom under 1% of the weights, gradients and optimizer state.
const FLAT_GROWTH: f64 = 0.01;

impl SearchResult {
    /// The smallest and the largest trial that ran, (batch, peak) each, where no trial failed
    /// and the peak grew by at most [`FLAT_GROWTH`] between them over at least 4 times the
    /// batch: a step that makes its batch at a size of its own (a `--step FN` that ignores
    /// its argument) whatever the search asks.
    pub fn flat_memory(&self) -> Option<((u64, u64), (u64, u64))> {
        if self.min_fail.is_some() {
            return None;
        }
        let ran = self.trials.iter().filter_map(|t| match t.outcome {
            Outcome::Ran { peak, .. } => Some((t.batch, peak)),
            Outcome::OutOfMemory { .. } => None,
        });
        let (small, large) = (ran.clone().min()?, ran.max()?);
        let grew = large.1.saturating_sub(small.1) as f64;
        (large.0 >= small.0.saturating_mul(4) && grew <= FLAT_GROWTH * small.1 as f64)
            .then_some((small, large))
    }
}

/// Runs the model-guided search. `probe(batch)` runs one real step.
pub fn search(
    config: &SearchConfig,
    mut probe: impl FnMut(u64) -> Result<Outcome, Stop>,
) -> SearchResult {
    let mut state = State::new(config);
    let first = config.opening.0.clamp(1, config.max_batch);
    if let Err(stop) = state.run(first, &mut probe) {
        return state.finish(Some(stop));
    }
    // After a failing first opening the search goes down from it, not up to the second.
    // A first opening that ran over the limit did not fit either.
    let opened = &state.trials[0];
    let second = opened
        .fits
        .then(|| config.opening_peak(&opened.outcome))
        .flatten()
        .map(|peak| {
            config
                .second_opening(first, peak)
                .clamp(1, config.max_batch)
        });
    if let Some(second) = second.filter(|&b| b != first && !state.done()) {
        if let Err(stop) = state.run(second, &mut probe) {
            return state.finish(Some(stop));
        }
    }
    while !state.done() && state.trials.len() < config.max_trials {
        let next = state.next_batch();
        if let Err(stop) = state.run(next, &mut probe) {
            return state.finish(Some(stop));
        }
    }
    state.finish(None)
}

/// Lightning's algorithm in the same harness, for comparison: double from `start` until a
/// step does not fit, then bisect.
pub fn double_then_bisect(
    config: &SearchConfig,
    start: u64,
    mut probe: impl FnMut(u64) -> Result<Outcome, Stop>,
) -> SearchResult {
    let mut state = State::new(config);
    let mut batch = start.clamp(1, config.max_batch);
    while !state.done() && state.trials.len() < config.max_trials {
        if let Err(stop) = state.run(batch, &mut probe) {
            return state.finish(Some(stop));
        }
        batch = match (state.lo, state.hi) {
            (Some(lo), None) => (lo * 2).min(config.max_batch),
            (lo, Some(hi)) => {
                let lo = lo.unwrap_or(0);
                lo + (hi - lo) / 2
            }
            (None, None) => break,
        };
        if batch == 0 {
            break;
        }
    }
    state.finish(None)
}

/// Lightning's `BatchSizeFinder` as it runs by default (mode "binsearch": from 2, doubling,
/// then bisecting to the exact maximum, up to 25 trials that fit) on the same step, whatever
/// tolerance and budget `config` asks of our search: the baseline the benchmark compares with.
pub fn lightning(
    config: &SearchConfig,
    probe: impl FnMut(u64) -> Result<Outcome, Stop>,
) -> SearchResult {
    let exact = SearchConfig {
        tolerance: 0.0,
        // 25 that fit, and the failures of a bisection between them.
        max_trials: 40,
        ..*config
    };
    double_then_bisect(&exact, 2, probe)
}

struct State<'a> {
    config: &'a SearchConfig,
    trials: Vec<Trial>,
    lo: Option<u64>,
    hi: Option<u64>,
}

impl<'a> State<'a> {
    fn new(config: &'a SearchConfig) -> Self {
        Self {
            config,
            trials: Vec::new(),
            lo: None,
            hi: None,
        }
    }

    /// Batches above `lo` the answer may miss by: the tolerance, in samples.
    fn slack(&self, lo: u64) -> u64 {
        (lo as f64 * self.config.tolerance.clamp(0.0, 0.5)).floor() as u64
    }

    /// The smallest batch whose failure settles the answer at `lo`.
    fn closing_above(&self, lo: u64) -> u64 {
        lo + self.slack(lo) + 1
    }

    /// The smallest batch that, if it fits, settles the answer given that `hi` does not.
    fn closing_below(&self, hi: u64) -> u64 {
        let t = 1.0 + self.config.tolerance.clamp(0.0, 0.5);
        let mut c = (((hi - 1) as f64) / t).ceil().max(1.0) as u64;
        while c > 1 && (c - 1) + self.slack(c - 1) + 1 >= hi {
            c -= 1;
        }
        while c + self.slack(c) + 1 < hi {
            c += 1;
        }
        c
    }

    fn done(&self) -> bool {
        match (self.lo, self.hi) {
            (Some(lo), Some(hi)) => hi <= self.closing_above(lo),
            (Some(lo), None) => lo >= self.config.max_batch,
            (None, Some(hi)) => hi <= 1,
            (None, None) => false,
        }
    }

    fn run(
        &mut self,
        batch: u64,
        probe: &mut impl FnMut(u64) -> Result<Outcome, Stop>,
    ) -> Result<(), Stop> {
        let outcome = probe(batch)?;
        let fits = matches!(outcome, Outcome::Ran { peak, .. } if peak <= self.config.limit);
        if fits {
            self.lo = Some(self.lo.map_or(batch, |lo| lo.max(batch)));
        } else {
            self.hi = Some(self.hi.map_or(batch, |hi| hi.min(batch)));
        }
        self.trials.push(Trial {
            batch,
            outcome,
            fits,
        });
        Ok(())
    }

    /// Measured (batch, peak in `phase`) points, ascending by batch.
    fn points(&self, phase: Phase) -> Vec<(u64, u64)> {
        let mut points: Vec<(u64, u64)> = self
            .trials
            .iter()
            .filter_map(|t| Some((t.batch, t.outcome.peak_in(phase)?)))
            .collect();
        points.sort_unstable();
        points.dedup_by_key(|p| p.0);
        points
    }

    /// The batch at which the first of the phases' lines reaches `limit_bytes`.
    fn predict_at(&self, limit_bytes: u64) -> Option<u64> {
        Phase::ALL
            .iter()
            .filter_map(|&phase| predict_from(&self.points(phase), limit_bytes))
            .min()
    }

    /// Trials at the end of the list that did not fit (0 when the last one fitted).
    fn failures_in_a_row(&self) -> usize {
        self.trials.iter().rev().take_while(|t| !t.fits).count()
    }

    /// The batches at which the measured line puts the allocated peak at the band's edges.
    /// `lowered`: the band has missed (failures in a row), so the device needs more than it
    /// assumed; its top comes down to the peak the line gives the smallest failure.
    fn band(&self, lowered: bool) -> Option<(u64, u64)> {
        let mut top = self.config.limit as f64 * BAND.1;
        if let Some(peak) = self.hi.filter(|_| lowered).and_then(|hi| self.peak_at(hi)) {
            top = top.min(peak);
        }
        let low = self.predict_at((top * BAND.0 / BAND.1) as u64)?;
        let high = self.predict_at(top as u64)?;
        Some((low, high))
    }

    /// The allocated peak the measured points give `batch`: the line through the two nearest.
    /// Of the phases, the higher.
    fn peak_at(&self, batch: u64) -> Option<f64> {
        Phase::ALL
            .iter()
            .filter_map(|&phase| {
                let points = self.points(phase);
                if points.len() < 2 {
                    return None;
                }
                let i = points
                    .partition_point(|p| p.0 < batch)
                    .clamp(1, points.len() - 1);
                let ((x0, y0), (x1, y1)) = (points[i - 1], points[i]);
                let slope = (y1 as f64 - y0 as f64) / (x1 as f64 - x0 as f64);
                Some(y1 as f64 + slope * (batch as f64 - x1 as f64))
            })
            .reduce(f64::max)
    }

    /// Where the cache's own line reaches the limit: a local line through the reserved peaks
    /// of the trials that fitted ([`local_line_reach`]); only where the largest of them left
    /// the cache within [`RESERVED_TRUSTED`] of the limit.
    fn reserved_reach(&self) -> Option<u64> {
        let reserved = |t: &Trial| match t.outcome {
            Outcome::Ran { reserved, .. } if t.fits && reserved > 0 => {
                Some((t.batch as f64, reserved as f64))
            }
            _ => None,
        };
        let mut fitted: Vec<(f64, f64)> = self.trials.iter().filter_map(reserved).collect();
        fitted.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let limit = self.config.limit as f64;
        let &(_, top) = fitted.last()?;
        if !(RESERVED_TRUSTED.0..=RESERVED_TRUSTED.1).contains(&(top / limit)) {
            return None;
        }
        local_line_reach(&fitted, limit)
    }

    /// Whether the cache's line ([`Self::reserved_reach`]) puts the maximum below the failure
    /// `hi` and at the trial that settles the answer by fitting ([`Self::closing_below`]) or
    /// up to the tolerance short of it: that trial comes next. Short of it too, on purpose: a
    /// failure there is the cheap kind of trial, and a fit ends the search (replayed, without
    /// that slack the cost was 0.362 of the baseline's, not 0.353). After such a trial failed
    /// it can be chosen again, a tolerance lower, as a failure adds no point to the line;
    /// skipping it then cost more on the replay (0.356).
    fn reach_settles(&self, hi: u64) -> bool {
        self.reserved_reach().is_some_and(|reach| {
            reach < hi && reach.saturating_add(self.slack(reach)) >= self.closing_below(hi)
        })
    }

    /// Whether `lo` is the first trial that fitted with the cache full ([`FULL_CACHE`]), and
    /// the last trial run.
    fn first_full_cache_fit(&self, lo: u64) -> bool {
        let full = |t: &&Trial| {
            t.fits
                && matches!(t.outcome, Outcome::Ran { reserved, .. }
                    if reserved as f64 >= FULL_CACHE * self.config.limit as f64)
        };
        let mut fulls = self.trials.iter().filter(full);
        let last = self.trials.last().map(|t| t.batch);
        matches!((fulls.next(), fulls.next()), (Some(t), None) if t.batch == lo && last == Some(lo))
    }

    fn next_batch(&self) -> u64 {
        let max = self.config.max_batch;
        let Some(lo) = self.lo else {
            // Nothing fitted yet: the first opening failed.
            return match (self.hi, self.band(false)) {
                (Some(hi), Some((_, high))) if high < hi => high.max(1),
                (Some(hi), _) => (hi / 2).max(1),
                (None, _) => 1,
            };
        };
        let top = self.hi.map_or(max, |hi| hi - 1).max(lo + 1);
        // Rounded up: a failure, likelier above the middle, costs less than a fit, and
        // rounded down a bracket whose answer is at its top climbed one sample at a time.
        let geometric = |hi: u64| ((lo as f64 * hi as f64).sqrt().ceil() as u64).max(lo + 1);
        let failures = self.failures_in_a_row();
        // The band has missed: failures in a row, or all of it at or above a failure.
        let missed = failures == BIAS.len()
            || matches!((self.hi, self.band(false)), (Some(hi), Some((low, _))) if low >= hi);
        let wanted = match (self.hi, self.band(missed)) {
            // The cache's line puts the maximum at or near the trial that settles the answer
            // by fitting, and below the failure: that trial.
            (Some(hi), _) if self.reach_settles(hi) => self.closing_below(hi),
            // The lowered band had its one trial.
            (Some(hi), _) if failures > BIAS.len() => geometric(hi),
            (Some(hi), Some((low, _))) if missed => {
                // The lowered band from its bottom; bisection where it lies beyond the bracket.
                if low > lo && low < hi {
                    low
                } else {
                    geometric(hi)
                }
            }
            (Some(hi), None) if missed => geometric(hi),
            (hi, Some((low, high))) => {
                // `lo` already inside the band: it is near the maximum.
                let near = low <= lo + 1;
                let (low, high) = (low.clamp(lo + 1, top), high.clamp(lo + 1, top));
                if high > low {
                    match (hi, failures) {
                        // Nearing from below: the most the band allows.
                        (None, 0) if near => high,
                        (Some(hi), 0) if near => {
                            let above = self.closing_above(lo);
                            let below = self.closing_below(hi).min(high);
                            above + (CLOSING_BIAS * below.saturating_sub(above) as f64) as u64
                        }
                        _ => {
                            let bias = BIAS[failures.min(BIAS.len() - 1)];
                            low + (bias * (high - low) as f64) as u64
                        }
                    }
                } else {
                    // The band lies at or beyond an end of the bracket: at `lo`, the trial
                    // that settles it; beyond the last failure, the model misled.
                    match hi {
                        Some(hi) if high > lo + 1 => geometric(hi),
                        _ => high,
                    }
                }
            }
            (Some(hi), None) => geometric(hi),
            (None, None) => lo.saturating_mul(2),
        };
        // The cache filled at `lo`, below a failure: the maximum is near it.
        let wanted = if self.hi.is_some() && self.first_full_cache_fit(lo) {
            wanted.min((lo as f64 * (1.0 + FULL_CACHE_STEP)).ceil() as u64)
        } else {
            wanted
        };
        // Never a trial whose outcome cannot settle more than one already settled.
        let mut next = wanted.max(self.closing_above(lo));
        if let Some(hi) = self.hi {
            next = next.min(self.closing_below(hi));
        }
        next.clamp(lo + 1, top).min(max)
    }

    fn finish(self, stopped: Option<Stop>) -> SearchResult {
        let fit = {
            let ran: Vec<(u64, u64)> = self
                .trials
                .iter()
                .take(2)
                .filter_map(|t| Some((t.batch, t.outcome.peak_in(Phase::Outside)?)))
                .collect();
            match ran.as_slice() {
                [(x0, y0), (x1, y1)] if x1 != x0 => {
                    let slope = (*y1 as f64 - *y0 as f64) / (*x1 as f64 - *x0 as f64);
                    Some((*y0 as f64 - slope * *x0 as f64, slope))
                }
                _ => None,
            }
        };
        // A search that fitted up to its cap found no maximum (`capped`): not exact.
        let exact = match (self.lo, self.hi) {
            (Some(lo), Some(hi)) => hi == lo + 1,
            (None, Some(hi)) => hi == 1,
            _ => false,
        };
        let settled = exact || stopped.is_none() && self.done();
        let capped = self.hi.is_none() && self.lo.is_some_and(|lo| lo >= self.config.max_batch);
        SearchResult {
            max_fit: self.lo,
            min_fail: self.hi,
            exact: exact && stopped.is_none(),
            settled: settled && !capped && stopped.is_none(),
            capped,
            trials: self.trials,
            fit,
            stopped,
        }
    }
}

/// Where the line through `points` (batch, peak) reaches `limit_bytes`.
fn predict_from(points: &[(u64, u64)], limit_bytes: u64) -> Option<u64> {
    let limit = limit_bytes as f64;
    let below: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.1 <= limit_bytes)
        .map(|p| (p.0 as f64, p.1 as f64))
        .collect();
    let upper = *below.last()?;
    // Two points straddling the limit: interpolate (regula falsi).
    if let Some(&(x1, y1)) = points.iter().find(|p| p.1 > limit_bytes) {
        let (x1, y1) = (x1 as f64, y1 as f64);
        if y1 > upper.1 && x1 > upper.0 {
            return at_least_one(upper.0 + (limit - upper.1) * (x1 - upper.0) / (y1 - upper.1));
        }
    }
    // Three points below: a parabola follows convex growth (attention, packing) that a line
    // through far-apart points underestimates. Used only when it bends upwards.
    if below.len() >= 3 {
        let [p0, p1, p2] = [below[below.len() - 3], below[below.len() - 2], upper];
        let s01 = (p1.1 - p0.1) / (p1.0 - p0.0);
        let s12 = (p2.1 - p1.1) / (p2.0 - p1.0);
        let c = (s12 - s01) / (p2.0 - p0.0);
        // Significant curvature only: noise of a straight line must not bend the fit.
        if c > 0.0 && s12 > 1.25 * s01 {
            let b = s12 - c * (p1.0 + p2.0);
            let a = p2.1 - b * p2.0 - c * p2.0 * p2.0;
            let disc = b * b - 4.0 * c * (a - limit);
            if disc >= 0.0 {
                return at_least_one((-b + disc.sqrt()) / (2.0 * c));
            }
        }
    }
    local_line_reach(&below, limit)
}

/// Where a line through the last of `points` (batch, bytes; ascending, at or below `limit`)
/// and one at most half its batch reaches `limit`: a local slope that noise in neighbouring
/// points cannot swing. With no point that low, the first one.
fn local_line_reach(points: &[(f64, f64)], limit: f64) -> Option<u64> {
    let upper = *points.last()?;
    let lower = points
        .iter()
        .rev()
        .find(|p| p.0 * 2.0 <= upper.0)
        .or_else(|| points.first().filter(|p| p.0 < upper.0))?;
    let slope = (upper.1 - lower.1) / (upper.0 - lower.0);
    if slope <= 0.0 {
        return None;
    }
    at_least_one(upper.0 + (limit - upper.1) / slope)
}

fn at_least_one(batch: f64) -> Option<u64> {
    batch.is_finite().then(|| batch.floor().max(1.0) as u64)
}

/// The batch to use: `max` less `margin` (a fraction), rounded down to a multiple of 8 where
/// that keeps at least 8 (tensor cores like multiples of 8).
pub fn recommend(max: u64, margin: f64) -> u64 {
    recommend_within(max, margin, None)
}

/// [`recommend`], held at or below `bound` where one is given (the largest batch that leaves
/// room for a block the cache strands: [`crate::stranded`]).
pub fn recommend_within(max: u64, margin: f64, bound: Option<u64>) -> u64 {
    let with_margin = ((max as f64) * (1.0 - margin.clamp(0.0, 0.9))).floor() as u64;
    let batch = with_margin.min(bound.unwrap_or(u64::MAX));
    if batch >= 16 {
        batch - batch % 8
    } else {
        batch.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    /// A device of `capacity` bytes and a memory function: OOM above capacity.
    fn device(
        capacity: u64,
        memory: impl Fn(u64) -> u64,
    ) -> impl FnMut(u64) -> Result<Outcome, Stop> {
        move |b| {
            let m = memory(b);
            Ok(if m > capacity {
                Outcome::OutOfMemory { peak: None }
            } else {
                Outcome::Ran {
                    peak: m,
                    reserved: m,
                    phases: None,
                }
            })
        }
    }

    fn true_max(limit: u64, memory: impl Fn(u64) -> u64, cap: u64) -> u64 {
        (1..=cap)
            .take_while(|b| memory(*b) <= limit)
            .last()
            .unwrap_or(0)
    }

    fn check(
        memory: impl Fn(u64) -> u64 + Copy,
        capacity: u64,
        limit: u64,
        trial_bound: usize,
    ) -> SearchResult {
        let config = SearchConfig {
            limit,
            max_batch: 1 << 16,
            ..SearchConfig::default()
        };
        let result = search(&config, device(capacity, memory));
        let expected = true_max(limit, memory, 1 << 16);
        assert_eq!(
            result.max_fit,
            Some(expected),
            "trials: {:?}",
            result.trials
        );
        assert!(result.exact, "{result:?}");
        assert!(
            result.trials.len() <= trial_bound,
            "{} trials: {:?}",
            result.trials.len(),
            result.trials
        );
        result
    }

    // ResNet-50 fp32 + Adam on an H200, as measured: ~0.4 GiB fixed, 82.7 MiB per sample.
    fn resnet50(b: u64) -> u64 {
        400 * MIB + b * 82_700 * MIB / 1000
    }

    /// A device of `capacity` bytes whose step peaks at `outside(b)` outside the optimizer's
    /// step and `optimizer(b)` inside it; its trials report the two apart where `split`, else
    /// their whole peak only. OOM above capacity.
    fn phased(
        capacity: u64,
        split: bool,
        outside: impl Fn(u64) -> u64,
        optimizer: impl Fn(u64) -> u64,
    ) -> impl FnMut(u64) -> Result<Outcome, Stop> {
        move |b| {
            let (outside, optimizer) = (outside(b), optimizer(b));
            let peak = outside.max(optimizer);
            Ok(if peak > capacity {
                Outcome::OutOfMemory { peak: None }
            } else {
                Outcome::Ran {
                    peak,
                    reserved: peak,
                    phases: split.then_some(PhasePeaks { outside, optimizer }),
                }
            })
        }
    }

    /// The masked autoencoder of maxbatch-truth-2026-12-06m (ViT-B, bf16 autocast, AdamW over
    /// 112M parameters, 40 MB a sample outside the update): the update's peak is the step's up
    /// to about 16 samples.
    fn autoencoder(split: bool) -> impl FnMut(u64) -> Result<Outcome, Stop> {
        phased(
            24 * GIB,
            split,
            |b| 1_670_000_000 + 40_400_000 * b,
            |b| 2_330_000_000 + 300_000 * b,
        )
    }

    fn phased_config(limit: u64) -> SearchConfig {
        SearchConfig {
            limit,
            max_batch: 1 << 16,
            ..SearchConfig::default()
        }
    }

    #[test]
    fn the_steeper_phase_sets_the_maximum_where_the_update_holds_the_step() {
        // An optimizer whose step calls the closure (LBFGS): the forward and backward run
        // inside it, and outside it only the data and the held output grow.
        let lbfgs = phased(
            24 * GIB,
            true,
            |b| 800_000_000 + 100_000 * b,
            |b| 1_000_000_000 + 30_000_000 * b,
        );
        let result = search(&phased_config(24 * GIB), lbfgs);
        let expected = (24 * GIB - 1_000_000_000) / 30_000_000;
        assert_eq!(result.max_fit, Some(expected), "{:?}", result.trials);
        assert!(result.trials.len() <= 5, "{:?}", result.trials);
    }

    #[test]
    fn the_second_opening_is_set_from_the_phase_that_holds_the_samples() {
        // The masked autoencoder's line (`autoencoder`) over 0.48 GiB of weights: the update
        // tops the step at 4 samples, but outside it holds most of the step's bytes.
        let config = SearchConfig {
            held: 515_000_000,
            ..phased_config(24 * GIB)
        };
        let mut device = autoencoder(true);
        let first = device(4).expect("a device");
        let outside = first.peak_in(Phase::Outside).expect("split");
        assert_eq!(config.opening_peak(&first), Some(outside));
        let result = search(&config, autoencoder(true));
        assert_eq!(
            result.trials[1].batch,
            config.second_opening(4, outside),
            "{:?}",
            result.trials
        );
        assert!(result.trials[1].batch > config.second_opening(4, 2_330_000_000));
        // Unsplit, the whole peak is all there is.
        let whole = Outcome::Ran {
            peak: 2_330_000_000,
            reserved: 0,
            phases: None,
        };
        assert_eq!(config.opening_peak(&whole), Some(2_330_000_000));
        assert_eq!(
            config.opening_peak(&Outcome::OutOfMemory { peak: None }),
            None
        );
    }

    #[test]
    fn a_first_opening_that_runs_over_the_limit_sends_the_search_down() {
        // A `--limit` below the card: batch 4 runs on the card but peaks above the limit, so
        // it does not fit, and the second trial goes below it, not to a larger opening.
        let config = SearchConfig {
            limit: GIB,
            held: 100 * MIB,
            ..SearchConfig::default()
        };
        let result = search(&config, device(140 * GIB, |b| 100 * MIB + b * 300 * MIB));
        assert!(!result.trials[0].fits, "{:?}", result.trials);
        assert!(result.trials[1].batch < 4, "{:?}", result.trials);
        assert_eq!(result.max_fit, Some(3), "{:?}", result.trials);
        assert!(result.trials.len() <= 3, "{:?}", result.trials);
    }

    #[test]
    fn a_closure_that_runs_the_forward_inside_the_update_opens_from_the_whole_peak() {
        // LBFGS over 1 GB of weights, 600 MB a sample inside its step: outside it, next to
        // nothing grows. From the outside peak the second opening would be the configured
        // 64, out of memory; from the whole peak it fits, and the search loses no trial.
        let held = 1_000_000_000;
        let lbfgs = || {
            phased(
                24 * GIB,
                true,
                move |b| held + 50_000_000 + 100_000 * b,
                move |b| held + 200_000_000 + 600_000_000 * b,
            )
        };
        let config = SearchConfig {
            held,
            ..phased_config(24 * GIB)
        };
        let result = search(&config, lbfgs());
        assert!(result.trials[1].fits, "{:?}", result.trials);
        let expected = (24 * GIB - held - 200_000_000) / 600_000_000;
        assert_eq!(result.max_fit, Some(expected), "{:?}", result.trials);
        assert!(result.trials.len() <= 5, "{:?}", result.trials);
    }

    #[test]
    fn an_update_that_nearly_fills_the_card_sets_the_maximum() {
        // A large model under Adam on a card it nearly fills: the update alone is at 0.9 of
        // the limit at every batch, above the band's lower edge, and the data it steps over
        // (the held output) grows it by 10 MB a sample.
        let limit = 24 * GIB;
        let device = phased(
            limit,
            true,
            |b| 2_000_000_000 + 40_000_000 * b,
            move |b| limit * 9 / 10 + 10_000_000 * b,
        );
        let result = search(&phased_config(limit), device);
        let expected = (limit / 10) / 10_000_000;
        assert_eq!(result.max_fit, Some(expected), "{:?}", result.trials);
        assert!(result.trials.len() <= 5, "{:?}", result.trials);
    }

    #[test]
    fn an_update_that_peaks_above_small_batches_does_not_bend_the_line() {
        let config = phased_config(24 * GIB);
        let expected = (24 * GIB - 1_670_000_000) / 40_400_000;
        let split = search(&config, autoencoder(true));
        assert_eq!(split.max_fit, Some(expected), "{:?}", split.trials);
        assert!(split.trials.len() <= 5, "{:?}", split.trials);
        let (fixed, per_sample) = split.fit.expect("a line");
        assert!((per_sample - 40.4e6).abs() < 1e3, "{per_sample}");
        assert!((fixed - 1.67e9).abs() < 1e5, "{fixed}");
        // The same device, its peaks whole: the openings' line is half as steep as the step's
        // own, and the band's trials above the maximum fail in a row.
        let whole = search(&config, autoencoder(false));
        let failed = whole.trials.iter().filter(|t| !t.fits).count();
        assert!(failed >= 3, "{:?}", whole.trials);
        assert!(
            whole.trials.len() > split.trials.len() + 3,
            "{:?}",
            whole.trials
        );
    }

    // The synthetic devices below need exactly the allocated bytes, the band's top edge; the
    // band is tuned to the measured devices (tests/search_replay.rs), where the maximum lies
    // lower in it, so these cost a trial or two more than a search tuned to them would.
    #[test]
    fn linear_memory_is_found_in_five_trials() {
        let result = check(resnet50, 140 * GIB, 140 * GIB, 5);
        assert!(result.max_fit.unwrap() > 1700);
        let (fixed, per_sample) = result.fit.unwrap();
        assert!((per_sample - 82.7 * MIB as f64).abs() < MIB as f64);
        assert!((fixed - 400.0 * MIB as f64).abs() < 2.0 * MIB as f64);
    }

    #[test]
    fn a_limit_below_the_device_is_honoured() {
        // Answer for a 24 GiB card while running on a 140 GiB one.
        check(resnet50, 140 * GIB, 24 * GIB, 5);
    }

    #[test]
    fn steps_in_memory_are_bracketed() {
        // A cuDNN workspace that jumps by 2 GiB past batch 512, and another past 1400.
        let stepped = |b: u64| {
            resnet50(b) + if b > 512 { 2 * GIB } else { 0 } + if b > 1400 { 3 * GIB } else { 0 }
        };
        check(stepped, 140 * GIB, 140 * GIB, 10);
    }

    #[test]
    fn non_linear_memory_converges() {
        // Attention-like: quadratic in batch (sequence packing), plus a fixed part.
        let quadratic = |b: u64| GIB + b * 4 * MIB + b * b * 64 * 1024;
        check(quadratic, 80 * GIB, 80 * GIB, 12);
    }

    #[test]
    fn noisy_memory_converges() {
        // ±1.5% deterministic jitter on the activation part.
        let noisy = |b: u64| {
            let jitter = ((b.wrapping_mul(2654435761) % 1000) as f64 / 1000.0 - 0.5) * 0.03;
            400 * MIB + ((b * 82 * MIB) as f64 * (1.0 + jitter)) as u64
        };
        let config = SearchConfig {
            limit: 140 * GIB,
            max_batch: 1 << 16,
            ..SearchConfig::default()
        };
        let result = search(&config, device(140 * GIB, noisy));
        // Noise makes "fits" non-monotonic near the limit; the answer must still be a batch that
        // fits with its neighbour failing, found within the budget.
        let max = result.max_fit.unwrap();
        assert!(
            noisy(max) <= 140 * GIB && noisy(max + 1) > 140 * GIB || !result.exact,
            "{result:?}"
        );
        assert!(result.exact);
        assert!(result.trials.len() <= 12);
    }

    /// A device whose cache needs `overhead` more than the allocated bytes the probe reports
    /// (block rounding and splitting): OOM comes before the peak reaches the capacity.
    fn fragmented(
        capacity: u64,
        overhead: f64,
        memory: impl Fn(u64) -> u64,
    ) -> impl FnMut(u64) -> Result<Outcome, Stop> {
        move |b| {
            let m = memory(b);
            Ok(if m as f64 * (1.0 + overhead) > capacity as f64 {
                Outcome::OutOfMemory { peak: None }
            } else {
                Outcome::Ran {
                    peak: m,
                    reserved: m,
                    phases: None,
                }
            })
        }
    }

    /// The largest ResNet-50 batch whose cache, `overhead` more than its allocated peak,
    /// fits `capacity`.
    fn truth_with_overhead(capacity: u64, overhead: f64) -> u64 {
        (1..1u64 << 16)
            .take_while(|b| resnet50(*b) as f64 * (1.0 + overhead) <= capacity as f64)
            .last()
            .unwrap()
    }

    /// The search's answer is at or below `truth`, and within `tolerance` of it.
    fn assert_within(result: &SearchResult, truth: u64, tolerance: f64, what: &str) {
        let found = result.max_fit.unwrap();
        assert!(
            found <= truth && (truth - found) as f64 <= tolerance * truth as f64,
            "{what}"
        );
    }

    #[test]
    fn one_percent_is_settled_in_seven_trials_though_the_cache_needs_more() {
        for capacity in [24 * GIB, 40 * GIB, 80 * GIB, 140 * GIB] {
            for overhead in [0.0, 0.005, 0.01, 0.015, 0.02] {
                let config = SearchConfig {
                    limit: capacity,
                    max_batch: 1 << 16,
                    tolerance: 0.01,
                    ..SearchConfig::default()
                };
                let result = search(&config, fragmented(capacity, overhead, resnet50));
                let what = format!("{capacity} B, {overhead} overhead: {result:?}");
                assert_within(
                    &result,
                    truth_with_overhead(capacity, overhead),
                    0.01,
                    &what,
                );
                assert!(result.settled && result.trials.len() <= 7, "{what}");
            }
        }
    }

    #[test]
    fn a_fit_far_off_costs_a_few_trials_not_a_walk() {
        // The cache needs 8% more than the fit sees: the growing back-off and then bisection
        // reach it in fewer trials than double-then-bisect's twenty.
        let config = SearchConfig {
            limit: 140 * GIB,
            max_batch: 1 << 16,
            tolerance: 0.01,
            ..SearchConfig::default()
        };
        let result = search(&config, fragmented(140 * GIB, 0.08, resnet50));
        let truth = (1..1u64 << 16)
            .take_while(|b| resnet50(*b) as f64 * 1.08 <= (140 * GIB) as f64)
            .last()
            .unwrap();
        let found = result.max_fit.unwrap();
        assert!(found <= truth && (truth - found) as f64 <= 0.01 * truth as f64);
        assert!(result.settled && result.trials.len() <= 10, "{result:?}");
    }

    /// ViT-B/16 fp32 as measured on an H100 under a 76 GiB cap (maxbatch-truth-2026-12-07e):
    /// lines through its allocated and reserved peaks at 64 and 598 samples; the true maximum
    /// is 621.
    fn vit_at_76_gib(b: u64, reserved_at_598: u64) -> Result<Outcome, Stop> {
        let line = |(x0, y0): (u64, u64), (x1, y1): (u64, u64)| {
            y0 as f64 + (y1 as f64 - y0 as f64) * (b as f64 - x0 as f64) / (x1 - x0) as f64
        };
        let allocated = line((64, 9_349_219_840), (598, 77_406_175_744));
        let reserved = line((64, 9_563_013_120), (598, reserved_at_598));
        Ok(if b > 621 {
            Outcome::OutOfMemory { peak: None }
        } else {
            Outcome::Ran {
                peak: allocated as u64,
                reserved: reserved as u64,
                phases: None,
            }
        })
    }

    #[test]
    fn the_caches_line_sends_the_search_to_the_trial_that_settles_it() {
        let config = |tolerance| SearchConfig {
            limit: 76 * GIB,
            max_batch: 1 << 16,
            tolerance,
            held: 1_629_916_160,
            ..SearchConfig::default()
        };
        let tried = |tolerance, reserved_at_598| {
            let result = search(&config(tolerance), |b| vit_at_76_gib(b, reserved_at_598));
            let batches: Vec<(u64, bool)> =
                result.trials.iter().map(|t| (t.batch, t.fits)).collect();
            (batches, result.max_fit, result.settled)
        };
        // As measured: 603 fits with the cache at 0.975 of the limit, whose line reaches it
        // at 619, and 630 fails. 620 settles the answer if it fits (619 lies within the
        // tolerance below it), so it comes next, and it ends the search.
        let (batches, found, settled) = tried(0.015, 78_869_692_416);
        assert_eq!(batches[2..], [(603, true), (630, false), (620, true)]);
        assert_eq!((found, settled), (Some(620), true));
        // The bracket's middle comes first, a trial more, where the line is not taken: the
        // cache at 0.986 of the limit at 603, whose line would reach it at 611 (near the
        // limit the allocator frees and retries, so its peak stops following the batch); a
        // line that reaches the limit only at or past the failure (652); and with no
        // tolerance (`--exact`), where the line's 619 is short of the trial that settles
        // the answer, 629.
        for (tolerance, reserved_at_598, why) in [
            (0.015, 79_850_000_000, "the cache near the limit"),
            (0.015, 75_000_000_000, "a line past the failure"),
            (0.0, 78_869_692_416, "no tolerance"),
        ] {
            let (batches, found, settled) = tried(tolerance, reserved_at_598);
            assert_eq!(batches[2..4], [(603, true), (630, false)], "{why}");
            assert!(
                batches[4].0 < 620 && batches.len() > 5,
                "{why}: {batches:?}"
            );
            let exact = if tolerance == 0.0 { 621 } else { 612 };
            assert!(settled && found >= Some(exact), "{why}: {found:?}");
        }
    }

    #[test]
    fn fragmentation_the_cache_shows_is_followed() {
        // A transformer as measured on an H200: the cache holds 19% more than is allocated at
        // batch 64 and 26% more from a few hundred on, none of it reclaimable, so the line
        // through allocated peaks overshoots the real maximum by a fifth.
        let allocated = |b: u64| 905 * MIB + b * 126_600 * MIB / 1000;
        let ratio = |b: u64| {
            if b < 300 {
                1.0 + 0.19 * b as f64 / 64.0
            } else {
                1.26
            }
            .min(1.26)
        };
        let capacity = 140 * GIB;
        let config = SearchConfig {
            limit: capacity,
            max_batch: 1 << 16,
            tolerance: 0.01,
            ..SearchConfig::default()
        };
        let probe = |b: u64| {
            let reserved = (allocated(b) as f64 * ratio(b)) as u64;
            Ok(if reserved > capacity {
                Outcome::OutOfMemory { peak: None }
            } else {
                Outcome::Ran {
                    peak: allocated(b),
                    reserved,
                    phases: None,
                }
            })
        };
        let result = search(&config, probe);
        let truth = (1..1u64 << 16)
            .take_while(|b| (allocated(*b) as f64 * ratio(*b)) as u64 <= capacity)
            .last()
            .unwrap();
        let found = result.max_fit.unwrap();
        assert!(
            found <= truth && (truth - found) as f64 <= 0.01 * truth as f64,
            "{result:?}"
        );
        assert!(result.settled && result.trials.len() <= 10, "{result:?}");
    }

    #[test]
    fn a_maximum_below_the_band_is_bisected_towards_the_top() {
        // A language model with a frozen backbone trained by a `--step` function, as measured
        // on an H200 under a 24 GiB cap (maxbatch-truth-2026-12-06w, gpt_frozen_step): its
        // allocated peak at the maximum, 65, is 0.83 of the limit, below the band, so three
        // trials in the band fail. The bisection that follows rounds its middles up, where a
        // failure (cheaper than a fit) is likelier: rounded down it climbed 61, 63, 64, 65, 66
        // and took 11 trials.
        let line = |b: u64| 804_381_992 + b * 315_727_286;
        let config = SearchConfig {
            limit: 24 * GIB,
            max_batch: 1 << 16,
            tolerance: 0.015,
            held: 494_467_072,
            ..SearchConfig::default()
        };
        let probe = |b: u64| {
            Ok(if b > 65 {
                Outcome::OutOfMemory { peak: None }
            } else {
                Outcome::Ran {
                    peak: line(b),
                    reserved: 0,
                    phases: None,
                }
            })
        };
        let result = search(&config, probe);
        let failed: Vec<u64> = result.trials[2..5].iter().map(|t| t.batch).collect();
        assert!(result.trials[2..5].iter().all(|t| !t.fits), "{result:?}");
        assert_eq!(failed, [75, 69, 67], "{result:?}");
        assert_eq!(result.max_fit, Some(65), "{result:?}");
        assert!(result.exact && result.trials.len() <= 9, "{result:?}");
    }

    #[test]
    fn a_failure_before_any_line_is_bracketed_by_ratio() {
        // A language model whose second opening already runs out of memory (measured on an
        // H200 under a 24 GiB cap: 4 fits, 64 does not, the maximum is 48): the next trial is
        // the geometric middle, not a walk back from 64.
        let lm = |b: u64| 4 * GIB + b * 420 * MIB;
        let config = SearchConfig {
            limit: 24 * GIB,
            max_batch: 1 << 16,
            tolerance: 0.01,
            ..SearchConfig::default()
        };
        let result = search(&config, device(24 * GIB, lm));
        assert_eq!(result.trials[2].batch, 16, "{result:?}");
        let truth = true_max(24 * GIB, lm, 1 << 16);
        assert_eq!(result.max_fit, Some(truth), "{result:?}");
        assert!(result.trials.len() <= 7, "{result:?}");
    }

    #[test]
    fn nothing_fits_and_everything_fits() {
        let huge = |_b: u64| 200 * GIB;
        let config = SearchConfig {
            limit: 140 * GIB,
            max_batch: 1024,
            ..SearchConfig::default()
        };
        let result = search(&config, device(140 * GIB, huge));
        assert_eq!(result.max_fit, None);
        assert_eq!(result.min_fail, Some(1));
        assert!(!result.capped);
        let tiny = |b: u64| b;
        let result = search(&config, device(140 * GIB, tiny));
        assert_eq!(result.max_fit, Some(1024));
        // Every batch fits up to the cap: the maximum is not found.
        assert!(result.capped && !result.exact && !result.settled);
        // 1 byte a sample: it grew.
        assert_eq!(result.flat_memory(), None);
        // A step that makes its batch at a size of its own (a --step FN that ignores its
        // argument): with no line to follow the search doubles, up to its cap.
        let flat = |b: u64| 3 * GIB + b % 3;
        let config = SearchConfig {
            max_batch: 1 << 16,
            ..config
        };
        let result = search(&config, device(140 * GIB, flat));
        assert_eq!(result.max_fit, Some(1 << 16));
        assert!(result.capped, "{:?}", result.trials);
        let ((small, _), (large, _)) = result.flat_memory().expect("flat");
        assert_eq!((small, large), (4, 1 << 16));
        // Found below the cap: neither capped nor flat.
        let result = search(&config, device(140 * GIB, |b| GIB + b * 10 * MIB));
        assert!(!result.capped && result.exact && result.flat_memory().is_none());
    }

    #[test]
    fn a_cancel_stops_the_search() {
        let config = SearchConfig::default();
        let mut calls = 0;
        let result = search(&config, |b| {
            calls += 1;
            if calls == 3 {
                Err(Stop::Cancelled)
            } else {
                Ok(Outcome::Ran {
                    peak: b,
                    reserved: b,
                    phases: None,
                })
            }
        });
        assert_eq!(result.stopped, Some(Stop::Cancelled));
        assert_eq!(result.trials.len(), 2);
        assert!(!result.exact);
    }

    #[test]
    fn double_then_bisect_needs_many_more_trials() {
        let config = SearchConfig {
            limit: 140 * GIB,
            max_batch: 1 << 16,
            max_trials: 64,
            ..SearchConfig::default()
        };
        let baseline = double_then_bisect(&config, 2, device(140 * GIB, resnet50));
        let ours = search(&config, device(140 * GIB, resnet50));
        assert_eq!(baseline.max_fit, ours.max_fit);
        assert!(
            baseline.trials.len() >= 3 * ours.trials.len(),
            "{} vs {}",
            baseline.trials.len(),
            ours.trials.len()
        );
    }

    #[test]
    fn recommendation_applies_margin_and_rounds() {
        assert_eq!(recommend(1705, 0.05), 1616);
        assert_eq!(recommend(10, 0.05), 9);
        assert_eq!(recommend(1, 0.5), 1);
        // A bound below the margin's batch holds it, rounded the same way.
        assert_eq!(recommend_within(232, 0.05, Some(211)), 208);
        assert_eq!(recommend_within(232, 0.05, Some(400)), 216);
        assert_eq!(recommend_within(20, 0.05, Some(12)), 12);
    }
    /// A cache that fills before the step runs out of it: the allocated peak `memory(b)`, the
    /// cache the step needs `(1 + overhead)` times that, and the cache as it reports: that need
    /// plus `fill` of the limit it holds besides (blocks cached and not reused), up to the limit.
    fn filling(
        capacity: u64,
        overhead: f64,
        fill: f64,
        memory: impl Fn(u64) -> u64,
    ) -> impl FnMut(u64) -> Result<Outcome, Stop> {
        move |b| {
            let m = memory(b);
            let need = m as f64 * (1.0 + overhead);
            Ok(if need > capacity as f64 {
                Outcome::OutOfMemory { peak: None }
            } else {
                Outcome::Ran {
                    peak: m,
                    reserved: (need + fill * capacity as f64).min(capacity as f64) as u64,
                    phases: None,
                }
            })
        }
    }

    #[test]
    fn a_cache_that_fills_below_the_maximum_brings_the_next_trial_close() {
        // The cache needs a third more than the allocated peak, as timm's ConvNeXt-T under
        // checkpointing did: the band misses, and the first fit below the failures fills the
        // cache. Without the full cache's step the closing bisection took 10 trials at 80 GiB.
        // However early the cache fills, the step is taken once, so it never costs a walk.
        for capacity in [24 * GIB, 80 * GIB] {
            for overhead in [0.0, 0.05, 0.1, 0.2, 0.32] {
                for fill in [0.0, 0.02, 0.05, 0.1, 0.2, 0.3] {
                    let config = SearchConfig {
                        limit: capacity,
                        max_batch: 1 << 16,
                        tolerance: 0.015,
                        ..SearchConfig::default()
                    };
                    let result = search(&config, filling(capacity, overhead, fill, resnet50));
                    let what = format!("{capacity} B, {overhead} more, {fill} filled: {result:?}");
                    let truth = truth_with_overhead(capacity, overhead);
                    assert_within(&result, truth, 0.015, &what);
                    let most = if overhead == 0.32 && fill > 0.0 {
                        8
                    } else {
                        10
                    };
                    assert!(result.settled && result.trials.len() <= most, "{what}");
                }
            }
        }
    }
}
