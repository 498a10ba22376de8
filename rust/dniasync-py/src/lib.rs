//! `dniasync._core`: thin PyO3 bindings over `dniasync-core`. Each exported type lives
//! in its own file; every call touching more than a few KB releases the GIL (`errors::run`).
use pyo3::prelude::*;

mod arrays;
mod codec;
mod errors;
mod int8;
mod onebit;
mod store;
mod threshold;

/// Instruction set the kernels run with on this machine: "avx512", "avx2" or "base".
#[pyfunction]
fn kernel_isa() -> &'static str {
    match dniasync_core::detected_isa() {
        dniasync_core::Isa::Avx512 => "avx512",
        dniasync_core::Isa::Avx2 => "avx2",
        dniasync_core::Isa::Base => "base",
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", dniasync_core::VERSION)?;
    m.add_function(wrap_pyfunction!(kernel_isa, m)?)?;
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
