"""Builds ``recompile_runner`` (runner.cpp) against the installed torch's libtorch and this Python's libpython:
``python -m recompile.runtime.cpp_runner.build [OUT_DIR]`` prints the executable's path. The include and library paths are
``torch.utils.cpp_extension``'s (the headers and libraries the installed torch ships); the compiler is $CXX or
c++ (C++17). The runner finds torch's Python package (for the ops defined in Python) in the site-packages of the
Python that built it."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))


def command(out: str) -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    libdir = sysconfig.get_config_var("LIBDIR")
    python = f"python{sysconfig.get_config_var('LDVERSION')}"
    torch_libs = library_paths()
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))  # where the embedded interpreter finds torch
    return ([os.environ.get("CXX", "c++"), "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             os.path.join(HERE, "runner.cpp"), "-o", out, f'-DRECOMPILE_SITE_PACKAGES="{site_packages}"', f"-I{sysconfig.get_paths()['include']}"]
            + [f"-I{p}" for p in include_paths()]
            + [f"-L{p}" for p in torch_libs] + [f"-Wl,-rpath,{p}" for p in torch_libs]
            + [f"-L{libdir}", f"-Wl,-rpath,{libdir}", f"-l{python}",
               "-ltorch", "-ltorch_cpu", "-lc10", "-ldl"])


def build(out_dir: str) -> str:
    """Compile the runner into ``out_dir``; returns its path (raises with the compiler's output on failure)."""
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "recompile_runner")
    proc = subprocess.run(command(out), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"building recompile_runner failed:\n{proc.stderr[-4000:]}")
    return out


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "build")))
