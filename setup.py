"""Builds hsync._C, the compiled core, with torch.utils.cpp_extension and ninja.

The C++ core (engine, buckets, gloo/process-group communicator, CPU kernels) always builds.
The CUDA kernels and the NCCL communicator build whenever a CUDA toolkit is found.

Switches (environment variables):
  HSYNC_WITH_CUDA=0|1     force the CUDA+NCCL part off or on (default: on when nvcc is found)
  CUDA_HOME               the CUDA toolkit root (default: derived from the real nvcc on PATH, or
                          in /usr/local/cuda/bin)
  TORCH_CUDA_ARCH_LIST    GPU architectures to compile for (default: kDefaultCudaArchs below)
  HSYNC_DEBUG=1           build with -O0 -g
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pybind11
from setuptools import Extension, setup

# Ampere, Ada, Hopper as cubins; PTX of Hopper so newer GPUs JIT-compile it.
kDefaultCudaArchs = "8.0;8.6;8.9;9.0+PTX"


def find_cuda_home() -> str | None:
    """The toolkit root, from CUDA_HOME or from the real compiler behind nvcc (it may be a wrapper), on
    PATH or, as torch looks for it, in /usr/local/cuda."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if nvcc is None:
        return None
    dry = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", "/dev/null"], capture_output=True, text=True)
    match = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    return match.group(1).strip() if match else None


cuda_home = find_cuda_home()
with_cuda = os.environ.get("HSYNC_WITH_CUDA", "1" if cuda_home else "0") == "1"
if with_cuda:
    if cuda_home is None:
        sys.exit("HSYNC_WITH_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME or put nvcc on PATH")
    # torch.utils.cpp_extension reads CUDA_HOME once, when it is imported.
    os.environ["CUDA_HOME"] = cuda_home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", kDefaultCudaArchs)

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

debug = os.environ.get("HSYNC_DEBUG") == "1"
opt = ["-O0", "-g"] if debug else ["-O3"]
# Files that need CUDA and NCCL; everything else under csrc/ is the always-built core.
cuda_sources = ["csrc/comm/nccl_comm.cpp", "csrc/kernels/pack_cuda.cpp", *glob.glob("csrc/kernels/*.cu")]
# csrc/planner/ is hsync._planner, a module of its own without torch.
planner_sources = sorted(glob.glob("csrc/planner/*.cpp"))
sources = sorted(set(glob.glob("csrc/**/*.cpp", recursive=True)) - set(cuda_sources) - set(planner_sources))
extra = {"cxx": list(opt)}
link_args = []
kwargs = {"include_dirs": [os.path.abspath("csrc")]}
# at::parallel_for is OpenMP inlined into our code: without -fopenmp the CPU pack runs on one thread
# whatever torch.set_num_threads says. The loader resolves libgomp.so.1 to the copy torch has loaded.
if "OpenMP" in torch.__config__.parallel_info():
    extra["cxx"].append("-fopenmp")
    link_args.append("-fopenmp")


def nvidia_wheel_dir(name: str) -> str | None:
    """Where pip put nvidia/<name> of the CUDA wheels torch runs on (nccl, cu13), if anywhere."""
    try:
        spec = importlib.util.find_spec(f"nvidia.{name}")
    except ModuleNotFoundError:
        return None
    return next(iter(spec.submodule_search_locations), None) if spec else None


if with_cuda:
    # The NCCL that torch itself runs on: one libnccl in the process.
    nccl_dir = nvidia_wheel_dir("nccl")
    if nccl_dir is None or not os.path.isfile(os.path.join(nccl_dir, "include", "nccl.h")):
        sys.exit("HSYNC_WITH_CUDA: NCCL's headers were not found; install the nvidia-nccl wheel torch names "
                 "(pip show torch lists it)")
    nccl_lib = os.path.join(nccl_dir, "lib")
    include_dirs = [os.path.join(nccl_dir, "include")]
    # A toolkit of the compiler alone lacks the library headers torch's include (cublas_v2.h, ...);
    # those come from the wheel then, never mixed with a full toolkit's own.
    cu13_dir = nvidia_wheel_dir("cu13")
    if not os.path.isfile(os.path.join(cuda_home, "include", "cublas_v2.h")) and cu13_dir is not None:
        include_dirs.append(os.path.join(cu13_dir, "include"))
    sources += sorted(cuda_sources)
    extra["cxx"].append("-DHSYNC_WITH_CUDA")
    extra["nvcc"] = [*opt, "-DHSYNC_WITH_CUDA", "--expt-relaxed-constexpr"]
    kwargs = dict(
        include_dirs=kwargs["include_dirs"] + include_dirs,
        library_dirs=[nccl_lib],
        extra_link_args=[*link_args, f"-Wl,-rpath,{nccl_lib}", "-l:libnccl.so.2"],
    )
    extension = CUDAExtension
else:
    kwargs["extra_link_args"] = link_args
    extension = CppExtension



class BuildKeepingObjects(BuildExtension):
    """torch's BuildExtension with its object files kept in build/objects: an editable install builds in a
    temporary folder otherwise, and every install compiled everything again. Ninja rebuilds what changed."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "objects")


# The split search: plain C++ and pybind11. No contraction into fused multiply-adds, so that every
# machine computes the same split from the same numbers (Note [Split search]).
planner = Extension("hsync._planner", planner_sources, include_dirs=[pybind11.get_include()], language="c++",
                    extra_compile_args={"cxx": [*opt, "-std=c++17", "-ffp-contract=off"]})

setup(
    ext_modules=[extension("hsync._C", sources, extra_compile_args=extra, **kwargs), planner],
    cmdclass={"build_ext": BuildKeepingObjects},
)
