"""Brings vLLM 0.33's Python side to a GPU machine that has no vLLM and no network.

The GPU image (Python 3.12, torch 2.11, triton 3.6) lacks vLLM and some of the
modules its import chain needs. vLLM's wheel is 336 MB, almost all of it
compiled CUDA extensions that this project never loads (its backend runs
tq_torch's Triton kernels, and the peer tests call vLLM's Triton kernels), so:

``python tests/vllm/gpu_carry.py build`` (here, with network) writes the
git-ignored folder ``.vllm_gpu/`` (about 26 MB):

* ``vllm-0.33.0-python.tar.gz``: the wheel's Python modules, data files and
  ``.dist-info`` (no ``.so``, no ``vllm-rs``, no CUDA/C++ headers);
* ``wheels/``: cp312 manylinux wheels of the modules vLLM imports that the
  GPU image does not have (`CARRY`).

``python3 tests/vllm/gpu_carry.py install DIR`` (there, offline) installs both
into DIR; then ``PYTHONPATH=.:DIR python3 -m pytest -m gpu tests/vllm``. With no
compiled extensions vLLM cannot use its CUDA platform (it imports FlashAttention's
extension), so the tests select its CPU platform (`vllm_testlib.import_vllm`);
the kernels under test still run on the GPU.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, ".vllm_gpu")
VLLM = "vllm==0.33.0"
# Imported by vLLM 0.33's config / backend / registry / plugin modules and absent from the GPU
# image's package list (/work/.library/device/KINDS.md), pinned like .ci/vllm-cpu-requirements.txt.
CARRY = [
    "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2",
    "cbor2==6.3.0", "pyzmq==27.3.0", "msgspec==0.22.0", "cachetools==8.0.1",
    "pybase64==1.5.1", "openai==2.30.0", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1",
    "openai-harmony==0.0.8", "fastapi==0.136.3", "starlette==1.10.0", "annotated-doc==0.0.7",
    "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "llguidance==1.7.6", "partial-json-parser==0.2.1.1.post7",
]
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
DROP_EXT = (".so", ".hpp", ".h", ".cuh", ".inl", ".cu", ".cpp", ".cc", ".c", ".js", ".css", ".jpg", ".png", ".map")


def _keep(name: str) -> bool:
    if name.endswith(DROP_EXT) or name == "vllm/vllm-rs" or name.endswith(".dist-info/RECORD"):
        return False
    return "/include/" not in name or not name.startswith("vllm/third_party/")


def build() -> None:
    os.makedirs(os.path.join(OUT, "wheels"), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", VLLM, "-d", tmp], check=True)
        (wheel,) = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        target = os.path.join(OUT, "vllm-0.33.0-python.tar.gz")
        kept = 0
        with zipfile.ZipFile(os.path.join(tmp, wheel)) as z, tarfile.open(target, "w:gz") as tar:
            for info in z.infolist():
                if info.is_dir() or not _keep(info.filename):
                    continue
                data = z.read(info)
                ti = tarfile.TarInfo(info.filename)
                ti.size, ti.mode = len(data), 0o644
                tar.addfile(ti, io.BytesIO(data))
                kept += 1
        print(f"{target}: {kept} files, {os.path.getsize(target) / 2**20:.1f} MiB")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", os.path.join(OUT, "wheels")]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + CARRY, check=True)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"{OUT}: {total / 2**20:.1f} MiB in all")


def install(target: str) -> None:
    os.makedirs(target, exist_ok=True)
    wheels = sorted(os.path.join(OUT, "wheels", f) for f in os.listdir(os.path.join(OUT, "wheels")))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", target, *wheels], check=True)
    with tarfile.open(os.path.join(OUT, "vllm-0.33.0-python.tar.gz")) as tar:
        tar.extractall(target, filter="data")
    print(f"vLLM 0.33.0 (Python files) and {len(wheels)} wheels in {target}; use PYTHONPATH=.:{target}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="download and trim into .vllm_gpu/ (needs network)")
    sub.add_parser("install", help="install .vllm_gpu/ into DIR (offline)").add_argument("dir")
    args = ap.parse_args(argv)
    build() if args.cmd == "build" else install(args.dir)


if __name__ == "__main__":
    main()
