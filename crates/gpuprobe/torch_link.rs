// Shared by the build scripts of gpuprobe and gpukernel (included with `include!`).
//
// tch links libtorch with `--as-needed`, so a binary that never names a libtorch_cuda symbol
// drops it and `tch::Cuda::is_available()` turns false. Only direct dependents of torch-sys see
// `DEP_TCH_LIBTORCH_LIB`, hence a copy of this in each crate that builds binaries or tests.

/// Adds an rpath to libtorch's directory and keeps libtorch_cuda linked when it exists.
fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!("cargo:warning=DEP_TCH_LIBTORCH_LIB is unset: is torch-sys a direct dependency?");
        return;
    };
    // RUNPATH (new dtags), so LD_LIBRARY_PATH on another machine can still point elsewhere.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-L{lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
