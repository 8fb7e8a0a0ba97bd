"""Builds hsync._C, the compiled core, with torch.utils.cpp_extension and ninja.

The C++ core (engine, buckets, gloo/process-group communicator, CPU kernels) always builds.
The CUDA kernels and the NCCL communicator build whenever a CUDA toolkit is found.

Switches (environment variables):
  HSYNC_WITH_CUDA=0|1     force the CUDA+NCCL part off or on (default: on when nvcc is found)
  CUDA_HOME               the CUDA toolkit root (default: derived from the real nvcc on PATH)
  TORCH_CUDA_ARCH_LIST    GPU architectures to compile for (default: kDefaultCudaArchs below)
  HSYNC_DEBUG=1           build with -O0 -g
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup

# Ampere, Ada, Hopper as cubins; PTX of Hopper so newer GPUs JIT-compile it.
kDefaultCudaArchs = "8.0;8.6;8.9;9.0+PTX"


def find_cuda_home() -> str | None:
    """The toolkit root, from CUDA_HOME or from the real compiler behind nvcc (it may be a wrapper)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    if shutil.which("nvcc") is None:
        return None
    dry = subprocess.run(["nvcc", "-dryrun", "-c", "-x", "cu", "/dev/null"], capture_output=True, text=True)
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

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

debug = os.environ.get("HSYNC_DEBUG") == "1"
opt = ["-O0", "-g"] if debug else ["-O3"]
# Files that need CUDA and NCCL; everything else under csrc/ is the always-built core.
cuda_sources = ["csrc/comm/nccl_comm.cpp", "csrc/kernels/pack_cuda.cpp", *glob.glob("csrc/kernels/*.cu")]
sources = sorted(set(glob.glob("csrc/**/*.cpp", recursive=True)) - set(cuda_sources))
extra = {"cxx": list(opt)}
kwargs = {"include_dirs": [os.path.abspath("csrc")]}

if with_cuda:
    # The pip-installed CUDA libraries and NCCL that torch itself runs on.
    site = sysconfig.get_paths()["purelib"]
    nccl_lib = os.path.join(site, "nvidia", "nccl", "lib")
    include_dirs = [os.path.join(site, "nvidia", sub, "include") for sub in ("cu13", "nccl")]
    sources += sorted(cuda_sources)
    extra["cxx"].append("-DHSYNC_WITH_CUDA")
    extra["nvcc"] = [*opt, "-DHSYNC_WITH_CUDA", "--expt-relaxed-constexpr"]
    kwargs = dict(
        include_dirs=kwargs["include_dirs"] + [d for d in include_dirs if os.path.isdir(d)],
        library_dirs=[nccl_lib],
        extra_link_args=[f"-Wl,-rpath,{nccl_lib}", "-l:libnccl.so.2"],
    )
    extension = CUDAExtension
else:
    extension = CppExtension

setup(
    ext_modules=[extension("hsync._C", sources, extra_compile_args=extra, **kwargs)],
    cmdclass={"build_ext": BuildExtension},
)
