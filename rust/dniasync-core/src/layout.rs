//! What a store holds: its named segments and its optimizer configuration.
use crate::error::{invalid, Result};

/// Longest segment name, in bytes (it is stored in a fixed-size header slot).
pub const MAX_SEGMENT_NAME: usize = 47;

/// A named range of parameters (one tensor, or one PS shard).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSpec {
    pub name: String,
    pub len: usize,
}

impl SegmentSpec {
    pub fn new(name: impl Into<String>, len: usize) -> Self {
        SegmentSpec {
            name: name.into(),
            len,
        }
    }
}

/// The update rule; hyper-parameters are fixed per store, the learning rate is given per call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// `w -= lr * g`
    Sgd,
    /// Heavy ball, as `torch.optim.SGD(momentum=m)`: `v = m v + g; w -= lr v`.
    Momentum { momentum: f32 },
    /// As `torch.optim.SGD(momentum=m, nesterov=True)`: `v = m v + g; w -= lr (g + m v)`.
    Nesterov { momentum: f32 },
    /// As `torch.optim.Adagrad`: `s += g²; w -= lr g / (√s + eps)`.
    Adagrad { eps: f32 },
    /// As `torch.optim.Adam` (L2 weight decay, bias correction by a per-segment step count).
    Adam { beta1: f32, beta2: f32, eps: f32 },
}

impl Optimizer {
    /// Per-element state slots kept in the store after the parameters.
    pub fn state_slots(&self) -> usize {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::Momentum { .. } | Optimizer::Nesterov { .. } | Optimizer::Adagrad { .. } => {
                1
            }
            Optimizer::Adam { .. } => 2,
        }
    }

    /// Short lowercase name, as the Python API spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd => "sgd",
            Optimizer::Momentum { .. } => "momentum",
            Optimizer::Nesterov { .. } => "nesterov",
            Optimizer::Adagrad { .. } => "adagrad",
            Optimizer::Adam { .. } => "adam",
        }
    }

    pub(crate) fn encode(&self) -> (u32, [f32; 3]) {
        match *self {
            Optimizer::Sgd => (0, [0.0; 3]),
            Optimizer::Momentum { momentum } => (1, [momentum, 0.0, 0.0]),
            Optimizer::Nesterov { momentum } => (2, [momentum, 0.0, 0.0]),
            Optimizer::Adagrad { eps } => (3, [eps, 0.0, 0.0]),
            Optimizer::Adam { beta1, beta2, eps } => (4, [beta1, beta2, eps]),
        }
    }

    pub(crate) fn decode(code: u32, p: [f32; 3]) -> Option<Self> {
        Some(match code {
            0 => Optimizer::Sgd,
            1 => Optimizer::Momentum { momentum: p[0] },
            2 => Optimizer::Nesterov { momentum: p[0] },
            3 => Optimizer::Adagrad { eps: p[0] },
            4 => Optimizer::Adam {
                beta1: p[0],
                beta2: p[1],
                eps: p[2],
            },
            _ => return None,
        })
    }
}

/// Optimizer plus the transformations applied to every gradient before it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    pub optimizer: Optimizer,
    /// L2 weight decay added to the gradient: `g += weight_decay * w`.
    pub weight_decay: f32,
    /// Scale each update's gradient so its L2 norm is at most this (as `clip_grad_norm_`).
    pub clip_norm: Option<f32>,
}

impl OptimizerConfig {
    pub fn new(optimizer: Optimizer) -> Self {
        OptimizerConfig {
            optimizer,
            weight_decay: 0.0,
            clip_norm: None,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let unit = |name: &str, v: f32| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(invalid(format!("{name} must be in [0, 1), got {v}")))
            }
        };
        let positive = |name: &str, v: f32| {
            if v > 0.0 && v.is_finite() {
                Ok(())
            } else {
                Err(invalid(format!(
                    "{name} must be positive and finite, got {v}"
                )))
            }
        };
        match self.optimizer {
            Optimizer::Sgd => {}
            Optimizer::Momentum { momentum } | Optimizer::Nesterov { momentum } => {
                unit("momentum", momentum)?
            }
            Optimizer::Adagrad { eps } => positive("eps", eps)?,
            Optimizer::Adam { beta1, beta2, eps } => {
                unit("beta1", beta1)?;
                unit("beta2", beta2)?;
                positive("eps", eps)?;
            }
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(invalid(format!(
                "weight_decay must be >= 0 and finite, got {}",
                self.weight_decay
            )));
        }
        if let Some(c) = self.clip_norm {
            positive("clip_norm", c)?;
        }
        Ok(())
    }
}

/// Everything that fixes a store's memory layout; two processes sharing a store must agree on it.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub segments: Vec<SegmentSpec>,
    pub config: OptimizerConfig,
}

impl Layout {
    pub fn new(segments: Vec<SegmentSpec>, config: OptimizerConfig) -> Self {
        Layout { segments, config }
    }

    /// Total number of parameters over all segments.
    pub fn n_params(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.segments.is_empty() {
            return Err(invalid("a store needs at least one segment"));
        }
        let mut seen = std::collections::HashSet::new();
        for s in &self.segments {
            if s.name.is_empty() || s.name.len() > MAX_SEGMENT_NAME {
                return Err(invalid(format!(
                    "segment name {:?} must be 1..={MAX_SEGMENT_NAME} bytes",
                    s.name
                )));
            }
            if !seen.insert(s.name.as_str()) {
                return Err(invalid(format!("duplicate segment name {:?}", s.name)));
            }
        }
        if self.n_params() >= 1 << 31 {
            return Err(invalid("a store holds fewer than 2^31 parameters"));
        }
        self.config.validate()
    }
}
