//! Element arithmetic of cross-rank reductions: adding, scaling, and f16/bf16 conversions.
//! Partial sums travel as f32 or f64; f16 and bf16 accumulate in f32 and are rounded once.

use tributary::{half, DType, Error, Result};

/// The element type partial sums travel in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wire {
    F32,
    F64,
}

impl Wire {
    /// The wire type of a storage dtype: f32 for f32, f16 and bf16; f64 for f64.
    pub(crate) fn of(dtype: DType) -> Result<Wire> {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => Ok(Wire::F32),
            DType::F64 => Ok(Wire::F64),
            other => Err(Error::DTypeMismatch {
                node: "cross-rank all-reduce".into(),
                expected: "f32, f64, f16 or bf16".into(),
                found: other.to_string(),
            }),
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::F64 => 8,
        }
    }

    /// Whether the storage dtype travels as it is (no conversion).
    pub(crate) fn same_as_storage(self, dtype: DType) -> bool {
        matches!(
            (self, dtype),
            (Wire::F32, DType::F32) | (Wire::F64, DType::F64)
        )
    }
}

/// `dst += src`, element-wise; both hold whole wire elements and are aligned to them (pool
/// buffers and staging words are).
pub(crate) fn add_into(wire: Wire, dst: &mut [u8], src: &[u8]) {
    accumulate(wire, dst, src, None);
}

/// One addition of a sum in rank order, elementwise: `dst + src`, then times `scale` if any
/// (the sum rounded, then the product: the bits of adding, then [`scale`], in one pass).
/// IEEE addition is commutative, so a sum accumulated in `dst` from a part that comes
/// before it in rank order has the same bits.
pub(crate) fn accumulate(wire: Wire, dst: &mut [u8], src: &[u8], scale: Option<f64>) {
    match wire {
        Wire::F32 => accumulate_typed::<f32>(dst, src, scale.map(|f| f as f32)),
        Wire::F64 => accumulate_typed::<f64>(dst, src, scale),
    }
}

fn accumulate_typed<T>(dst: &mut [u8], src: &[u8], scale: Option<T>)
where
    T: bytemuck::Pod + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    // One loop per case, so each is a plain loop the compiler vectorises.
    fn each<T: bytemuck::Pod>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
        match (
            bytemuck::try_cast_slice_mut::<u8, T>(dst),
            bytemuck::try_cast_slice::<u8, T>(src),
        ) {
            (Ok(d), Ok(s)) => {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = f(*d, *s);
                }
            }
            _ => {
                let n = std::mem::size_of::<T>();
                for (d, s) in dst.chunks_exact_mut(n).zip(src.chunks_exact(n)) {
                    let v = f(
                        bytemuck::pod_read_unaligned(d),
                        bytemuck::pod_read_unaligned(s),
                    );
                    d.copy_from_slice(bytemuck::bytes_of(&v));
                }
            }
        }
    }
    match scale {
        None => each::<T>(dst, src, |d, s| d + s),
        Some(f) => each::<T>(dst, src, |d, s| (d + s) * f),
    }
}

/// `x *= factor`, element-wise (the mean).
pub(crate) fn scale(wire: Wire, x: &mut [u8], factor: f64) {
    match wire {
        Wire::F32 => {
            let f = factor as f32;
            for c in x.chunks_exact_mut(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * f;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        Wire::F64 => {
            for c in x.chunks_exact_mut(8) {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                let v = f64::from_le_bytes(b) * factor;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// f16 / bf16 bytes as f32 values.
/// `bytes` (f16 or bf16, `out.len()` of them) widened into `out`.
pub(crate) fn widen_into(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if bytes.len() != 2 * out.len() {
        return Err(Error::InvalidSize {
            node: "cross-rank all-reduce".into(),
            reason: format!(
                "{} bytes of 16-bit floats where {} elements take {}",
                bytes.len(),
                out.len(),
                2 * out.len()
            ),
        });
    }
    let words = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]));
    match dtype {
        DType::F16 => words
            .zip(out)
            .for_each(|(w, o)| *o = half::f16::from_bits(w).to_f32()),
        DType::BF16 => words
            .zip(out)
            .for_each(|(w, o)| *o = half::bf16::from_bits(w).to_f32()),
        other => {
            return Err(Error::DTypeMismatch {
                node: "cross-rank all-reduce".into(),
                expected: "f16 or bf16".into(),
                found: other.to_string(),
            })
        }
    }
    Ok(())
}

/// f32 values into f16 / bf16 bytes (round to nearest even, once).
pub(crate) fn narrow(dtype: DType, values: &[f32], out: &mut [u8]) -> Result<()> {
    for (v, c) in values.iter().zip(out.chunks_exact_mut(2)) {
        let bits = match dtype {
            DType::F16 => half::f16::from_f32(*v).to_bits(),
            DType::BF16 => half::bf16::from_f32(*v).to_bits(),
            other => {
                return Err(Error::DTypeMismatch {
                    node: "cross-rank all-reduce".into(),
                    expected: "f16 or bf16".into(),
                    found: other.to_string(),
                })
            }
        };
        c.copy_from_slice(&bits.to_le_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_scales_and_rounds_once() {
        let mut a = bytemuck::cast_slice(&[1f32, 2.0, 3.0]).to_vec();
        add_into(Wire::F32, &mut a, bytemuck::cast_slice(&[0.5f32, 0.5, 0.5]));
        scale(Wire::F32, &mut a, 0.5);
        assert_eq!(
            bytemuck::pod_collect_to_vec::<u8, f32>(&a),
            vec![0.75, 1.25, 1.75]
        );
        // 1 + 2^-11 + 2^-11 is exact in f32 but not in f16: adding in f16 twice would round
        // each time and lose both halves; widening sums them first.
        let eps = half::f16::from_f32(1.0 / 2048.0).to_bits().to_le_bytes();
        let one = half::f16::ONE.to_bits().to_le_bytes();
        let widen = |bytes: &[u8]| {
            let mut v = [0f32];
            widen_into(DType::F16, bytes, &mut v).expect("f16");
            v
        };
        let mut sum = widen(&one);
        for _ in 0..2 {
            sum[0] += widen(&eps)[0];
        }
        let mut out = [0u8; 2];
        narrow(DType::F16, &sum, &mut out).expect("f16");
        assert_eq!(
            half::f16::from_bits(u16::from_le_bytes(out)).to_f32(),
            1.0 + 1.0 / 1024.0
        );
        assert!(Wire::of(DType::I32).is_err());
    }

    /// The fused pass gives the bits of adding, then scaling, for f32 and f64, on aligned
    /// and unaligned bytes, its operands in either order (every rank's mean must hold the
    /// same bits whichever path it ran: an in-place sum adds rank 0's part to rank 1's).
    #[test]
    fn the_fused_add_and_scale_rounds_as_the_two_passes() {
        let mut next = crate::cluster::xorshift(0x2545_f491_4f6c_dd1d);
        for wire in [Wire::F32, Wire::F64] {
            for factor in [0.5, 1.0 / 3.0, 0.1, 7.0] {
                let n = 257 * wire.size();
                // Values of every magnitude: random exponents, signs and mantissas.
                let bytes = |next: &mut dyn FnMut() -> u64| -> Vec<u8> {
                    (0..n / wire.size())
                        .flat_map(|_| match wire {
                            Wire::F32 => {
                                let v = f32::from_bits(next() as u32 & 0xBFFF_FFFF);
                                v.to_ne_bytes().to_vec()
                            }
                            Wire::F64 => {
                                let v = f64::from_bits(next() & 0xBFEF_FFFF_FFFF_FFFF);
                                v.to_ne_bytes().to_vec()
                            }
                        })
                        .collect()
                };
                let (a, b) = (bytes(&mut next), bytes(&mut next));
                for offset in [0, 1] {
                    let mut buf = vec![0u8; n + offset];
                    buf[offset..].copy_from_slice(&a);
                    let mut two = a.clone();
                    add_into(wire, &mut two, &b);
                    scale(wire, &mut two, factor);
                    accumulate(wire, &mut buf[offset..], &b, Some(factor));
                    let what = format!("{wire:?} x {factor}, offset {offset}");
                    assert_eq!(&buf[offset..], &two[..], "{what}");
                    // The operands the other way round (a part before the running sum).
                    let mut swapped = b.clone();
                    accumulate(wire, &mut swapped, &a, Some(factor));
                    assert_eq!(swapped, two, "{what}, swapped");
                }
            }
        }
    }
}
