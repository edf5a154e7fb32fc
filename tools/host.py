"""The machine a measurement ran on, recorded in every results file the tools write.

Int8 speed and numerics depend on the CPU's instruction sets: ONNX Runtime's U8S8 kernels
use VNNI where the CPU has it and can saturate on AVX2 or AVX-512 without it, so a figure
from an Intel CPU with VNNI and one from an AMD EPYC with AVX2 only are not comparable.
`describe()` reads the CPU model and the x86 flags that matter from /proc/cpuinfo.
"""

import os
import pathlib
import platform
import re

# The x86 flags that decide which kernels ONNX Runtime and PyTorch run (every amx_* flag too).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")
NOT_RECORDED = "flags not recorded"


def _read(path):
    try:
        return pathlib.Path(path).read_text()
    except OSError:
        return None


def _field(cpuinfo, name):
    """The value of the first `name : value` line of /proc/cpuinfo, or None."""
    match = re.search(rf"^{name}[ \t]*:[ \t]*(.*)$", cpuinfo, re.MULTILINE)  # [ \t]: an empty value is not the next line
    return match.group(1).strip() if match else None


def cpu(cpuinfo=None):
    """{"model", "family", "isa_flags", "vnni"} from the text of /proc/cpuinfo (read when not given).
    family is "family F model M" where the text has both lines, else None: a VM's model name
    can be as bare as "AMD EPYC", which Zen 4 (family 25) and Zen 5 (family 26) both show.
    isa_flags lists the ISA_FLAGS and amx_* flags present, in that order; it is None where
    the text has no flags line (not x86, or /proc/cpuinfo unreadable)."""
    text = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    model = (_field(text, "model name") if text else None) or platform.processor() or "unknown CPU"
    numbers = [_field(text, name) if text else None for name in ("cpu family", "model")]
    family = f"family {numbers[0]} model {numbers[1]}" if all(numbers) else None
    flags_line = _field(text, "flags") if text else None
    if flags_line is None:
        return {"model": model, "family": family, "isa_flags": None, "vnni": None}
    present = set(flags_line.split())
    isa = [flag for flag in ISA_FLAGS if flag in present] + sorted(f for f in present if f.startswith("amx"))
    return {"model": model, "family": family, "isa_flags": isa, "vnni": any(flag in present for flag in VNNI_FLAGS)}


def memory_gib(meminfo=None):
    text = _read("/proc/meminfo") if meminfo is None else meminfo
    match = re.search(r"MemTotal:\s+(\d+)", text or "")
    return round(int(match.group(1)) / 1024 / 1024, 2) if match else None


def describe(cpuinfo=None, meminfo=None):
    """The machine, for a results file: the CPU (model, ISA flags, VNNI), cores, memory and OS."""
    return {"cpu": cpu(cpuinfo), "cores": os.cpu_count(), "memory_gib": memory_gib(meminfo),
            "os": f"{platform.system()} {platform.release()}"}


def summary(machine):
    """One line: 'MODEL (family F model M), N cores, M GiB RAM, OS'."""
    memory = f"{machine['memory_gib']:.0f} GiB RAM" if machine.get("memory_gib") is not None else "RAM unknown"
    return f"{cpu_name(machine)}, {machine['cores']} cores, {memory}, {machine['os']}"


def cpu_name(machine):
    """'MODEL (family F model M)', or MODEL where the family was not recorded (results files
    written before it was), or None without a recorded CPU."""
    recorded = (machine or {}).get("cpu") or {}
    model, family = recorded.get("model"), recorded.get("family")
    return f"{model} ({family})" if model and family else model


def isa_text(machine):
    """The ISA flags of a results file's machine (describe()'s dict) for a report, or NOT_RECORDED
    for a file written before the tools recorded them."""
    flags = ((machine or {}).get("cpu") or {}).get("isa_flags")
    if flags is None:
        return NOT_RECORDED
    vnni = "VNNI" if machine["cpu"]["vnni"] else "no VNNI"
    return f"{', '.join(flags) or 'none of ' + ', '.join(ISA_FLAGS)} ({vnni})"
