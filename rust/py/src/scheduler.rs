//! `Scheduler` for Python: keyword-argument constructor, validated inputs, numpy in and out.

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyserve_core::{Namespace, NewRequest, Scheduler, SchedulerConfig};

use crate::error::{invalid_request, to_py, StepError};
use crate::output::{PySchedulerOutput, PyUpdateResult};

#[pyclass(name = "Scheduler", module = "pyserve._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

/// Token ids from a numpy integer array or any sequence of ints, checked to fit in u32.
fn parse_token_ids(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let values: Vec<i64> = match obj.extract::<PyReadonlyArray1<i64>>() {
        Ok(arr) => arr.as_slice()?.to_vec(),
        Err(_) => match obj.extract::<PyReadonlyArray1<i32>>() {
            Ok(arr) => arr.as_slice()?.iter().map(|&v| v as i64).collect(),
            Err(_) => obj.extract::<Vec<i64>>().map_err(|_| {
                invalid_request(field, format!("invalid request field `{field}`: must be a sequence of ints"))
            })?,
        },
    };
    values
        .into_iter()
        .map(|v| {
            u32::try_from(v).map_err(|_| {
                invalid_request(
                    field,
                    format!("invalid request field `{field}`: token id {v} is out of range"),
                )
            })
        })
        .collect()
}

/// A step-result array: int64 numpy (no copy) or any int sequence.
fn step_values(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let convert = |v: i64| {
        u32::try_from(v).map_err(|_| {
            StepError::new_err(format!("invalid step result `{field}`: value {v} is out of range"))
        })
    };
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<i64>>() {
        return arr.as_slice()?.iter().map(|&v| convert(v)).collect();
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<i32>>() {
        return arr.as_slice()?.iter().map(|&v| convert(v as i64)).collect();
    }
    let values: Vec<i64> = obj.extract().map_err(|_| {
        StepError::new_err(format!("invalid step result `{field}`: must be a sequence of ints"))
    })?;
    values.into_iter().map(convert).collect()
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (*, num_blocks, block_size=16, max_num_batched_tokens=2048, max_num_seqs=256,
        max_model_len=8192, max_loras=4, num_lookahead_tokens=0, enable_prefix_caching=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: usize,
        block_size: usize,
        max_num_batched_tokens: usize,
        max_num_seqs: usize,
        max_model_len: usize,
        max_loras: usize,
        num_lookahead_tokens: usize,
        enable_prefix_caching: bool,
    ) -> PyResult<Self> {
        let config = SchedulerConfig {
            num_blocks,
            block_size,
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            max_loras,
            num_lookahead_tokens,
            enable_prefix_caching,
        };
        Ok(Self { inner: Scheduler::new(config).map_err(to_py)? })
    }

    /// Queues a request; raises InvalidRequestError naming the field when it can never run.
    #[pyo3(signature = (request_id, prompt_token_ids, *, max_tokens=None, min_tokens=0, priority=0,
        adapter_id=0, cache_salt=String::new(), stop_token_ids=None, eos_token_id=None, ignore_eos=false,
        hold_for_fork=false))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: u64,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: Option<usize>,
        min_tokens: usize,
        priority: i32,
        adapter_id: u32,
        cache_salt: String,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        eos_token_id: Option<u32>,
        ignore_eos: bool,
        hold_for_fork: bool,
    ) -> PyResult<()> {
        let stop_token_ids = match stop_token_ids {
            Some(obj) => parse_token_ids("stop_token_ids", obj)?,
            None => Vec::new(),
        };
        let new = NewRequest {
            id: request_id,
            prompt_token_ids: parse_token_ids("prompt_token_ids", prompt_token_ids)?,
            max_tokens,
            min_tokens,
            priority,
            namespace: Namespace::new(adapter_id, cache_salt),
            stop_token_ids,
            eos_token_id,
            ignore_eos,
            hold_for_fork,
        };
        self.inner.add_request(new).map_err(to_py)
    }

    /// Starts `child_id` sharing the parent's computed KV blocks (copy-on-write).
    fn fork_request(&mut self, parent_id: u64, child_id: u64) -> PyResult<()> {
        self.inner.fork_request(parent_id, child_id).map_err(to_py)
    }

    /// Lets a request added with `hold_for_fork` compute its last prompt token.
    fn release_hold(&mut self, request_id: u64) -> PyResult<()> {
        self.inner.release_hold(request_id).map_err(to_py)
    }

    fn abort(&mut self, request_id: u64) -> PyResult<()> {
        self.inner.abort(request_id).map_err(to_py)
    }

    /// Draft tokens to verify at the request's next step: a chain, or with `parents` a token
    /// tree (draft j follows the request's last token where `parents[j]` is 0, else draft
    /// `parents[j] - 1`).
    #[pyo3(signature = (request_id, token_ids, parents=None))]
    fn set_spec_tokens(
        &mut self,
        request_id: u64,
        token_ids: &Bound<'_, PyAny>,
        parents: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let tokens = parse_token_ids("spec_token_ids", token_ids)?;
        let parents = match parents {
            Some(obj) => parse_token_ids("spec_parents", obj)?,
            None => Vec::new(),
        };
        self.inner.set_spec_tree(request_id, &tokens, &parents).map_err(to_py)
    }

    /// Up to `k` draft tokens for the request from n-gram lookup in its own tokens (not set).
    #[pyo3(signature = (request_id, k, min_n=1, max_n=4))]
    fn propose_ngram(&self, request_id: u64, k: usize, min_n: usize, max_n: usize) -> PyResult<Vec<u32>> {
        Ok(self.inner.propose_ngram(request_id, k, min_n, max_n).map_err(to_py)?.to_vec())
    }

    /// One step; while requests decode, prompts share what the decodes leave of `token_budget`
    /// (at least `block_size`), never more than `max_num_batched_tokens` in all; at most
    /// `max_background` background requests (None: no limit).
    #[pyo3(signature = (token_budget=None, max_background=None))]
    fn schedule(
        &mut self,
        py: Python<'_>,
        token_budget: Option<usize>,
        max_background: Option<usize>,
    ) -> PyResult<PySchedulerOutput> {
        let out = self.inner.schedule_with_budget(token_budget, max_background).map_err(to_py)?;
        PySchedulerOutput::new(py, out)
    }

    /// `sampled_token_ids`: the step's sampled tokens end to end; `num_sampled`: how many per
    /// scheduled request, in `req_ids` order.
    fn update(
        &mut self,
        sampled_token_ids: &Bound<'_, PyAny>,
        num_sampled: &Bound<'_, PyAny>,
    ) -> PyResult<PyUpdateResult> {
        let sampled = step_values("sampled_token_ids", sampled_token_ids)?;
        let counts = step_values("num_sampled", num_sampled)?;
        let result = self.inner.update(&sampled, &counts).map_err(to_py)?;
        Ok(PyUpdateResult::new(result))
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Whether a request below BACKGROUND_PRIORITY is running or waiting.
    fn has_foreground_requests(&self) -> bool {
        self.inner.has_foreground_requests()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    /// Gauges and counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_requests_waiting", s.num_requests_waiting)?;
        d.set_item("num_requests_running", s.num_requests_running)?;
        d.set_item("kv_cache_usage_perc", s.kv_cache_usage_perc)?;
        d.set_item("kv_free_blocks", s.kv_free_blocks)?;
        d.set_item("kv_cached_blocks", s.kv_cached_blocks)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("num_steps", s.num_steps)?;
        Ok(d)
    }

    /// A live request's tokens from `start` on (prompt, then output), as int64.
    #[pyo3(signature = (request_id, start=0))]
    fn token_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: u64,
        start: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let req = self
            .inner
            .request(request_id)
            .ok_or_else(|| to_py(pyserve_core::CoreError::UnknownRequest(request_id)))?;
        let tokens = &req.token_ids[start.min(req.token_ids.len())..];
        Ok(tokens.iter().map(|&t| i64::from(t)).collect::<Vec<i64>>().into_pyarray(py))
    }

    /// Prompt tokens the request got from the prefix cache at its first admission.
    fn num_cached_tokens(&self, request_id: u64) -> PyResult<usize> {
        self.inner
            .request(request_id)
            .map(|r| r.num_cached_tokens)
            .ok_or_else(|| to_py(pyserve_core::CoreError::UnknownRequest(request_id)))
    }

    /// One live request's state as a dict (tokens, progress, blocks, status).
    fn request_state<'py>(&self, py: Python<'py>, request_id: u64) -> PyResult<Bound<'py, PyDict>> {
        let req = self
            .inner
            .request(request_id)
            .ok_or_else(|| to_py(pyserve_core::CoreError::UnknownRequest(request_id)))?;
        let d = PyDict::new(py);
        d.set_item("status", format!("{:?}", req.status).to_lowercase())?;
        d.set_item("token_ids", req.token_ids.clone())?;
        d.set_item("num_prompt_tokens", req.num_prompt_tokens)?;
        d.set_item("num_computed_tokens", req.num_computed_tokens)?;
        d.set_item("num_cached_tokens", req.num_cached_tokens)?;
        d.set_item("num_preemptions", req.num_preemptions)?;
        d.set_item("block_table", req.block_table.clone())?;
        Ok(d)
    }

    /// Raises AssertionError with the first broken bookkeeping invariant.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(PyAssertionError::new_err)
    }
}
