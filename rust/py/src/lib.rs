//! `pyserve._core`: PyO3 bindings of `pyserve-core` and of the CPU attention kernel. Only declares
//! the module; each wrapped module has its own file.

use pyo3::prelude::*;

mod attention;
mod error;
mod output;
mod scheduler;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyUpdateResult>()?;
    m.add_function(wrap_pyfunction!(attention::paged_decode_attention, m)?)?;
    Ok(())
}
