//! Room for a block the CUDA caching allocator strands.
//!
//! Under the default allocator a batch below one that fits can still run out of memory. A
//! long-lived tensor (the half-precision logits, an optimizer's state) gets carved out of a
//! segment a larger tensor freed, and the rest of that segment, free but split, serves no
//! request larger than itself. When the step next asks for its largest tensor, the cache has
//! to reserve a new segment of that size beside the stranded one. Measured on an H100 at
//! 76 GiB (bench/results/holes-check-2026-12-07.json): a GPT with fp16 autocast ran its second
//! step at 200 and 208 and failed it at 216 and 224, asking for its 14.2 GB fp32 logits while
//! 13.8 GB lay free in two split segments of that size; with `expandable_segments` all four
//! ran 30 steps. So a batch is only safe where its allocated peak leaves room for one more
//! of its largest block: [`room`] finds the largest such batch from the search's trials.
//! Under `expandable_segments` the cache maps pages instead of carving segments, and no room
//! is needed ([`largest_new_segment`] measures no block then).

use serde::Serialize;

/// One of the caching allocator's segments, as its snapshot lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub address: u64,
    pub bytes: u64,
    /// Under `expandable_segments`: mapped pages that grow in place, which strand nothing.
    pub expandable: bool,
}

/// The largest of `segments` not among `held` (the segments there before a trial): the
/// trial's largest single allocation as the cache rounds it, since each segment is made for
/// one request. A segment is known by its address and size together: one the cache gave
/// back and made again at the same address for another request is new. `None` under
/// expandable segments, which strand no block; 0 where the trial made the cache reserve
/// nothing new.
pub fn largest_new_segment(segments: &[Segment], held: &[Segment]) -> Option<u64> {
    if segments.iter().any(|s| s.expandable) {
        return None;
    }
    let was_held = |s: &Segment| {
        held.iter()
            .any(|h| h.address == s.address && h.bytes == s.bytes)
    };
    Some(
        segments
            .iter()
            .filter(|s| !was_held(s))
            .map(|s| s.bytes)
            .max()
            .unwrap_or(0),
    )
}

/// A trial that fitted, as the room is computed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fitted {
    pub batch: u64,
    /// The trial's allocated peak in bytes.
    pub peak: u64,
    /// The largest segment the trial's allocations made the cache reserve: the step's
    /// largest single allocation, rounded as the cache rounds it.
    pub largest_block: u64,
}

/// The room one more of the step's largest blocks takes, and the batch it leaves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Room {
    /// The largest block at `at_batch`, the largest batch that fitted.
    pub block: u64,
    pub at_batch: u64,
    /// What the block grows by per sample (0 for one of fixed size, such as a weight's).
    pub block_per_sample: f64,
    /// The largest batch whose allocated peak, with one more such block, stays within the
    /// limit (`at_batch` where it does there).
    pub largest_batch: u64,
}

/// How far below the margin's batch the room may hold a recommendation. For a block that
/// grows with the batch the bound lies 10 to 14% below the maximum on the benchmark's rows it
/// held (an fp16 GPT's logits, a checkpointed GPT's, ResNet-18's first activation:
/// maxbatch-truth-2026-12-07f); a bound below half the margin's batch means a block that
/// barely shrinks with the batch (a weight's, an embedding's gradient), which a smaller batch
/// cannot make room for.
pub const LOWEST_HELD: f64 = 0.5;

impl Room {
    /// The batch the recommendation is held at or below, given the margin's (`margin_batch`):
    /// the room's bound where it is below that and within [`LOWEST_HELD`] of it.
    pub fn holds(&self, margin_batch: u64) -> Option<u64> {
        (self.largest_batch < margin_batch && !self.out_of_reach(margin_batch))
            .then_some(self.largest_batch)
    }

    /// Whether no batch near the margin's leaves the room: a stranded block can then fail a
    /// batch below the maximum, and only `expandable_segments` avoids it.
    pub fn out_of_reach(&self, margin_batch: u64) -> bool {
        (self.largest_batch as f64) < LOWEST_HELD * margin_batch as f64
    }
}

/// The recommendation for `max` with `margin` (a fraction), held at the room's bound where
/// the room holds it ([`Room::holds`]): what both engines report (and the python engine
/// confirms).
pub fn recommend(max: u64, margin: f64, room: Option<Room>) -> u64 {
    let margin_batch = crate::search::recommend(max, margin);
    crate::search::recommend_within(max, margin, room.and_then(|r| r.holds(margin_batch)))
}

/// The room from a search's trials that fitted, each as (batch, allocated peak, its largest
/// block where measured); `None` where any of them measured no block (expandable segments,
/// which strand none, or segments that could not be read): a room from some trials only
/// would draw its lines through the wrong points.
pub fn room_of_trials(
    fitted: impl IntoIterator<Item = (u64, u64, Option<u64>)>,
    limit: u64,
) -> Option<Room> {
    let trials: Option<Vec<Fitted>> = fitted
        .into_iter()
        .map(|(batch, peak, block)| {
            Some(Fitted {
                batch,
                peak,
                largest_block: block?,
            })
        })
        .collect();
    room(&trials?, limit)
}

/// The room for one stranded block under `limit`, from the trials that fitted; `None` with
/// no trial to read it from. The allocated peak and the block are each taken as a line in
/// the batch, through the largest trial and the smallest below it (the search's own
/// opening trials at least), and the batch is the largest where their sum stays within the
/// limit.
pub fn room(fitted: &[Fitted], limit: u64) -> Option<Room> {
    let top = *fitted.iter().max_by_key(|t| t.batch)?;
    let low = fitted
        .iter()
        .filter(|t| t.batch < top.batch)
        .min_by_key(|t| t.batch);
    let (peak_per_sample, block_per_sample) = match low {
        Some(low) => {
            let span = (top.batch - low.batch) as f64;
            (
                (top.peak as f64 - low.peak as f64) / span,
                ((top.largest_block as f64 - low.largest_block as f64) / span).max(0.0),
            )
        }
        // One trial alone: all of it per sample, which steps down least.
        None => (
            top.peak as f64 / top.batch.max(1) as f64,
            top.largest_block as f64 / top.batch.max(1) as f64,
        ),
    };
    let excess = (top.peak + top.largest_block).saturating_sub(limit) as f64;
    let per_sample = peak_per_sample + block_per_sample;
    let largest_batch = if excess <= 0.0 {
        top.batch
    } else if per_sample > 0.0 {
        top.batch
            .saturating_sub((excess / per_sample).ceil() as u64)
            .max(1)
    } else {
        1
    };
    Some(Room {
        block: top.largest_block,
        at_batch: top.batch,
        block_per_sample,
        largest_batch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn fitted(batch: u64, peak_gb: f64, block_gb: f64) -> Fitted {
        Fitted {
            batch,
            peak: (peak_gb * GB as f64) as u64,
            largest_block: (block_gb * GB as f64) as u64,
        }
    }

    #[test]
    fn the_fp16_gpt_of_the_holes_check_is_held_below_its_first_hole() {
        // The search's trials of maxbatch-truth-2026-12-07b's gpt_fp16_scaler (peaks as
        // measured; blocks as its fp32 logits, 65.5 MB a sample): 216 and 224 failed in the
        // notebook's loop, 200 and 208 ran 30 steps.
        let trials = [
            fitted(4, 2.784, 0.262),
            fitted(64, 21.52, 4.19),
            fitted(228, 72.77, 14.94),
            fitted(232, 74.01, 15.20),
        ];
        let room = room(&trials, 81_604_378_624).expect("trials");
        assert_eq!(room.at_batch, 232);
        assert!((room.block_per_sample / 65.5e6 - 1.0).abs() < 0.01);
        assert!(
            (208..216).contains(&room.largest_batch),
            "{}",
            room.largest_batch
        );
        assert_eq!(room.holds(216), Some(room.largest_batch));
        assert_eq!(room.holds(208), None);
        assert_eq!(recommend(232, 0.05, Some(room)), 208);
        assert_eq!(recommend(232, 0.05, None), 216);
    }

    #[test]
    fn a_step_with_room_at_its_maximum_is_not_held_lower() {
        // A ViT: its largest block (1.5 GB) fits beside the peak at the maximum.
        let trials = [fitted(4, 1.8, 0.01), fitted(620, 79.5, 1.5)];
        let room = room(&trials, 81_600_000_000).expect("trials");
        assert_eq!(room.largest_batch, 620);
        assert_eq!(room.holds(584), None);
    }

    #[test]
    fn a_block_of_fixed_size_takes_the_same_room_at_every_batch() {
        // The largest block is a weight (2 GB), not an activation: it does not shrink with
        // the batch, so the step down is the room over the peak's growth alone.
        let trials = [fitted(10, 12.0, 2.0), fitted(110, 52.0, 2.0)];
        let weight = room(&trials, 53_000_000_000).expect("trials");
        assert_eq!(weight.block_per_sample, 0.0);
        // 52 + 2 - 53 = 1 GB over, at 0.4 GB a sample: 3 samples down.
        assert_eq!(weight.largest_batch, 107);
        assert_eq!(weight.holds(104), None);
        // A 50 GB embedding's gradient beside a step of 0.05 GB a sample: no batch near the
        // margin's makes room for it, and the recommendation is not taken down to nothing.
        let heavy = [fitted(100, 60.0, 50.0), fitted(1500, 130.0, 50.0)];
        let gradient = room(&heavy, 135_000_000_000).expect("trials");
        assert!(gradient.out_of_reach(1424), "{gradient:?}");
        assert_eq!(gradient.holds(1424), None);
    }

    #[test]
    fn the_largest_block_is_the_largest_segment_a_trial_added() {
        let segment = |address, bytes| Segment {
            address,
            bytes,
            expandable: false,
        };
        // The weights' 4 GB segment was there before; the trial added 2 GB and 14 GB ones.
        let weights = segment(1, 4 * GB);
        let after = [weights, segment(2, 2 * GB), segment(3, 14 * GB)];
        assert_eq!(largest_new_segment(&after, &[weights]), Some(14 * GB));
        assert_eq!(
            largest_new_segment(&after, &[weights, segment(3, 14 * GB)]),
            Some(2 * GB)
        );
        assert_eq!(largest_new_segment(&after, &after), Some(0));
        // A 1 GB segment the cache gave back, and a 14 GB one made at its address: new.
        assert_eq!(
            largest_new_segment(&after, &[weights, segment(3, GB)]),
            Some(14 * GB)
        );
        // Under expandable segments no block is stranded, so none is reported.
        let mapped = [Segment {
            expandable: true,
            ..segment(4, 20 * GB)
        }];
        assert_eq!(largest_new_segment(&mapped, &[]), None);
    }

    #[test]
    fn the_cases_shared_with_the_python_engine_are_answered_alike() {
        // tests/python/test_maxbatch_python_engine.py reads the same file for trials.py's
        // _largest_new_segment.
        #[derive(serde::Deserialize)]
        struct Case {
            name: String,
            segments: Vec<(u64, u64, bool)>,
            held: Vec<(u64, u64)>,
            expected: Option<u64>,
        }
        #[derive(serde::Deserialize)]
        struct Cases {
            cases: Vec<Case>,
        }
        let Cases { cases } =
            serde_json::from_str(include_str!("../tests/data/largest_new_segment.json"))
                .expect("the shared cases parse");
        assert!(cases.len() >= 5);
        let segment = |address, bytes, expandable| Segment {
            address,
            bytes,
            expandable,
        };
        for case in cases {
            let segments: Vec<Segment> = case
                .segments
                .iter()
                .map(|&(a, b, e)| segment(a, b, e))
                .collect();
            let held: Vec<Segment> = case
                .held
                .iter()
                .map(|&(a, b)| segment(a, b, false))
                .collect();
            assert_eq!(
                largest_new_segment(&segments, &held),
                case.expected,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn no_trial_no_room_and_one_trial_steps_down_least() {
        assert_eq!(room(&[], 1), None);
        let one = room(&[fitted(100, 50.0, 10.0)], 55 * GB).expect("one trial");
        // 5 GB over at 0.6 GB a sample (all of it per sample): 9 down.
        assert_eq!(one.largest_batch, 91);
    }
}
