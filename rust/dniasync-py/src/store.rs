//! `dniasync._core.ParamStore`.
use crate::arrays::{readonly, readwrite, slice};
use crate::errors::{run, to_py, BLOCKING};
use dniasync_core::{
    Dense, GradSource, Layout, NonFinitePolicy, Optimizer, OptimizerConfig,
    ParamStore as CoreStore, SegmentSpec,
};
use numpy::ndarray::ArrayView1;
use numpy::{PyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Flat f32 parameters in named, versioned segments, updated in place without locks.
#[pyclass(frozen, module = "dniasync._core")]
pub struct ParamStore {
    pub(crate) inner: CoreStore,
}

fn optimizer_config(
    optimizer: &str,
    momentum: f32,
    betas: (f32, f32),
    eps: Option<f32>,
    weight_decay: f32,
    clip_norm: Option<f32>,
) -> PyResult<OptimizerConfig> {
    let optimizer = match optimizer {
        "sgd" => Optimizer::Sgd,
        "momentum" => Optimizer::Momentum { momentum },
        "nesterov" => Optimizer::Nesterov { momentum },
        "adagrad" => Optimizer::Adagrad {
            eps: eps.unwrap_or(1e-10),
        },
        "adam" => Optimizer::Adam {
            beta1: betas.0,
            beta2: betas.1,
            eps: eps.unwrap_or(1e-8),
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown optimizer {other:?}: expected sgd, momentum, nesterov, adagrad or adam"
            )))
        }
    };
    Ok(OptimizerConfig {
        optimizer,
        weight_decay,
        clip_norm,
    })
}

fn specs(segments: Vec<(String, usize)>) -> Vec<SegmentSpec> {
    segments
        .into_iter()
        .map(|(name, len)| SegmentSpec::new(name, len))
        .collect()
}

fn policy(name: &str) -> PyResult<NonFinitePolicy> {
    match name {
        "reject" => Ok(NonFinitePolicy::Reject),
        "allow" => Ok(NonFinitePolicy::Allow),
        other => Err(PyValueError::new_err(format!(
            "unknown non-finite policy {other:?}: expected 'reject' or 'allow'"
        ))),
    }
}

/// What a gradient source does to a segment.
#[derive(Clone, Copy)]
pub(crate) enum Update {
    /// One optimizer step with this learning rate.
    Step(f32),
    /// Hogwild `w += alpha * g`.
    Add(f32),
    /// `w += alpha * g` by compare-and-swap.
    AddExact(f32),
}

impl ParamStore {
    pub(crate) fn seg(&self, name: &str) -> PyResult<usize> {
        self.inner.segment_index(name).map_err(to_py)
    }

    /// Apply `update` to `segment` with the gradient `source` builds, detached from the
    /// interpreter when `work` elements make that worth it; returns the new version.
    pub(crate) fn update<G: GradSource>(
        &self,
        py: Python<'_>,
        segment: &str,
        work: usize,
        update: Update,
        source: impl FnOnce() -> dniasync_core::Result<G> + Send,
    ) -> PyResult<u64> {
        let seg = self.seg(segment)?;
        run(py, work, || {
            let mut grad = source()?;
            match update {
                Update::Step(lr) => self.inner.step(seg, &mut grad, lr),
                Update::Add(alpha) => self.inner.add(seg, &mut grad, alpha),
                Update::AddExact(alpha) => self.inner.add_exact(seg, &mut grad, alpha),
            }
        })
    }
}

#[pymethods]
impl ParamStore {
    #[new]
    #[pyo3(signature = (segments, optimizer = "sgd", *, momentum = 0.9, beta1 = 0.9, beta2 = 0.999,
        eps = None, weight_decay = 0.0, clip_norm = None, shm_name = None, nonfinite = "reject"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        segments: Vec<(String, usize)>,
        optimizer: &str,
        momentum: f32,
        beta1: f32,
        beta2: f32,
        eps: Option<f32>,
        weight_decay: f32,
        clip_norm: Option<f32>,
        shm_name: Option<String>,
        nonfinite: &str,
    ) -> PyResult<Self> {
        let config = optimizer_config(
            optimizer,
            momentum,
            (beta1, beta2),
            eps,
            weight_decay,
            clip_norm,
        )?;
        let layout = Layout::new(specs(segments), config);
        let policy = policy(nonfinite)?;
        let inner = run(py, BLOCKING, move || match shm_name {
            Some(name) => CoreStore::create_shared(&name, layout),
            None => CoreStore::new(layout),
        })?;
        inner.set_nonfinite_policy(policy);
        Ok(ParamStore { inner })
    }

    /// Maps the shared store `shm_name`; checks segments and optimizer when given.
    #[staticmethod]
    #[pyo3(signature = (shm_name, segments = None, optimizer = None, *, momentum = 0.9,
        beta1 = 0.9, beta2 = 0.999, eps = None, weight_decay = 0.0, clip_norm = None, nonfinite = "reject"))]
    #[allow(clippy::too_many_arguments)]
    fn attach(
        py: Python<'_>,
        shm_name: String,
        segments: Option<Vec<(String, usize)>>,
        optimizer: Option<&str>,
        momentum: f32,
        beta1: f32,
        beta2: f32,
        eps: Option<f32>,
        weight_decay: f32,
        clip_norm: Option<f32>,
        nonfinite: &str,
    ) -> PyResult<Self> {
        let config = optimizer
            .map(|o| optimizer_config(o, momentum, (beta1, beta2), eps, weight_decay, clip_norm))
            .transpose()?;
        let segments = segments.map(specs);
        let policy = policy(nonfinite)?;
        let inner = run(py, BLOCKING, move || {
            CoreStore::attach_expecting(&shm_name, segments.as_deref(), config.as_ref())
        })?;
        inner.set_nonfinite_policy(policy);
        Ok(ParamStore { inner })
    }

    /// True when the shared store exists and the process that created it is gone.
    #[staticmethod]
    fn is_stale(shm_name: &str) -> PyResult<bool> {
        CoreStore::is_stale(shm_name).map_err(to_py)
    }

    /// Removes the shared store if it is stale; returns whether it did.
    #[staticmethod]
    fn remove_stale(shm_name: &str) -> PyResult<bool> {
        CoreStore::remove_stale(shm_name).map_err(to_py)
    }

    /// (name, offset, length) of every segment, in order.
    #[getter]
    fn segments(&self) -> Vec<(String, usize, usize)> {
        self.inner
            .segments()
            .iter()
            .map(|s| (s.name.clone(), s.offset, s.len))
            .collect()
    }

    #[getter]
    fn optimizer(&self) -> &'static str {
        self.inner.config().optimizer.name()
    }

    /// Optimizer state arrays kept per parameter (0 for SGD, 1 for momentum/Adagrad, 2 for Adam).
    #[getter]
    fn state_slots(&self) -> usize {
        self.inner.config().optimizer.state_slots()
    }

    #[getter]
    fn shm_name(&self) -> Option<String> {
        self.inner.shm_path().and_then(|p| {
            p.file_name()?
                .to_str()?
                .strip_prefix(dniasync_core::shm::SHM_PREFIX)
                .map(str::to_owned)
        })
    }

    #[getter]
    fn is_owner(&self) -> bool {
        self.inner.is_owner()
    }

    #[getter]
    fn nonfinite_policy(&self) -> &'static str {
        match self.inner.nonfinite_policy() {
            NonFinitePolicy::Reject => "reject",
            NonFinitePolicy::Allow => "allow",
        }
    }

    /// 'reject' (default: refuse and count gradients with NaN/Inf) or 'allow'.
    fn set_nonfinite_policy(&self, policy_name: &str) -> PyResult<()> {
        self.inner.set_nonfinite_policy(policy(policy_name)?);
        Ok(())
    }

    /// Updates rejected for NaN/Inf so far, by every process sharing the store.
    #[getter]
    fn rejected_nonfinite(&self) -> u64 {
        self.inner.rejected_nonfinite()
    }

    fn __len__(&self) -> usize {
        self.inner.n_params()
    }

    fn version(&self, segment: &str) -> PyResult<u64> {
        self.inner.version(self.seg(segment)?).map_err(to_py)
    }

    fn steps(&self, segment: &str) -> PyResult<u64> {
        self.inner.steps(self.seg(segment)?).map_err(to_py)
    }

    fn set_steps(&self, segment: &str, steps: u64) -> PyResult<()> {
        self.inner
            .set_steps(self.seg(segment)?, steps)
            .map_err(to_py)
    }

    /// Zero-copy float32 view of a segment (or all parameters), slot 0 = parameters.
    #[pyo3(signature = (segment = None, state = 0))]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        segment: Option<&str>,
        state: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let this = slf.get();
        let base = this.inner.slot_ptr(state).map_err(to_py)?;
        let (offset, len) = match segment {
            Some(name) => {
                let s = &this.inner.segments()[this.seg(name)?];
                (s.offset, s.len)
            }
            None => (0, this.inner.n_params()),
        };
        // SAFETY: the cells live as long as the store object, which the array keeps as its
        // base; f32 has the layout of the atomic cells.
        unsafe {
            let view = ArrayView1::from_shape_ptr(len, base.add(offset).cast_const());
            Ok(PyArray1::borrow_from_array(&view, slf.clone().into_any()))
        }
    }

    /// Copies a segment into `out` (float32, contiguous); returns the version read.
    #[pyo3(signature = (segment, out, state = 0))]
    fn read_into(
        &self,
        py: Python<'_>,
        segment: &str,
        out: &Bound<'_, PyAny>,
        state: usize,
    ) -> PyResult<u64> {
        let seg = self.seg(segment)?;
        let mut out = readwrite::<f32>(out, "out")?;
        let out = out.as_slice_mut().expect("contiguity checked");
        run(py, out.len(), || self.inner.read_into(seg, state, out))
    }

    /// Overwrites a segment (or a state slot) with `values`; returns the new version.
    #[pyo3(signature = (segment, values, state = 0))]
    fn write(
        &self,
        py: Python<'_>,
        segment: &str,
        values: &Bound<'_, PyAny>,
        state: usize,
    ) -> PyResult<u64> {
        let seg = self.seg(segment)?;
        let values = readonly::<f32>(values, "values")?;
        let values = slice(&values);
        run(py, values.len(), || self.inner.write(seg, state, values))
    }

    /// One optimizer step with `grad` and learning rate `lr`; returns the new version.
    fn step(
        &self,
        py: Python<'_>,
        segment: &str,
        grad: &Bound<'_, PyAny>,
        lr: f32,
    ) -> PyResult<u64> {
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        self.update(py, segment, grad.len(), Update::Step(lr), || {
            Ok(Dense(grad))
        })
    }

    /// `step`, the parameters left as they are: `out` (float32, contiguous, the segment's
    /// length) receives the change the step would make to each, and the optimizer state
    /// advances; returns the version, unchanged.
    fn step_into(
        &self,
        py: Python<'_>,
        segment: &str,
        grad: &Bound<'_, PyAny>,
        lr: f32,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let seg = self.seg(segment)?;
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        let mut out = readwrite::<f32>(out, "out")?;
        let out = out.as_slice_mut().expect("contiguity checked");
        run(py, grad.len(), || {
            self.inner.step_into(seg, &mut Dense(grad), lr, out)
        })
    }

    /// One step with `values` over `spans` ((start, length) uint32 pairs, `[k, 2]`) and zero elsewhere.
    fn step_spans(
        &self,
        py: Python<'_>,
        segment: &str,
        spans: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        lr: f32,
    ) -> PyResult<u64> {
        let spans = readonly::<u32>(spans, "spans")?;
        if spans.ndim() != 2 || spans.shape()[1] != 2 {
            return Err(PyValueError::new_err(format!(
                "spans must be a [k, 2] array of (start, length), got shape {:?}",
                spans.shape()
            )));
        }
        let values = readonly::<f32>(values, "values")?;
        let (spans, values) = (slice(&spans), slice(&values));
        let seg = self.seg(segment)?;
        run(py, values.len(), || {
            self.inner.step_spans(seg, spans, values, lr)
        })
    }

    /// Hogwild `w += alpha * delta`: concurrent adds to one element may overwrite each other.
    #[pyo3(signature = (segment, delta, alpha = 1.0))]
    fn add(
        &self,
        py: Python<'_>,
        segment: &str,
        delta: &Bound<'_, PyAny>,
        alpha: f32,
    ) -> PyResult<u64> {
        let delta = readonly::<f32>(delta, "delta")?;
        let delta = slice(&delta);
        self.update(py, segment, delta.len(), Update::Add(alpha), || {
            Ok(Dense(delta))
        })
    }

    /// Exact `w += alpha * delta` by compare-and-swap: concurrent exact adds all land.
    #[pyo3(signature = (segment, delta, alpha = 1.0))]
    fn add_exact(
        &self,
        py: Python<'_>,
        segment: &str,
        delta: &Bound<'_, PyAny>,
        alpha: f32,
    ) -> PyResult<u64> {
        let delta = readonly::<f32>(delta, "delta")?;
        let delta = slice(&delta);
        self.update(py, segment, delta.len(), Update::AddExact(alpha), || {
            Ok(Dense(delta))
        })
    }

    /// Removes the shared-memory name if this process created it; views stay valid.
    fn close(&self) -> PyResult<()> {
        self.inner.close().map_err(to_py)
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close()?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "ParamStore({} params in {} segments, optimizer={:?}, shm_name={:?})",
            self.inner.n_params(),
            self.inner.segments().len(),
            self.optimizer(),
            self.shm_name()
        )
    }
}
