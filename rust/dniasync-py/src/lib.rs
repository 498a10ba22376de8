//! `dniasync._core`: thin PyO3 bindings over `dniasync-core`.
use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", dniasync_core::VERSION)?;
    Ok(())
}
