//! Sizes as people read them.

/// `1.35 TiB`, `96.00 GiB`, `1.34 MiB`: binary units, as memory sizes are given.
pub fn fmt_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    let k = 1024f64;
    for (unit, scale) in [
        ("TiB", k.powi(4)),
        ("GiB", k.powi(3)),
        ("MiB", k.powi(2)),
        ("KiB", k),
    ] {
        if b >= scale {
            return format!("{:.2} {unit}", b / scale);
        }
    }
    format!("{bytes} B")
}
