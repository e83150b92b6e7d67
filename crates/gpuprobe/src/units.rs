//! Human-readable byte sizes (binary units, as nvidia-smi and PyTorch report them).

/// Formats `bytes` as e.g. `1.50 GiB`, `512.0 MiB`, `17 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if value >= 100.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else if value >= 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn picks_the_largest_unit_below_1024() {
        assert_eq!(human_bytes(17), "17 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(512 * 1024 * 1024), "512 MiB");
        assert_eq!(human_bytes(80 * 1024 * 1024 * 1024), "80.0 GiB");
        assert_eq!(human_bytes(3 * 1024u64.pow(4)), "3.00 TiB");
    }
}
