//! `SchedulerOutput` and `UpdateResult` as Python objects. The core's vectors are moved into
//! numpy arrays (no per-element copy).

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, ToPyArray};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyserve_core::{FinishReason, SchedulerOutput, UpdateResult};

/// One step's plan and flat inputs. Arrays: `req_ids` (uint64), per-request int32 arrays,
/// per-token `input_ids` (int32), `positions` and `slot_mapping` (int64), `tree_parents`
/// (int32; empty unless a request verifies a token tree), `block_tables`
/// (int32, `[num_reqs, width]`, padded with 0), `block_copies` (int32, `[m, 2]`).
#[pyclass(name = "SchedulerOutput", module = "pyserve._core", frozen, get_all)]
pub struct PySchedulerOutput {
    step: u64,
    req_ids: Py<PyArray1<u64>>,
    num_scheduled_tokens: Py<PyArray1<i32>>,
    num_spec_tokens: Py<PyArray1<i32>>,
    num_logits: Py<PyArray1<i32>>,
    logits_indices: Py<PyArray1<i32>>,
    query_start_loc: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    num_output_tokens: Py<PyArray1<i32>>,
    input_ids: Py<PyArray1<i32>>,
    positions: Py<PyArray1<i64>>,
    slot_mapping: Py<PyArray1<i64>>,
    tree_parents: Py<PyArray1<i32>>,
    block_tables: Py<PyArray2<i32>>,
    block_copies: Py<PyArray2<i32>>,
    preempted_req_ids: Py<PyArray1<u64>>,
    finished_req_ids: Py<PyArray1<u64>>,
    num_reqs: usize,
    total_num_tokens: usize,
}

fn matrix(py: Python<'_>, data: Vec<i32>, cols: usize) -> PyResult<Py<PyArray2<i32>>> {
    let rows = data.len().checked_div(cols).unwrap_or(0);
    Ok(data.into_pyarray(py).reshape([rows, cols])?.unbind())
}

impl PySchedulerOutput {
    pub fn new(py: Python<'_>, out: SchedulerOutput) -> PyResult<Self> {
        let num_reqs = out.num_reqs();
        let total_num_tokens = out.total_num_tokens();
        Ok(Self {
            step: out.step,
            req_ids: out.req_ids.into_pyarray(py).unbind(),
            num_scheduled_tokens: out.num_scheduled_tokens.into_pyarray(py).unbind(),
            num_spec_tokens: out.num_spec_tokens.into_pyarray(py).unbind(),
            num_logits: out.num_logits.into_pyarray(py).unbind(),
            logits_indices: out.logits_indices.into_pyarray(py).unbind(),
            query_start_loc: out.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: out.seq_lens.into_pyarray(py).unbind(),
            num_output_tokens: out.num_output_tokens.into_pyarray(py).unbind(),
            input_ids: out.input_ids.into_pyarray(py).unbind(),
            positions: out.positions.into_pyarray(py).unbind(),
            slot_mapping: out.slot_mapping.into_pyarray(py).unbind(),
            tree_parents: out.tree_parents.into_pyarray(py).unbind(),
            block_tables: matrix(py, out.block_tables, out.block_table_width)?,
            block_copies: matrix(py, out.block_copies, 2)?,
            preempted_req_ids: out.preempted_req_ids.into_pyarray(py).unbind(),
            finished_req_ids: out.finished_req_ids.into_pyarray(py).unbind(),
            num_reqs,
            total_num_tokens,
        })
    }
}

#[pymethods]
impl PySchedulerOutput {
    fn __len__(&self) -> usize {
        self.num_reqs
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step={}, num_reqs={}, total_num_tokens={})",
            self.step, self.num_reqs, self.total_num_tokens
        )
    }
}

/// What `update` did. Per scheduled request (`req_ids` order): `num_appended`. The step's
/// output: `req_ids` (the requests that got tokens), `token_ids` and `starts` (request
/// `req_ids[i]` got `token_ids[starts[i]:starts[i + 1]]`, both lists), `sampled_index` (int64:
/// each token's index among the sampled ones), `num_cached_tokens` ({id: n} for requests getting
/// their first tokens), `finished_req_ids` with `finish_reasons` ("stop", "length", "abort"),
/// and `fork_ready` (held requests to fork now, then release). Each attribute is built when it
/// is read (a caller pays only for what it reads): read each once.
#[pyclass(name = "UpdateResult", module = "pyserve._core", frozen)]
pub struct PyUpdateResult {
    inner: UpdateResult,
}

pub fn reason_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

impl PyUpdateResult {
    pub fn new(result: UpdateResult) -> Self {
        Self { inner: result }
    }
}

#[pymethods]
impl PyUpdateResult {
    #[getter]
    fn num_appended<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.inner.num_appended.to_pyarray(py)
    }

    #[getter]
    fn req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.inner.req_ids)
    }

    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.inner.token_ids)
    }

    #[getter]
    fn starts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.inner.starts)
    }

    #[getter]
    fn sampled_index<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_iter(py, self.inner.sampled_index.iter().map(|&i| i64::from(i)))
    }

    #[getter]
    fn num_cached_tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cached = PyDict::new(py);
        for &(id, n) in &self.inner.first_outputs {
            cached.set_item(id, n)?;
        }
        Ok(cached)
    }

    #[getter]
    fn finished_req_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_iter(py, self.inner.finished.iter().map(|&(id, _)| id))
    }

    #[getter]
    fn finish_reasons(&self) -> Vec<&'static str> {
        self.inner.finished.iter().map(|&(_, r)| reason_name(r)).collect()
    }

    #[getter]
    fn fork_ready(&self) -> Vec<u64> {
        self.inner.fork_ready.clone()
    }

    fn __repr__(&self) -> String {
        format!("UpdateResult(finished={})", self.inner.finished.len())
    }
}
