//! Which loss a standard training step computes on a model's output.
//!
//! The loss decides a good part of a step's memory: cross-entropy over a language model's
//! logits keeps their softmax for backward (batch x sequence x vocabulary floats), where a mean
//! keeps nothing. So `%maxbatch` trains with the loss the user's loop most likely uses, and says
//! which one it assumed. Both engines (libtorch and the Python kernel) take their plan from
//! here, so they cannot disagree about it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The loss a user asks for (`--loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Cross-entropy against random class targets.
    Ce,
    /// Mean squared error against a random target of the output's shape.
    Mse,
    /// The output's mean (no target; the smallest backward a step can have).
    Mean,
}

/// What the step computes, as both engines run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LossPlan {
    /// Cross-entropy over `classes` classes found in `class_dim` of the output: `-1` (the last
    /// dimension; a language model's `[batch, seq, vocab]` is flattened to `[batch*seq,
    /// vocab]`) or `1` (`[batch, classes, H, W]`, a segmentation map, as PyTorch's
    /// cross_entropy takes it).
    Ce {
        classes: i64,
        class_dim: i64,
    },
    Mse,
    Mean,
}

impl fmt::Display for LossPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossPlan::Ce {
                classes,
                class_dim: -1,
            } => write!(
                f,
                "cross-entropy over the last dimension ({classes} classes)"
            ),
            LossPlan::Ce { classes, class_dim } => write!(
                f,
                "cross-entropy over dimension {class_dim} ({classes} classes, per position)"
            ),
            LossPlan::Mse => write!(f, "mean squared error against a random target"),
            LossPlan::Mean => write!(f, "the output's mean"),
        }
    }
}

/// What the loss is computed on when a model returns several tensors. Both engines select
/// alike (gpuprobe's `output` module for TorchScript, trials.py's `_select_output` in the
/// Python kernel): the loss trains the selected tensor and the auxiliary heads like it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LossInputs {
    /// How the tensor the loss is computed on was found: `output`, `output['out']`.
    pub selected: String,
    /// Auxiliary heads (torchvision's `output['aux']`; a deep-supervised net's coarser maps,
    /// named with their size), in the loss too.
    #[serde(default)]
    pub heads: Vec<String>,
    /// Floating-point scalars the output also holds (`output[0]` of a masked autoencoder's
    /// `(loss, pred, mask)`, a mixture of experts' auxiliary loss), left out of this loss.
    #[serde(default)]
    pub scalars: Vec<String>,
}

impl LossInputs {
    /// `plan`'s description, naming the heads where there are any, and the scalars beside.
    pub fn describe(&self, plan: impl fmt::Display) -> String {
        let mut text = if self.heads.is_empty() {
            plan.to_string()
        } else {
            format!(
                "{plan}, on {} and the heads trained with it ({}), summed",
                self.selected,
                self.heads.join(", ")
            )
        };
        if !self.scalars.is_empty() {
            // The python engine can tell whether the output flows into such a scalar (then it
            // is the model's loss, or a term of it); TorchScript here cannot.
            let (what, are) = match self.scalars.len() {
                1 => ("the scalar", "is"),
                _ => ("the scalars", "are"),
            };
            text.push_str(&format!(
                " ({what} also returned at {} {are} left out: where one is computed from {} \
                 (a masked autoencoder's loss, a z-loss), the python engine trains on it, for a \
                 notebook variable)",
                self.scalars.join(", "),
                self.selected
            ));
        }
        text
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossError {
    #[error("the model's output has shape {shape:?}: cross-entropy needs class scores in it; pick --loss mse or --loss mean, or use --step with your own step")]
    NoClasses { shape: Vec<i64> },
    #[error("--target-classes {classes} matches no dimension of the output {shape:?} (batch first); give the number of classes the model outputs")]
    ClassesNotInOutput { classes: i64, shape: Vec<i64> },
}

/// The plan for an output of `shape` (batch first).
///
/// - `requested` (`--loss`) wins; `None` infers: cross-entropy when the output looks like class
///   scores, else mean squared error.
/// - An output that holds a float input again, sample for sample (`like_input`: its shape, or
///   flattened) is a reconstruction: an autoencoder's, a denoiser's, a diffusion model's
///   noise. Its loss is mean squared error, though `[batch, 3, H, W]` would also read as three
///   classes per pixel.
/// - Class scores: the last dimension when it is `target_classes` or `vocab`, or the output is
///   `[batch, classes]` / `[batch, seq, classes]`; dimension 1 of `[batch, C, H, W, ...]` (a
///   segmentation map) when C > 1. A last dimension of 1 is a regression.
pub fn plan(
    shape: &[i64],
    requested: Option<LossKind>,
    target_classes: Option<i64>,
    vocab: Option<i64>,
    like_input: bool,
) -> Result<LossPlan, LossError> {
    match requested {
        Some(LossKind::Mse) => return Ok(LossPlan::Mse),
        Some(LossKind::Mean) => return Ok(LossPlan::Mean),
        None if like_input && target_classes.is_none() => return Ok(LossPlan::Mse),
        _ => {}
    }
    let no_classes = || LossError::NoClasses {
        shape: shape.to_vec(),
    };
    let rank = shape.len();
    let last = shape.last().copied().unwrap_or(0);
    if let Some(classes) = target_classes {
        if rank >= 2 && last == classes {
            return Ok(LossPlan::Ce {
                classes,
                class_dim: -1,
            });
        }
        if rank >= 3 && shape[1] == classes {
            return Ok(LossPlan::Ce {
                classes,
                class_dim: 1,
            });
        }
        return Err(LossError::ClassesNotInOutput {
            classes,
            shape: shape.to_vec(),
        });
    }
    let ce = requested == Some(LossKind::Ce);
    let inferred = match rank {
        _ if rank >= 2 && vocab == Some(last) => Some(LossPlan::Ce {
            classes: last,
            class_dim: -1,
        }),
        2 | 3 if last > 1 => Some(LossPlan::Ce {
            classes: last,
            class_dim: -1,
        }),
        r if r >= 4 && shape[1] > 1 => Some(LossPlan::Ce {
            classes: shape[1],
            class_dim: 1,
        }),
        _ => None,
    };
    match inferred {
        Some(plan) => Ok(plan),
        None if ce => Err(no_classes()),
        None if rank == 0 => Ok(LossPlan::Mean),
        None => Ok(LossPlan::Mse),
    }
}

/// The plan an output's shape alone gives, without the reconstruction reading.
fn plan_of(shape: &[i64], vocab: Option<i64>) -> Result<LossPlan, LossError> {
    plan(shape, None, None, vocab, false)
}

/// What to say when [`plan`] had to choose between two readings of the output on its own (no
/// `--loss`, `--target-classes` or vocabulary to go by): a `[batch, x, y]` output is taken as
/// `x` positions of `y` classes, a sequence model's; a 1-d convolution gives `[batch, classes,
/// length]` instead. An output shaped like the input was taken as a reconstruction; a
/// segmentation net with as many classes as input channels gives that shape too.
pub fn alternative(
    shape: &[i64],
    plan: &LossPlan,
    vocab: Option<i64>,
    like_input: bool,
) -> Option<String> {
    match (shape, plan) {
        // Only where the output would have read as classes: `--loss ce` is refused otherwise.
        (_, LossPlan::Mse)
            if like_input
                && matches!(plan_of(shape, vocab), Ok(LossPlan::Ce { .. })) =>
        {
            Some(
                "the output holds as many values as the input, as an autoencoder's or a \
                 denoiser's does; if they are class scores, say --loss ce"
                    .into(),
            )
        }
        // Where x == y, --target-classes x reads the last dimension again: no flag to offer.
        // Where x > y, x classes over a length of y is the unlikely reading: a sequence model
        // labels more positions than it has classes (a CTC head's 399 frames of 30 letters, a
        // tagger's 128 tokens of 9 tags), a 1-d convolution has fewer classes than positions.
        ([_, x, y], LossPlan::Ce { class_dim: -1, .. }) if vocab != Some(*y) && *x > 1 && x < y => Some(
            format!("if dimension 1 holds the classes ([batch, classes, length], as a 1-d convolution gives), say --target-classes {x}"),
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ce(classes: i64, class_dim: i64) -> LossPlan {
        LossPlan::Ce { classes, class_dim }
    }

    #[test]
    fn class_scores_get_cross_entropy() {
        assert_eq!(plan(&[2, 1000], None, None, None, false), Ok(ce(1000, -1)));
        // A language model: [batch, seq, vocab].
        assert_eq!(
            plan(&[2, 512, 32000], None, None, Some(32000), false),
            Ok(ce(32000, -1))
        );
        assert_eq!(
            plan(&[2, 512, 32000], None, None, None, false),
            Ok(ce(32000, -1))
        );
        // A segmentation map: [batch, classes, H, W].
        assert_eq!(
            plan(&[2, 21, 128, 128], None, None, None, false),
            Ok(ce(21, 1))
        );
    }

    #[test]
    fn regressions_get_mse_and_scalars_the_mean() {
        assert_eq!(plan(&[2, 1], None, None, None, false), Ok(LossPlan::Mse));
        assert_eq!(
            plan(&[2, 1, 64, 64], None, None, None, false),
            Ok(LossPlan::Mse)
        );
        assert_eq!(plan(&[2], None, None, None, false), Ok(LossPlan::Mse));
        assert_eq!(plan(&[], None, None, None, false), Ok(LossPlan::Mean));
    }

    #[test]
    fn the_user_decides_first() {
        assert_eq!(
            plan(&[2, 1000], Some(LossKind::Mean), None, None, false),
            Ok(LossPlan::Mean)
        );
        assert_eq!(
            plan(&[2, 1000], Some(LossKind::Mse), None, None, false),
            Ok(LossPlan::Mse)
        );
        // Target classes pick the dimension: here the last, not dimension 1.
        assert_eq!(
            plan(&[2, 10, 10], None, Some(10), None, false),
            Ok(ce(10, -1))
        );
        assert_eq!(
            plan(&[2, 5, 64, 64], None, Some(5), None, false),
            Ok(ce(5, 1))
        );
        assert!(matches!(
            plan(&[2, 5], None, Some(7), None, false),
            Err(LossError::ClassesNotInOutput { classes: 7, .. })
        ));
        let err = plan(&[2, 1], Some(LossKind::Ce), None, None, false).unwrap_err();
        assert!(err.to_string().contains("--loss mse"), "{err}");
    }

    #[test]
    fn a_guess_between_two_readings_says_how_to_take_the_other() {
        let conv1d = [2, 5, 100];
        let guessed = plan(&conv1d, None, None, None, false).unwrap();
        let hint = alternative(&conv1d, &guessed, None, false).unwrap();
        assert!(hint.contains("--target-classes 5"), "{hint}");
        // Token ids into a vocabulary the output ends in: a language model, no guess.
        let lm = [2, 512, 32000];
        let planned = plan(&lm, None, None, Some(32000), false).unwrap();
        assert_eq!(alternative(&lm, &planned, Some(32000), false), None);
        // Dimension 1 taken, or no classes at all: nothing to add.
        assert_eq!(alternative(&[2, 5, 64, 64], &ce(5, 1), None, false), None);
        assert_eq!(alternative(&[2, 1000], &ce(1000, -1), None, false), None);
        assert_eq!(alternative(&[2, 5, 5], &ce(5, -1), None, false), None);
        // More positions than classes: a sequence model's output, read as such.
        assert_eq!(alternative(&[2, 399, 30], &ce(30, -1), None, false), None);
    }

    #[test]
    fn an_output_shaped_like_its_float_input_is_a_reconstruction() {
        // A denoiser or an autoencoder on RGB images: not three classes per pixel.
        let image = [2, 3, 64, 64];
        let planned = plan(&image, None, None, None, true).unwrap();
        assert_eq!(planned, LossPlan::Mse);
        let hint = alternative(&image, &planned, None, true).unwrap();
        assert!(hint.contains("--loss ce"), "{hint}");
        // An MLP autoencoder: not 784 classes.
        assert_eq!(plan(&[2, 784], None, None, None, true), Ok(LossPlan::Mse));
        // The user's word wins: a segmentation net with as many classes as input channels.
        assert_eq!(
            plan(&image, Some(LossKind::Ce), None, None, true),
            Ok(ce(3, 1))
        );
        assert_eq!(plan(&image, None, Some(3), None, true), Ok(ce(3, 1)));
        // Shaped otherwise, the output's own reading stands.
        assert_eq!(
            plan(&[2, 21, 64, 64], None, None, None, false),
            Ok(ce(21, 1))
        );
        assert_eq!(alternative(&[2, 1], &LossPlan::Mse, None, false), None);
        // A grayscale denoiser's [2, 1, H, W], or Linear(1, 1): mean squared error either
        // way, and --loss ce would be refused: no other reading to offer.
        assert_eq!(alternative(&[2, 1, 8, 8], &LossPlan::Mse, None, true), None);
        assert_eq!(alternative(&[2, 1], &LossPlan::Mse, None, true), None);
    }

    #[test]
    fn a_scalar_beside_the_output_is_said_to_be_left_out() {
        let mut inputs = LossInputs {
            selected: "output[1]".into(),
            ..LossInputs::default()
        };
        assert_eq!(inputs.describe(LossPlan::Mse), LossPlan::Mse.to_string());
        inputs.scalars = vec!["output[0]".into()];
        assert_eq!(
            inputs.describe(LossPlan::Mse),
            "mean squared error against a random target (the scalar also returned at output[0] \
             is left out: where one is computed from output[1] (a masked autoencoder's loss, a \
             z-loss), the python engine trains on it, for a notebook variable)"
        );
        inputs.scalars.push("output[3]".into());
        assert!(inputs
            .describe(LossPlan::Mse)
            .contains("(the scalars also returned at output[0], output[3] are left out:"));
    }

    #[test]
    fn the_plan_says_what_it_computes() {
        assert_eq!(
            ce(32000, -1).to_string(),
            "cross-entropy over the last dimension (32000 classes)"
        );
        assert!(ce(21, 1).to_string().contains("per position"));
    }
}
