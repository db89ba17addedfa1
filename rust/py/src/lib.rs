//! `pyserve._core`: PyO3 bindings of `pyserve-core` and of the CPU kernels. Only declares
//! the module; each wrapped module has its own file.

use pyo3::prelude::*;

mod arrays;
mod attention;
mod decoder_layer;
mod eagle_draft;
mod error;
mod gguf_blocks;
mod layer_ops;
mod linear;
mod lora;
mod openmp;
mod output;
mod projection;
mod replica_router;
mod scheduler;
mod whole_model;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    m.add("BACKGROUND_PRIORITY", pyserve_core::BACKGROUND_PRIORITY)?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyUpdateResult>()?;
    m.add_class::<replica_router::PyReplicaRouter>()?;
    m.add_function(wrap_pyfunction!(attention::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(lora::lora_add, m)?)?;
    m.add_function(wrap_pyfunction!(linear::linear, m)?)?;
    m.add_function(wrap_pyfunction!(linear::linear_q8, m)?)?;
    m.add_function(wrap_pyfunction!(linear::linear_q4, m)?)?;
    m.add_function(wrap_pyfunction!(linear::linear_w8a8, m)?)?;
    m.add_function(wrap_pyfunction!(linear::linear_kquant, m)?)?;
    m.add_function(wrap_pyfunction!(decoder_layer::decoder_layer, m)?)?;
    m.add_function(wrap_pyfunction!(whole_model::model_forward, m)?)?;
    m.add_function(wrap_pyfunction!(whole_model::greedy_decode, m)?)?;
    m.add_function(wrap_pyfunction!(eagle_draft::eagle_greedy, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_blocks::gguf_repack_q4, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_blocks::gguf_requantize_int8, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_blocks::gguf_widen, m)?)?;
    m.add("GGUF_BLOCK_SIZES", gguf_blocks::block_sizes(m.py())?)?;
    m.add_function(wrap_pyfunction!(layer_ops::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(layer_ops::add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(layer_ops::silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(layer_ops::rotary, m)?)?;
    Ok(())
}
