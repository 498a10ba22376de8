//! `dniasync._core`: thin PyO3 bindings over `dniasync-core`. Each exported type lives
//! in its own file; every call touching more than a few KB releases the GIL (`errors::run`).
use pyo3::prelude::*;

mod arrays;
mod errors;
mod int8;
mod onebit;
mod store;
mod threshold;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", dniasync_core::VERSION)?;
    m.add_class::<store::ParamStore>()?;
    m.add_class::<threshold::ThresholdCodec>()?;
    m.add_class::<onebit::OneBitCodec>()?;
    m.add_class::<int8::Int8Codec>()?;
    m.add(
        "NonFiniteGradientError",
        py.get_type::<errors::NonFiniteGradientError>(),
    )?;
    m.add(
        "LayoutMismatchError",
        py.get_type::<errors::LayoutMismatchError>(),
    )?;
    Ok(())
}
