"""What machine a benchmark ran on: CPU model and flags, GPUs, versions (TensorFlow is not imported)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Optional

from benchlib.rows import Settings


def count_gpus() -> int:
    """NVIDIA GPUs nvidia-smi lists (0 without it); TensorFlow is not imported for this."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _version(package: str, python: Optional[str] = None) -> Optional[str]:
    # Not realpath: venvs' pythons link to one interpreter but see different site-packages.
    if python and os.path.abspath(python) != os.path.abspath(sys.executable):
        code = f"import importlib.metadata as m; print(m.version({package!r}))"
        result = subprocess.run([python, "-c", code], capture_output=True, text=True)
        return result.stdout.strip() or None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts(gpus: int, settings: Settings) -> dict:
    model, flags, ids = None, [], {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                for key in ("cpu family", "model", "stepping"):
                    if line.split(":")[0].strip() == key:
                        ids.setdefault(key, line.split(":", 1)[1].strip())
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    facts = {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_id": ", ".join(f"{k} {v}" for k, v in ids.items()),
        "cpu_cores": os.cpu_count(),
        "cpu_bf16_flags": sorted(set(flags) & {"amx_bf16", "avx512_bf16"}),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow"),
        "keras": _version("keras"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if gpus and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        facts["gpu_models"] = [line.split(":", 1)[1].split("(")[0].strip() for line in out.splitlines()
                               if line.startswith("GPU ")]
    if settings.horovod_python:
        facts["horovod_python"] = settings.horovod_python
        facts["horovod_tensorflow"] = _version("tensorflow", settings.horovod_python)
        facts["horovod"] = _version("horovod", settings.horovod_python)
    return facts


