//! WGSL sources of the built-in kernels, instantiated per dtype.
//!
//! Every built-in shader has the same shape. Its bindings `b0..bN` follow the argument
//! order, with the merge buffer last. One push-constant block `p` holds `n, m, k, c: u32`,
//! then two scalars `a, b` of the computation type's width. A per-element `body(i)` computes
//! in the computation type, and a grid-stride `main` stores it into the output binding.
//! Packed 16-bit dtypes are `array<u32>`, two elements per word. Each invocation owns whole
//! words, so packed halves never race, and converts with the CPU's integer code
//! `h2f`/`f2h` and `b2f`/`f2b`. So results round exactly as on the CPU.

use crate::node::DType;

/// Workgroup size (x) of every built-in shader.
pub(super) const WORKGROUP: u32 = 64;

/// The computation representation of a dtype in a shader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ty {
    F32,
    F64,
    F16,
    Bf16,
    I32,
}

impl Ty {
    pub(super) fn of(d: DType) -> Option<Ty> {
        match d {
            DType::F32 => Some(Ty::F32),
            DType::F64 => Some(Ty::F64),
            DType::F16 => Some(Ty::F16),
            DType::BF16 => Some(Ty::Bf16),
            DType::I32 => Some(Ty::I32),
            DType::U8 => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::F64 => "f64",
            Ty::F16 => "f16",
            Ty::Bf16 => "bf16",
            Ty::I32 => "i32",
        }
    }

    /// Element type of the storage arrays.
    fn storage(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::F64 => "f64",
            Ty::F16 | Ty::Bf16 => "u32",
            Ty::I32 => "i32",
        }
    }

    /// The computation type.
    fn comp(self) -> &'static str {
        match self {
            Ty::F32 | Ty::F16 | Ty::Bf16 => "f32",
            Ty::F64 => "f64",
            Ty::I32 => "i32",
        }
    }

    fn zero(self) -> &'static str {
        match self {
            Ty::F32 | Ty::F16 | Ty::Bf16 => "0.0f",
            Ty::F64 => "0.0lf",
            Ty::I32 => "0i",
        }
    }

    /// Whether push-constant scalars are `f64` (otherwise `f32`).
    pub(super) fn wide_scalars(self) -> bool {
        self == Ty::F64
    }

    pub(super) fn packed(self) -> bool {
        matches!(self, Ty::F16 | Ty::Bf16)
    }

    /// Whether the shader needs `shaderFloat64`.
    pub(super) fn needs_f64(self) -> bool {
        self == Ty::F64
    }
}

/// A built-in shader: what it computes per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    /// `b0 = b0 + b1` (add_into; add_merge with the merge buffer as `b1`).
    Add,
    /// `b0 = a * b1`.
    Scale,
    /// `b0 = a * b0`.
    ScaleInPlace,
    /// `b0 = b0 + a * b1`.
    Axpy,
    /// `b0 = b0 - a * b1`.
    SgdStep,
    /// `b0 = relu(b1)`.
    Relu,
    /// `b0 = b2 > 0 ? b1 : 0`.
    ReluBackward,
    /// `b0 = b1 * b2`.
    Mul,
    /// `b0[i] = b0[i] + b1[i % c]`.
    AddRowBias,
    /// `b0[j] = Σ_r b1[r * n + j]` over `m` rows.
    SumRows,
    /// `b0 = b1 b2` (`m, k, c = n`).
    Matmul,
    /// `b0 = b1ᵀ b2`.
    MatmulTn,
    /// `b0 = b1 b2ᵀ`.
    MatmulNt,
    /// `b1 = (softmax(b2) - b3) * a` per row of `c`.
    SoftmaxGrad,
    /// `b4[r] = cross-entropy of row r of (b2, b3)` (scratch in the computation type).
    SoftmaxRows,
    /// `b0[0] = Σ_r b4[r]` in increasing `r` (one invocation).
    SoftmaxLoss,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Add => "add",
            Op::Scale => "scale",
            Op::ScaleInPlace => "scale_in_place",
            Op::Axpy => "axpy",
            Op::SgdStep => "sgd_step",
            Op::Relu => "relu",
            Op::ReluBackward => "relu_backward",
            Op::Mul => "mul",
            Op::AddRowBias => "add_row_bias",
            Op::SumRows => "sum_rows",
            Op::Matmul => "matmul",
            Op::MatmulTn => "matmul_tn",
            Op::MatmulNt => "matmul_nt",
            Op::SoftmaxGrad => "softmax_grad",
            Op::SoftmaxRows => "softmax_rows",
            Op::SoftmaxLoss => "softmax_loss",
        }
    }

    /// For each binding: whether the shader writes it.
    pub(super) fn writes(self) -> &'static [bool] {
        match self {
            Op::ScaleInPlace => &[true],
            Op::Add
            | Op::Scale
            | Op::Axpy
            | Op::SgdStep
            | Op::Relu
            | Op::AddRowBias
            | Op::SumRows => &[true, false],
            Op::ReluBackward | Op::Mul | Op::Matmul | Op::MatmulTn | Op::MatmulNt => {
                &[true, false, false]
            }
            // The softmax shaders share one layout: loss, dlogits, logits, labels, and a
            // scratch of one value per row.
            Op::SoftmaxGrad | Op::SoftmaxRows | Op::SoftmaxLoss => {
                &[true, true, false, false, true]
            }
        }
    }

    /// The binding the shader stores into.
    fn output(self) -> usize {
        match self {
            Op::SoftmaxGrad => 1,
            Op::SoftmaxRows => SCRATCH,
            _ => 0,
        }
    }

    fn body(self, ty: Ty) -> String {
        let z = ty.zero();
        let (exp, ln) = if ty == Ty::F64 {
            ("exp64", "ln64")
        } else {
            ("exp", "log")
        };
        let isnan = if ty == Ty::F64 {
            "(x != x)"
        } else {
            "isnan32(x)"
        };
        match self {
            Op::Add => "return ld0(i) + ld1(i);".into(),
            Op::Scale => "return p.a * ld1(i);".into(),
            Op::ScaleInPlace => "return p.a * ld0(i);".into(),
            Op::Axpy => "return ld0(i) + p.a * ld1(i);".into(),
            Op::SgdStep => "return ld0(i) - p.a * ld1(i);".into(),
            Op::Relu => format!(
                "let x = ld1(i);\n    if (x > {z} || {isnan}) {{ return x; }}\n    return {z};"
            ),
            Op::ReluBackward => format!("if (ld2(i) > {z}) {{ return ld1(i); }}\n    return {z};"),
            Op::Mul => "return ld1(i) * ld2(i);".into(),
            Op::AddRowBias => "return ld0(i) + ld1(i % p.c);".into(),
            Op::SumRows => format!(
                "var acc = {z};\n    for (var r = 0u; r < p.m; r++) {{ acc = acc + ld1(r * p.n + i); }}\n    return acc;"
            ),
            Op::Matmul => format!(
                "let r = i / p.c; let j = i % p.c;\n    var acc = {z};\n    for (var q = 0u; q < p.k; q++) {{ acc = acc + ld1(r * p.k + q) * ld2(q * p.c + j); }}\n    return acc;"
            ),
            Op::MatmulTn => format!(
                "let r = i / p.c; let j = i % p.c;\n    var acc = {z};\n    for (var q = 0u; q < p.k; q++) {{ acc = acc + ld1(q * p.m + r) * ld2(q * p.c + j); }}\n    return acc;"
            ),
            Op::MatmulNt => format!(
                "let r = i / p.c; let j = i % p.c;\n    var acc = {z};\n    for (var q = 0u; q < p.k; q++) {{ acc = acc + ld1(r * p.k + q) * ld2(j * p.k + q); }}\n    return acc;"
            ),
            Op::SoftmaxGrad => format!(
                "let base = (i / p.c) * p.c;
    var mx = ld2(base);
    for (var j = 1u; j < p.c; j++) {{ let zj = ld2(base + j); if (zj > mx) {{ mx = zj; }} }}
    var s = {z};
    for (var j = 0u; j < p.c; j++) {{ s = s + {exp}(ld2(base + j) - mx); }}
    let e = {exp}(ld2(i) - mx);
    return (e / s - ld3(i)) * p.a;"
            ),
            Op::SoftmaxRows => format!(
                "let base = i * p.c;
    var mx = ld2(base);
    for (var j = 1u; j < p.c; j++) {{ let zj = ld2(base + j); if (zj > mx) {{ mx = zj; }} }}
    var s = {z};
    for (var j = 0u; j < p.c; j++) {{ s = s + {exp}(ld2(base + j) - mx); }}
    let lse = mx + {ln}(s);
    var row = {z};
    for (var j = 0u; j < p.c; j++) {{ row = row + ld3(base + j) * (lse - ld2(base + j)); }}
    return row;"
            ),
            Op::SoftmaxLoss => format!(
                "var total = {z};
    for (var r = 0u; r < p.m; r++) {{ total = total + ld4(r); }}
    return total;"
            ),
        }
    }
}

/// The binding of the softmax scratch (one computation-type value per row).
pub(super) const SCRATCH: usize = 4;

/// The cache key of a built-in shader.
pub(super) fn key(op: Op, ty: Ty) -> String {
    format!("{}.{}", op.name(), ty.name())
}

/// The key of the fill shader (one for every dtype).
pub(super) const FILL_KEY: &str = "fill.words";

fn push_block(ty: Ty) -> String {
    let s = if ty.wide_scalars() { "f64" } else { "f32" };
    format!("struct P {{ n: u32, m: u32, k: u32, c: u32, a: {s}, b: {s} }}\nvar<immediate> p: P;\n")
}

const CONVERSIONS: &str = r#"
fn isnan32(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn h2f(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let man = h & 0x3ffu;
    var bits = sign;
    if (e == 0u) {
        if (man != 0u) {
            var ex = 113u;
            var m = man;
            loop {
                if ((m & 0x400u) != 0u) { break; }
                m = m << 1u;
                ex = ex - 1u;
            }
            bits = sign | (ex << 23u) | ((m & 0x3ffu) << 13u);
        }
    } else if (e == 0x1fu) {
        var quiet = 0u;
        if (man != 0u) { quiet = 0x400000u; }
        bits = sign | 0x7f800000u | quiet | (man << 13u);
    } else {
        bits = sign | ((e + 112u) << 23u) | (man << 13u);
    }
    return bitcast<f32>(bits);
}

fn f2h(x: f32) -> u32 {
    let bits = bitcast<u32>(x);
    let sign = (bits >> 16u) & 0x8000u;
    let e8 = i32((bits >> 23u) & 0xffu);
    let man = bits & 0x7fffffu;
    if (e8 == 0xff) {
        var nan = 0u;
        if (man != 0u) { nan = 0x200u; }
        return sign | 0x7c00u | nan | (man >> 13u);
    }
    let e = e8 - 112;
    if (e >= 0x1f) { return sign | 0x7c00u; }
    if (e <= 0) {
        if (e < -10) { return sign; }
        let m = man | 0x800000u;
        let shift = u32(14 - e);
        let half = 1u << (shift - 1u);
        let rem = m & ((1u << shift) - 1u);
        var o = m >> shift;
        if (rem > half || (rem == half && (o & 1u) == 1u)) { o = o + 1u; }
        return sign | o;
    }
    var o = (u32(e) << 10u) | (man >> 13u);
    let rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (o & 1u) == 1u)) { o = o + 1u; }
    return sign | o;
}

fn b2f(h: u32) -> f32 {
    if ((h & 0x7fffu) > 0x7f80u) { return bitcast<f32>((h | 0x40u) << 16u); }
    return bitcast<f32>(h << 16u);
}

fn f2b(x: f32) -> u32 {
    let bits = bitcast<u32>(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { return ((bits >> 16u) | 0x40u) & 0xffffu; }
    let round = 0x7fffu + ((bits >> 16u) & 1u);
    return ((bits + round) >> 16u) & 0xffffu;
}
"#;

/// `exp` and `log` for `f64` (SPIR-V's GLSL.std.450 has no 64-bit `Exp`/`Log`): range
/// reduction plus polynomials, accurate to a few units in the last place.
const F64_MATH: &str = r#"
fn exp64(x: f64) -> f64 {
    if (x != x) { return x; }
    if (x < -745.5lf) { return 0.0lf; }
    let xc = min(x, 710.0lf);
    let k = round(xc * 1.4426950408889634lf);
    let r = (xc - k * 6.93147180369123816490e-01lf) - k * 1.90821492927058770002e-10lf;
    var q = 1.0lf;
    for (var j = 14; j >= 1; j--) { q = 1.0lf + q * r / f64(j); }
    return ldexp(q, i32(k));
}

fn ln64(s: f64) -> f64 {
    if (s != s || s > 1.7976931348623157e308lf) { return s; }
    if (s <= 0.0lf) { return f64(log(f32(s))); }
    // s = m * 2^e with m in [sqrt(1/2), sqrt(2)); exact scalings by powers of two.
    var x = s;
    var e = 0;
    while (x > 1.0e30lf) { x = x * 5.421010862427522e-20lf; e = e + 64; }
    while (x < 1.0e-30lf) { x = x * 18446744073709551616.0lf; e = e - 64; }
    let e0 = i32(floor(log2(f32(x))));
    var m = ldexp(x, -e0);
    e = e + e0;
    while (m >= 1.4142135623730951lf) { m = m * 0.5lf; e = e + 1; }
    while (m < 0.7071067811865476lf) { m = m * 2.0lf; e = e - 1; }
    let t = (m - 1.0lf) / (m + 1.0lf);
    let t2 = t * t;
    var sum = 0.0lf;
    for (var j = 41; j >= 1; j -= 2) { sum = sum * t2 + 1.0lf / f64(j); }
    return 2.0lf * t * sum + f64(e) * 0.69314718055994530942lf;
}
"#;

/// The WGSL source of a built-in shader.
pub(super) fn source(op: Op, ty: Ty) -> String {
    let writes = op.writes();
    let mut s = String::new();
    s.push_str(&push_block(ty));
    for (k, w) in writes.iter().enumerate() {
        let access = if *w { "read_write" } else { "read" };
        let elem = if k == SCRATCH {
            ty.comp()
        } else {
            ty.storage()
        };
        s.push_str(&format!(
            "@group(0) @binding({k}) var<storage, {access}> b{k}: array<{elem}>;\n"
        ));
    }
    s.push_str(CONVERSIONS);
    if ty == Ty::F64 {
        s.push_str(F64_MATH);
    }
    let c = ty.comp();
    for k in 0..writes.len() {
        let load = match ty {
            _ if k == SCRATCH => format!("b{k}[i]"),
            Ty::F16 => format!("h2f((b{k}[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu)"),
            Ty::Bf16 => format!("b2f((b{k}[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu)"),
            _ => format!("b{k}[i]"),
        };
        s.push_str(&format!("fn ld{k}(i: u32) -> {c} {{ return {load}; }}\n"));
    }
    s.push_str(&format!(
        "fn body(i: u32) -> {c} {{\n    {}\n}}\n",
        op.body(ty)
    ));
    let o = op.output();
    let (count, store) = if ty.packed() && o != SCRATCH {
        let pack = if ty == Ty::F16 { "f2h" } else { "f2b" };
        (
            "(p.n + 1u) / 2u".to_string(),
            format!(
                "let e = w * 2u;
        let lo = {pack}(body(e));
        var hi = b{o}[w] >> 16u;
        if (e + 1u < p.n) {{ hi = {pack}(body(e + 1u)); }}
        b{o}[w] = lo | (hi << 16u);"
            ),
        )
    } else {
        ("p.n".to_string(), format!("b{o}[w] = body(w);"))
    };
    s.push_str(&grid_main(&count, &store));
    s
}

fn grid_main(count: &str, store: &str) -> String {
    format!(
        "@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    let stride = nwg.x * {WORKGROUP}u;
    let count = {count};
    var w = gid.x;
    loop {{
        if (w >= count) {{ break; }}
        {store}
        w = w + stride;
    }}
}}
"
    )
}

/// The fill shader: writes a 64-bit pattern (`k` = low word, `c` = high word) over the
/// first `n` bytes of `b0`, word by word, keeping the bytes of a partial last word past `n`.
pub(super) fn fill_source() -> String {
    let mut s = push_block(Ty::F32);
    s.push_str("@group(0) @binding(0) var<storage, read_write> b0: array<u32>;\n");
    s.push_str(&grid_main(
        "(p.n + 3u) / 4u",
        "var v = p.k;
        if ((w & 1u) == 1u) { v = p.c; }
        if ((w + 1u) * 4u <= p.n) {
            b0[w] = v;
        } else {
            let mask = (1u << ((p.n & 3u) * 8u)) - 1u;
            b0[w] = (b0[w] & ~mask) | (v & mask);
        }",
    ));
    s
}

/// How many loop items a shader over `n` elements of `ty` has (words for packed types).
pub(super) fn items(ty: Ty, n: u64) -> u64 {
    if ty.packed() {
        n.div_ceil(2)
    } else {
        n
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    const OPS: [Op; 16] = [
        Op::Add,
        Op::Scale,
        Op::ScaleInPlace,
        Op::Axpy,
        Op::SgdStep,
        Op::Relu,
        Op::ReluBackward,
        Op::Mul,
        Op::AddRowBias,
        Op::SumRows,
        Op::Matmul,
        Op::MatmulTn,
        Op::MatmulNt,
        Op::SoftmaxGrad,
        Op::SoftmaxRows,
        Op::SoftmaxLoss,
    ];

    /// Every shader the built-ins can ask for compiles (no device needed).
    #[test]
    fn every_builtin_shader_compiles() {
        for ty in [Ty::F32, Ty::F64, Ty::F16, Ty::Bf16] {
            for op in OPS {
                let src = source(op, ty);
                if let Err(e) = super::super::kernels::compile_wgsl(&src, true) {
                    panic!("{}: {e}\n{src}", key(op, ty));
                }
            }
        }
        let src = source(Op::Add, Ty::I32);
        if let Err(e) = super::super::kernels::compile_wgsl(&src, false) {
            panic!("add.i32: {e}\n{src}");
        }
        if let Err(e) = super::super::kernels::compile_wgsl(&fill_source(), false) {
            panic!("fill: {e}");
        }
    }
}
