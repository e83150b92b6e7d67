include!("torch_link.rs");

fn main() {
    if std::env::var_os("CARGO_FEATURE_TORCH").is_some() {
        link_libtorch();
        #[cfg(feature = "torch")]
        shim::build();
    }
}

/// Compiles shim/allocator.cpp (the caching-allocator shim) against the libtorch tch uses.
#[cfg(feature = "torch")]
mod shim {
    use std::path::{Path, PathBuf};

    pub fn build() {
        println!("cargo:rerun-if-changed=shim/allocator.cpp");
        println!("cargo:rerun-if-changed=shim/allocator.h");
        println!("cargo:rerun-if-changed=shim/autocast.cpp");
        println!("cargo:rerun-if-env-changed=GPUPROBE_CUDA_INCLUDE");
        println!("cargo:rerun-if-env-changed=CUDA_HOME");
        let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
            // link_libtorch has already warned; tch's own build fails in this case anyway.
            return;
        };
        let lib = PathBuf::from(lib);
        let include = lib.join("../include");
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .std("c++17")
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .include("shim")
            .file("shim/allocator.cpp")
            .file("shim/autocast.cpp");
        // -isystem: libtorch's headers are not ours to keep warning-free.
        for dir in [include.clone(), include.join("torch/csrc/api/include")] {
            build.flag("-isystem").flag(dir.display().to_string());
        }
        let c10_cuda = lib.join("libc10_cuda.so").exists();
        match (c10_cuda, cuda_runtime_include(&lib)) {
            (true, Some(cuda)) => {
                build
                    .define("GPUPROBE_SHIM_CUDA", None)
                    .flag("-isystem")
                    .flag(cuda.display().to_string());
                println!("cargo:rustc-link-search=native={}", lib.display());
                println!("cargo:rustc-link-lib=dylib=c10_cuda");
            }
            (false, _) => println!(
                "cargo:warning=no libc10_cuda.so in {}: a CPU-only libtorch, so the allocator \
                 shim will always report CUDA as not initialised",
                lib.display()
            ),
            (true, None) => println!(
                "cargo:warning=no CUDA headers with crt/ found (looked next to libtorch, in the \
                 nvidia-* wheels, CUDA_HOME, /usr/local/cuda and triton; set \
                 GPUPROBE_CUDA_INCLUDE): \
                 the allocator shim is built without CUDA and reports it as not initialised"
            ),
        }
        build.compile("gpuprobe_allocator_shim");
    }

    /// A directory of CUDA headers complete enough for c10's CUDA headers: `cuda_runtime_api.h`
    /// and the `crt/` headers it includes. PyPI's torch ships none. The nvidia-* wheels next to
    /// it have `cuda_runtime_api.h` but (without `nvidia-cuda-crt`) no `crt/`; triton, which
    /// PyPI's torch depends on, ships a complete set. Only types and declarations are used, so
    /// a minor version mismatch with the CUDA torch was built for does not matter.
    fn cuda_runtime_include(lib: &Path) -> Option<PathBuf> {
        let complete = |dir: &Path| {
            dir.join("cuda_runtime_api.h").is_file() && dir.join("crt/host_defines.h").is_file()
        };
        if let Some(dir) = std::env::var_os("GPUPROBE_CUDA_INCLUDE") {
            return Some(PathBuf::from(dir)).filter(|d| complete(d));
        }
        let mut candidates = vec![lib.join("../include")];
        if let Some(site_packages) = lib.parent().and_then(Path::parent) {
            if let Ok(entries) = std::fs::read_dir(site_packages.join("nvidia")) {
                let mut dirs: Vec<PathBuf> = entries
                    .filter_map(Result::ok)
                    .map(|e| e.path().join("include"))
                    .collect();
                // Newest CUDA first (cu13 before cu12).
                dirs.sort();
                dirs.reverse();
                candidates.extend(dirs);
            }
            if let Some(home) = std::env::var_os("CUDA_HOME") {
                candidates.push(PathBuf::from(home).join("include"));
            }
            candidates.push(PathBuf::from("/usr/local/cuda/include"));
            candidates.push(site_packages.join("triton/backends/nvidia/include"));
        }
        candidates.into_iter().find(|d| complete(d))
    }
}
