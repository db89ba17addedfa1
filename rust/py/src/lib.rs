//! `pyserve._core`: PyO3 bindings of `pyserve-core`. Only declares the module; each wrapped core
//! module has its own file.

use pyo3::prelude::*;

mod error;
mod output;
mod scheduler;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyUpdateResult>()?;
    Ok(())
}
