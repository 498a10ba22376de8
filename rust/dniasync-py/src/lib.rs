//! `dniasync._core`: thin PyO3 bindings over `dniasync-core`. Each exported type lives
//! in its own file; every call touching more than a few KB releases the GIL (`errors::run`).
use dniasync_core::Isa;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod arrays;
mod codec;
mod errors;
mod int8;
mod onebit;
mod rows;
mod store;
mod threshold;
mod vecops;

/// Instruction set the kernels run with now: "avx512", "avx2" or "base".
#[pyfunction]
fn kernel_isa() -> &'static str {
    dniasync_core::isa().name()
}

/// Every instruction set the kernels can run with here, narrowest first.
#[pyfunction]
fn kernel_isas() -> Vec<&'static str> {
    dniasync_core::available_isas()
        .into_iter()
        .map(Isa::name)
        .collect()
}

/// Caps the kernels of this process at `isa` (None lifts the cap).
#[pyfunction]
#[pyo3(signature = (isa))]
fn set_kernel_isa(isa: Option<&str>) -> PyResult<()> {
    let cap = match isa {
        None => None,
        Some(name) => match Isa::from_name(name) {
            Some(cap) if cap <= dniasync_core::detected_isa() => Some(cap),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "kernel ISA {name:?} is not available here (available: {})",
                    kernel_isas().join(", ")
                )))
            }
        },
    };
    dniasync_core::set_process_isa(cap);
    Ok(())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", dniasync_core::VERSION)?;
    m.add_function(wrap_pyfunction!(kernel_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_isas, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_isa, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_dot, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_dots, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_axpy, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_scale, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_add_scaled, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_lincomb, m)?)?;
    m.add_function(wrap_pyfunction!(vecops::vec_abs_sum_max, m)?)?;
    m.add_function(wrap_pyfunction!(rows::gather_rows_u8, m)?)?;
    m.add_class::<store::ParamStore>()?;
    m.add_class::<rows::BlockRows>()?;
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
