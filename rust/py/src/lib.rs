//! `pyserve._core`: PyO3 bindings of `pyserve-core` and of the CPU kernels. Only declares
//! the module; each wrapped module has its own file.

use pyo3::prelude::*;

mod arrays;
mod attention;
mod error;
mod lora;
mod openmp;
mod output;
mod scheduler;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyUpdateResult>()?;
    m.add_function(wrap_pyfunction!(attention::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(lora::lora_add, m)?)?;
    Ok(())
}
