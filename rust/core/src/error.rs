//! The one error type of the core. Every variant names the offending field or id so a binding
//! can turn it into a user-facing message without extra context.

use crate::request::RequestId;

/// Errors returned by the core. Allocation failure is not an error (it is a `false`/`None`
/// the scheduler answers by preempting); these are caller mistakes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A configuration value is out of range.
    #[error("invalid config field `{field}`: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    /// A request can never be served as given (too long, bad limits, duplicate id, ...).
    #[error("invalid request field `{field}`: {reason}")]
    InvalidRequest { field: &'static str, reason: String },
    /// No live request has this id.
    #[error("unknown request id {0}")]
    UnknownRequest(RequestId),
    /// `update` was called with results that do not match the step in flight.
    #[error("invalid step result `{field}`: {reason}")]
    InvalidStepResult { field: &'static str, reason: String },
}

pub type Result<T> = std::result::Result<T, CoreError>;

pub(crate) fn config_err(field: &'static str, reason: impl Into<String>) -> CoreError {
    CoreError::InvalidConfig { field, reason: reason.into() }
}

pub(crate) fn request_err(field: &'static str, reason: impl Into<String>) -> CoreError {
    CoreError::InvalidRequest { field, reason: reason.into() }
}

pub(crate) fn step_err(field: &'static str, reason: impl Into<String>) -> CoreError {
    CoreError::InvalidStepResult { field, reason: reason.into() }
}
