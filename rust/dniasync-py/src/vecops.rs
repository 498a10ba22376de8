//! `dniasync._core.vec_*`: the float64 kernels a Sandblaster PS shard runs on its slice.
use crate::arrays::{readonly, readwrite, slice};
use crate::errors::run;
use dniasync_core::vecops;
use numpy::PyReadonlyArrayDyn;
use pyo3::prelude::*;

fn borrow_all<'py>(
    arrays: &[Bound<'py, PyAny>],
    what: &str,
) -> PyResult<Vec<PyReadonlyArrayDyn<'py, f64>>> {
    arrays.iter().map(|a| readonly::<f64>(a, what)).collect()
}

/// `a · b`.
#[pyfunction]
pub fn vec_dot(py: Python<'_>, a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<f64> {
    let a = readonly::<f64>(a, "a")?;
    let b = readonly::<f64>(b, "b")?;
    let (a, b) = (slice(&a), slice(&b));
    run(py, a.len(), || vecops::dot(a, b))
}

/// `[a[i] · b[i] for i]`, all with the GIL released once.
#[pyfunction]
pub fn vec_dots(
    py: Python<'_>,
    a: Vec<Bound<'_, PyAny>>,
    b: Vec<Bound<'_, PyAny>>,
) -> PyResult<Vec<f64>> {
    if a.len() != b.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "b: expected {} arrays, got {}",
            a.len(),
            b.len()
        )));
    }
    let a = borrow_all(&a, "a")?;
    let b = borrow_all(&b, "b")?;
    let a: Vec<&[f64]> = a.iter().map(slice).collect();
    let b: Vec<&[f64]> = b.iter().map(slice).collect();
    let elems = a.iter().map(|v| v.len()).sum();
    run(py, elems, || {
        a.iter()
            .zip(&b)
            .map(|(x, y)| vecops::dot(x, y))
            .collect::<dniasync_core::Result<Vec<f64>>>()
    })
}

/// `y += alpha · x`, in place.
#[pyfunction]
pub fn vec_axpy(
    py: Python<'_>,
    alpha: f64,
    x: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = readonly::<f64>(x, "x")?;
    let x = slice(&x);
    let mut y = readwrite::<f64>(y, "y")?;
    let y = y.as_slice_mut().expect("contiguity checked");
    run(py, y.len(), || vecops::axpy(alpha, x, y))
}

/// `x *= alpha`, in place.
#[pyfunction]
pub fn vec_scale(py: Python<'_>, alpha: f64, x: &Bound<'_, PyAny>) -> PyResult<()> {
    let mut x = readwrite::<f64>(x, "x")?;
    let x = x.as_slice_mut().expect("contiguity checked");
    run(py, x.len(), || {
        vecops::scale(alpha, x);
        Ok(())
    })
}

/// `out = x + alpha · y` (``out`` must not be ``x`` or ``y``).
#[pyfunction]
pub fn vec_add_scaled(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    alpha: f64,
    y: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = readonly::<f64>(x, "x")?;
    let y = readonly::<f64>(y, "y")?;
    let (x, y) = (slice(&x), slice(&y));
    let mut out = readwrite::<f64>(out, "out")?;
    let out = out.as_slice_mut().expect("contiguity checked");
    run(py, out.len(), || vecops::add_scaled(out, x, alpha, y))
}

/// `out = Σ coeffs[i] · vectors[i]`, summed in the order given.
#[pyfunction]
pub fn vec_lincomb(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    coeffs: Vec<f64>,
    vectors: Vec<Bound<'_, PyAny>>,
) -> PyResult<()> {
    let vectors = borrow_all(&vectors, "vectors")?;
    let vectors: Vec<&[f64]> = vectors.iter().map(slice).collect();
    let mut out = readwrite::<f64>(out, "out")?;
    let out = out.as_slice_mut().expect("contiguity checked");
    let elems = out.len() * vectors.len().max(1);
    run(py, elems, || vecops::lincomb(out, &coeffs, &vectors))
}

/// `(Σ |x_i|, max |x_i|)` (NaN max if any element is NaN).
#[pyfunction]
pub fn vec_abs_sum_max(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<(f64, f64)> {
    let x = readonly::<f64>(x, "x")?;
    let x = slice(&x);
    run(py, x.len(), || Ok(vecops::abs_sum_max(x)))
}
