//! `ReplicaRouter` for Python: the data-parallel front's routing policy (pyserve-router).

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyserve_router::{Policy, ReplicaRouter, RouterConfig};

#[pyclass(name = "ReplicaRouter", module = "pyserve._core")]
pub struct PyReplicaRouter {
    inner: ReplicaRouter,
}

impl PyReplicaRouter {
    fn check(&self, replica: usize) -> PyResult<()> {
        if replica >= self.inner.num_replicas() {
            return Err(PyIndexError::new_err(format!(
                "replica {replica} out of range (the router has {})",
                self.inner.num_replicas()
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl PyReplicaRouter {
    #[new]
    #[pyo3(signature = (num_replicas, *, policy="cache_aware", cache_threshold=0.5, balance_abs_threshold=16,
        balance_rel_threshold=1.5, max_tree_bytes=64 << 20))]
    fn new(
        num_replicas: usize,
        policy: &str,
        cache_threshold: f64,
        balance_abs_threshold: usize,
        balance_rel_threshold: f64,
        max_tree_bytes: usize,
    ) -> PyResult<Self> {
        let policy = match policy {
            "cache_aware" => Policy::CacheAware,
            "round_robin" => Policy::RoundRobin,
            other => {
                return Err(PyValueError::new_err(format!(
                    "policy must be 'cache_aware' or 'round_robin', got {other:?}"
                )))
            }
        };
        let config = RouterConfig {
            policy,
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            max_tree_bytes,
        };
        let inner = ReplicaRouter::new(num_replicas, config).map_err(|e| PyValueError::new_err(e.0))?;
        Ok(Self { inner })
    }

    /// (replica, reason, matched_bytes) for a request whose text is `text`, counted in flight
    /// there until `finished(replica)`; None when every replica is down or excluded.
    #[pyo3(signature = (text, exclude=Vec::new()))]
    fn route(&mut self, text: &str, exclude: Vec<usize>) -> Option<(usize, &'static str, usize)> {
        let d = self.inner.route_excluding(text.as_bytes(), &exclude)?;
        Some((d.replica, d.reason.as_str(), d.matched_bytes))
    }

    fn finished(&mut self, replica: usize) -> PyResult<()> {
        self.check(replica)?;
        self.inner.finished(replica);
        Ok(())
    }

    fn set_healthy(&mut self, replica: usize, healthy: bool) -> PyResult<()> {
        self.check(replica)?;
        self.inner.set_healthy(replica, healthy);
        Ok(())
    }

    fn is_healthy(&self, replica: usize) -> PyResult<bool> {
        self.check(replica)?;
        Ok(self.inner.is_healthy(replica))
    }

    fn load(&self, replica: usize) -> PyResult<usize> {
        self.check(replica)?;
        Ok(self.inner.load(replica))
    }

    fn tree_bytes(&self, replica: usize) -> PyResult<usize> {
        self.check(replica)?;
        Ok(self.inner.tree_bytes(replica))
    }

    #[getter]
    fn num_replicas(&self) -> usize {
        self.inner.num_replicas()
    }
}
