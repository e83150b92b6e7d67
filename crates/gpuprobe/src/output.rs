//! What a loss is computed on when a TorchScript model returns more than one tensor.
//!
//! The same rules as the python engine's `_select_output` and `_heads` (gpukernel's
//! `maxbatch/trials.py`), so that both engines train the same loss on the same model: the
//! output itself if it is a tensor; else a dict's `'logits'`; else the first floating-point
//! tensor that is not a scalar (a model returning `(aux_loss, logits)` puts a loss first).
//! The other floating-point tensors shaped like it are auxiliary heads (torchvision's
//! segmentation `{'out', 'aux'}`, Inception's `aux_logits`), which a user's loss trains too;
//! so are a dense map's copies at other resolutions (deep supervision: `[batch, classes, H/2,
//! W/2]`).

use tch::{IValue, Tensor};

/// A forward pass's output as the loss sees it. Holds every tensor of the output, so keeping
/// it keeps the whole output alive, as `out = model(x)` in a loop does.
#[derive(Debug)]
pub struct Output {
    /// The tensor the loss is computed on.
    pub main: Tensor,
    /// How `main` was found: `output`, `output['out']`, `output[1]`.
    pub selected: String,
    /// Auxiliary heads shaped like `main`, with where each was found.
    pub heads: Vec<(String, Tensor)>,
    /// Where the output holds floating-point scalars besides (a loss it computed itself).
    pub scalars: Vec<String>,
    /// The output's other tensors (a KV cache, attention maps): kept alive, not in the loss.
    rest: Vec<Tensor>,
}

/// The output holds no floating-point tensor to compute a loss on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the model returned {what} with no floating-point tensor to compute a loss on; use the \
     python engine with --step FN and your own step"
)]
pub struct NoLossTensor {
    what: String,
}

impl Output {
    /// A plain tensor output.
    pub fn single(main: Tensor) -> Self {
        Output {
            main,
            selected: "output".into(),
            heads: Vec::new(),
            scalars: Vec::new(),
            rest: Vec::new(),
        }
    }

    /// Another handle on the same tensors (no copy).
    pub fn shallow_clone(&self) -> Self {
        Output {
            main: self.main.shallow_clone(),
            selected: self.selected.clone(),
            heads: self
                .heads
                .iter()
                .map(|(w, t)| (w.clone(), t.shallow_clone()))
                .collect(),
            scalars: self.scalars.clone(),
            rest: self.rest.iter().map(Tensor::shallow_clone).collect(),
        }
    }

    /// Selects the loss's tensor and heads from what `forward` returned.
    pub fn select(value: IValue) -> Result<Self, NoLossTensor> {
        let what = describe(&value);
        let items = match value {
            IValue::Tensor(t) => return Ok(Output::single(t)),
            IValue::GenericDict(entries) => entries
                .into_iter()
                .filter_map(|(key, value)| match value {
                    IValue::Tensor(t) => Some((format!("output[{}]", key_text(&key)), t)),
                    _ => None,
                })
                .collect(),
            IValue::Tuple(values) | IValue::GenericList(values) => values
                .into_iter()
                .enumerate()
                .filter_map(|(i, value)| match value {
                    IValue::Tensor(t) => Some((format!("output[{i}]"), t)),
                    _ => None,
                })
                .collect(),
            IValue::TensorList(tensors) => tensors
                .into_iter()
                .enumerate()
                .map(|(i, t)| (format!("output[{i}]"), t))
                .collect(),
            _ => Vec::new(),
        };
        Self::from_items(items).ok_or(NoLossTensor { what })
    }

    fn from_items(mut items: Vec<(String, Tensor)>) -> Option<Self> {
        let floating = |t: &Tensor| t.is_floating_point();
        let index = items
            .iter()
            .position(|(w, t)| w == "output['logits']" && floating(t))
            .or_else(|| items.iter().position(|(_, t)| floating(t) && t.dim() > 0))
            .or_else(|| items.iter().position(|(_, t)| floating(t)))?;
        let (selected, main) = items.remove(index);
        let mut heads = Vec::new();
        let mut scalars = Vec::new();
        let mut rest = Vec::new();
        for (at, t) in items {
            if floating(&t) && t.dim() == 0 {
                scalars.push(at);
                rest.push(t);
            } else if floating(&t) && t.size() == main.size() {
                heads.push((at, t));
            } else if floating(&t) && rescaled(&t.size(), &main.size()) {
                let size: Vec<String> = t.size()[2..].iter().map(i64::to_string).collect();
                heads.push((format!("{at} at {}", size.join("x")), t));
            } else {
                rest.push(t);
            }
        }
        Some(Output {
            main,
            selected,
            heads,
            scalars,
            rest,
        })
    }

    /// Where the heads were found, for the report.
    pub fn head_names(&self) -> Vec<String> {
        self.heads.iter().map(|(w, _)| w.clone()).collect()
    }
}

/// Whether `size` is the dense map `main` (`[batch, classes, *spatial]`) at another
/// resolution: a deep-supervised net's coarser outputs (nnU-Net's, UNet++'s), trained too.
fn rescaled(size: &[i64], main: &[i64]) -> bool {
    size.len() == main.len() && size.len() >= 4 && size[..2] == main[..2] && size[2..] != main[2..]
}

/// A dict key as Python writes it in a subscript: `'out'`, `3`.
fn key_text(key: &IValue) -> String {
    match key {
        IValue::String(s) => format!("'{s}'"),
        IValue::Int(i) => i.to_string(),
        other => describe(other),
    }
}

fn describe(value: &IValue) -> String {
    match value {
        IValue::GenericDict(_) => "a dict".into(),
        IValue::Tuple(_) => "a tuple".into(),
        IValue::GenericList(_) | IValue::TensorList(_) => "a list".into(),
        IValue::None => "None".into(),
        IValue::Int(_) | IValue::Double(_) | IValue::Bool(_) => "a number".into(),
        IValue::String(_) => "a string".into(),
        _ => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn t(shape: &[i64]) -> Tensor {
        Tensor::zeros(shape, (Kind::Float, Device::Cpu))
    }

    fn key(s: &str) -> IValue {
        IValue::String(s.into())
    }

    #[test]
    fn a_tensor_is_its_own_loss_input() {
        let out = Output::select(IValue::Tensor(t(&[2, 5]))).expect("a tensor");
        assert_eq!(out.selected, "output");
        assert!(out.heads.is_empty());
    }

    #[test]
    fn a_segmentation_dicts_aux_head_is_a_head_and_logits_win_in_a_dict() {
        let seg = IValue::GenericDict(vec![
            (key("out"), IValue::Tensor(t(&[2, 21, 8, 8]))),
            (key("aux"), IValue::Tensor(t(&[2, 21, 8, 8]))),
        ]);
        let out = Output::select(seg).expect("a dict of tensors");
        assert_eq!(out.selected, "output['out']");
        assert_eq!(out.head_names(), vec!["output['aux']".to_string()]);
        let hf = IValue::GenericDict(vec![
            (key("loss"), IValue::Tensor(t(&[]))),
            (key("hidden"), IValue::Tensor(t(&[2, 7]))),
            (key("logits"), IValue::Tensor(t(&[2, 7, 50]))),
        ]);
        let out = Output::select(hf).expect("a dict with logits");
        assert_eq!(out.selected, "output['logits']");
        assert!(out.heads.is_empty(), "{:?}", out.head_names());
    }

    #[test]
    fn a_scalar_first_is_passed_over_and_integer_tensors_are_not_heads() {
        let tuple = IValue::Tuple(vec![
            IValue::Tensor(t(&[])),
            IValue::Tensor(t(&[2, 10])),
            IValue::Tensor(Tensor::zeros([2, 10], (Kind::Int64, Device::Cpu))),
            IValue::Tensor(t(&[2, 10])),
            IValue::Int(3),
        ]);
        let out = Output::select(tuple).expect("a tuple");
        assert_eq!(out.selected, "output[1]");
        assert_eq!(out.head_names(), vec!["output[3]".to_string()]);
        assert_eq!(
            out.rest.len(),
            2,
            "the scalar and the ids stay alive with the output"
        );
        // The scalar is named, for the report: it may be the model's own loss.
        assert_eq!(out.scalars, vec!["output[0]".to_string()]);
    }

    #[test]
    fn a_deep_supervised_nets_coarser_maps_are_heads_named_with_their_size() {
        // nnU-Net's list: the map at full resolution, then at half and a quarter of it.
        let maps = IValue::GenericList(vec![
            IValue::Tensor(t(&[2, 3, 32, 32])),
            IValue::Tensor(t(&[2, 3, 16, 16])),
            IValue::Tensor(t(&[2, 3, 8, 8])),
            // Features of another width are no head, nor is another batch's map.
            IValue::Tensor(t(&[2, 64, 16, 16])),
            IValue::Tensor(t(&[1, 3, 16, 16])),
        ]);
        let out = Output::select(maps).expect("a list of maps");
        assert_eq!(out.selected, "output[0]");
        assert_eq!(
            out.head_names(),
            vec![
                "output[1] at 16x16".to_string(),
                "output[2] at 8x8".to_string()
            ]
        );
        assert_eq!(out.rest.len(), 2);
        // Class scores of two samples are no dense map: their other tensors stay out.
        let pair = IValue::Tuple(vec![
            IValue::Tensor(t(&[2, 10])),
            IValue::Tensor(t(&[2, 5])),
        ]);
        assert!(Output::select(pair).expect("a pair").heads.is_empty());
    }

    #[test]
    fn nothing_to_compute_a_loss_on_is_explained() {
        let ids = IValue::Tuple(vec![IValue::Tensor(Tensor::zeros(
            [2],
            (Kind::Int64, Device::Cpu),
        ))]);
        let err = Output::select(ids).unwrap_err().to_string();
        assert!(
            err.starts_with("the model returned a tuple with no floating-point"),
            "{err}"
        );
        let err = Output::select(IValue::Int(1)).unwrap_err().to_string();
        assert!(err.contains("returned a number with no"), "{err}");
    }
}
