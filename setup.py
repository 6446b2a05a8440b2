"""Builds rudnn._C: the CPU kernels always, the CUDA kernels when torch is a CUDA build and nvcc is found."""
import glob
import importlib.util
import os

import shutil
import subprocess

import torch
from setuptools import setup


def nvcc_toolkit_root():
    """The toolkit of the nvcc on PATH, as nvcc itself reports it (nvcc may be a wrapper script
    outside its toolkit, where torch's guess from its location would miss the libraries)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    dry = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True)
    for line in (dry.stdout + dry.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())
    return None


if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and nvcc_toolkit_root():
    os.environ["CUDA_HOME"] = nvcc_toolkit_root()

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def default_cuda_arch():
    """The visible GPU's architecture, or sm_90a (Hopper, wgmma) where there is none."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return "9.0a"


def pip_cuda_include_dirs():
    """Headers of torch's own CUDA pip dependencies (nvidia/*/include). Searched after the
    toolkit's: where the local toolkit is a compiler only, they hold the library headers (cuSPARSE,
    cuBLAS) that ATen's CUDA headers include."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(d for loc in spec.submodule_search_locations for d in glob.glob(os.path.join(loc, "*", "include")))


def extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    cxx = ["-O3"]
    if cuda_sources and torch.version.cuda is not None and CUDA_HOME is not None:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", default_cuda_arch())
        # Host files that include ATen's CUDA headers need the library headers as well.
        pip_includes = [f for d in pip_cuda_include_dirs() for f in ("-isystem", d)]
        # The wgmma forward (csrc/cuda/wgmma.cuh) exists only in builds for sm_90a.
        archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
        wgmma = any(arch.startswith("9.0a") for arch in archs)
        return CUDAExtension(
            "rudnn._C",
            sources + cuda_sources,
            define_macros=[("RUDNN_WITH_CUDA", None)] + ([("RUDNN_WGMMA", None)] if wgmma else []),
            extra_compile_args={"cxx": cxx + pip_includes, "nvcc": ["-O3", "-lineinfo"] + pip_includes},
        )
    return CppExtension("rudnn._C", sources, extra_compile_args={"cxx": cxx})


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
