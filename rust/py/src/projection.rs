//! A layer's projection as Python passes it, and its kernel view (`pyserve_cpu_kernels::Projection`):
//! shared by the `linear*` functions and by `decoder_layer`.

use half::f16;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{
    BlockKind, KQuantWeights, LinearWeights, Projection, Q4Weights, Q8Weights, W8A8Weights,
};

use crate::arrays::contiguous;

/// (weight f32, bias), (weight int8, scales, bias), (weight int8, scales, bias, "w8a8": int8
/// activations too), (packed u8, scales f16, offsets f16, group, bias), ([GGUF blocks u8, ...],
/// their type: "Q4_K", ..., bias: the rows of each array in turn), or a list of these: their
/// outputs side by side.
#[derive(FromPyObject)]
pub enum Weight<'py> {
    Q4(
        PyReadonlyArray2<'py, u8>,
        PyReadonlyArray2<'py, f16>,
        PyReadonlyArray2<'py, f16>,
        usize,
        Option<PyReadonlyArray1<'py, f32>>,
    ),
    W8A8(PyReadonlyArray2<'py, i8>, PyReadonlyArray1<'py, f32>, Option<PyReadonlyArray1<'py, f32>>, String),
    KQuant(Vec<PyReadonlyArray2<'py, u8>>, String, Option<PyReadonlyArray1<'py, f32>>),
    Q8(PyReadonlyArray2<'py, i8>, PyReadonlyArray1<'py, f32>, Option<PyReadonlyArray1<'py, f32>>),
    F32(PyReadonlyArray2<'py, f32>, Option<PyReadonlyArray1<'py, f32>>),
    Parts(Vec<Weight<'py>>),
}

impl Weight<'_> {
    /// [fan_out, fan_in] (a packed 4-bit row holds two weights a byte).
    pub fn shape(&self) -> [usize; 2] {
        match self {
            Weight::F32(w, _) => [w.shape()[0], w.shape()[1]],
            Weight::Q8(w, _, _) | Weight::W8A8(w, _, _, _) => [w.shape()[0], w.shape()[1]],
            Weight::Q4(p, _, _, _, _) => [p.shape()[0], p.shape()[1] * 2],
            Weight::KQuant(b, kind, _) => {
                // a kind that is not a block type is refused by `projection`
                let (weights, bytes) = BlockKind::named(kind).map_or((0, 1), BlockKind::weights_and_bytes);
                let rows = b.iter().map(|b| b.shape()[0]).sum();
                [rows, b.first().map_or(0, |b| b.shape()[1] / bytes * weights)]
            }
            Weight::Parts(parts) => {
                [parts.iter().map(|p| p.shape()[0]).sum(), parts.first().map_or(0, |p| p.shape()[1])]
            }
        }
    }
}

/// What ends a w8a8 projection's tuple (its arrays are an int8 one's).
pub const W8A8_TAG: &str = "w8a8";

/// The kernel's view of `w` (no copies). An array that is not C-contiguous is named `name` when
/// given (a layer's projection: "qkv"), else by its own role ("weight", "scales", "bias", ...).
pub fn projection<'a>(w: &'a Weight<'_>, name: Option<&str>) -> PyResult<Projection<'a>> {
    let named = |role: &'static str| name.unwrap_or(role).to_owned();
    let bias = |b: &'a Option<PyReadonlyArray1<'_, f32>>| {
        b.as_ref().map(|b| contiguous(&named("bias"), b)).transpose()
    };
    let [fan_out, fan_in] = w.shape();
    Ok(match w {
        Weight::F32(weight, b) => Projection::F32(LinearWeights {
            weight: contiguous(&named("weight"), weight)?,
            bias: bias(b)?,
            fan_in,
            fan_out,
        }),
        Weight::Q8(weight, scales, b) => Projection::Q8(Q8Weights {
            weight: contiguous(&named("weight"), weight)?,
            scales: contiguous(&named("scales"), scales)?,
            bias: bias(b)?,
            fan_in,
            fan_out,
        }),
        Weight::W8A8(weight, scales, b, kind) => {
            if kind != W8A8_TAG {
                return Err(PyValueError::new_err(format!(
                    "{}: a projection of int8 weights with a fourth element must end with {W8A8_TAG:?}, not {kind:?}",
                    named("weight")
                )));
            }
            Projection::W8A8(W8A8Weights {
                weight: contiguous(&named("weight"), weight)?,
                scales: contiguous(&named("scales"), scales)?,
                bias: bias(b)?,
                fan_in,
                fan_out,
            })
        }
        Weight::Q4(packed, scales, offsets, group, b) => Projection::Q4(Q4Weights {
            packed: contiguous(&named("packed"), packed)?,
            scales: contiguous(&named("scales"), scales)?,
            offsets: contiguous(&named("offsets"), offsets)?,
            group: *group,
            bias: bias(b)?,
            fan_in,
            fan_out,
        }),
        Weight::KQuant(blocks, kind, b) => Projection::KQuant(KQuantWeights {
            kind: BlockKind::named(kind).ok_or_else(|| {
                PyValueError::new_err(format!("{}: {kind:?} is not a GGUF block type", named("kind")))
            })?,
            blocks: blocks.iter().map(|b| contiguous(&named("blocks"), b)).collect::<PyResult<_>>()?,
            bias: bias(b)?,
            fan_in,
            fan_out,
        }),
        Weight::Parts(parts) => {
            Projection::Parts(parts.iter().map(|p| projection(p, name)).collect::<PyResult<_>>()?)
        }
    })
}
