"""Builds rudnn._C: the CPU kernels always, the CUDA kernels when torch is a CUDA build and nvcc is found."""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def default_cuda_arch():
    """The visible GPU's architecture, or sm_90a (Hopper, wgmma) where there is none."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return "9.0a"


def extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    cxx = ["-O3"]
    if cuda_sources and torch.version.cuda is not None and CUDA_HOME is not None:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", default_cuda_arch())
        return CUDAExtension(
            "rudnn._C",
            sources + cuda_sources,
            define_macros=[("RUDNN_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
        )
    return CppExtension("rudnn._C", sources, extra_compile_args={"cxx": cxx})


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
