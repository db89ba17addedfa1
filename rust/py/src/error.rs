//! The one place core errors become Python exceptions.

use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyserve_core::CoreError;

create_exception!(_core, ConfigError, PyValueError, "A scheduler config field is out of range.");
create_exception!(_core, InvalidRequestError, PyValueError, "A request can never be served as given.");
create_exception!(_core, UnknownRequestError, PyKeyError, "No live request has this id.");
create_exception!(
    _core,
    StepError,
    PyRuntimeError,
    "schedule/update called out of order or with mismatched results."
);

/// InvalidRequestError with the request field at fault as its `field` attribute, so callers can
/// name it (HTTP 400 `param`) without parsing the message.
pub fn invalid_request(field: &'static str, msg: String) -> PyErr {
    Python::attach(|py| {
        let err = InvalidRequestError::new_err(msg);
        match err.value(py).setattr("field", field) {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

pub fn to_py(err: CoreError) -> PyErr {
    let msg = err.to_string();
    match err {
        CoreError::InvalidConfig { .. } => ConfigError::new_err(msg),
        CoreError::InvalidRequest { field, .. } => invalid_request(field, msg),
        CoreError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
        CoreError::InvalidStepResult { .. } => StepError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("StepError", py.get_type::<StepError>())?;
    Ok(())
}
