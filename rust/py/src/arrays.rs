//! Numpy arrays as Rust slices, refused unless C-contiguous (numpy's `as_slice` also accepts
//! Fortran order, whose elements are not in the row-major order the kernels read).

use numpy::PyUntypedArrayMethods;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn not_contiguous(name: &str) -> PyErr {
    PyValueError::new_err(format!("{name} must be C-contiguous"))
}

pub fn contiguous<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    name: &str,
    array: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    if !array.is_c_contiguous() {
        return Err(not_contiguous(name));
    }
    array.as_slice().map_err(|_| not_contiguous(name))
}

pub fn contiguous_mut<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    name: &str,
    array: &'a mut numpy::PyReadwriteArray<'_, T, D>,
) -> PyResult<&'a mut [T]> {
    if !array.is_c_contiguous() {
        return Err(not_contiguous(name));
    }
    array.as_slice_mut().map_err(|_| not_contiguous(name))
}
