include!("torch_link.rs");

fn main() {
    if std::env::var_os("CARGO_FEATURE_TORCH").is_some() {
        link_libtorch();
    }
}
