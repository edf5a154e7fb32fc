"""Every results file records the machine through one helper, tools/host.py: the CPU model and
the x86 flags that decide int8 speed and numerics (VNNI or not), read from /proc/cpuinfo; the
benchmark report shows them, and says so where an older results file did not record them."""

import ast
import pathlib

from tools import host
from tools.bench import report

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = pathlib.Path(__file__).parent / "data/bench_results_smoke.json"

INTEL_VNNI = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw \
avx512vl avx_vnni avx512_bf16 avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw \
avx512vl avx_vnni avx512_bf16 avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8
"""

AMD_EPYC_AVX2 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes \
xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch \
osvw topoext ssbd ibrs ibpb stibp vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx smap \
clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr arat npt nrip_save umip rdpid
"""

MEMINFO = "MemTotal:       24632700 kB\nMemFree:         1000000 kB\n"


def test_an_intel_cpu_with_vnni_and_amx():
    cpu = host.cpu(INTEL_VNNI)
    assert cpu == {"model": "Intel(R) Xeon(R) Platinum 8480+", "family": None,  # no family lines in this text
                   "isa_flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
                                 "amx_tile"],
                   "vnni": True}


def test_an_amd_epyc_with_avx2_only():
    cpu = host.cpu(AMD_EPYC_AVX2)
    assert cpu == {"model": "AMD EPYC 7B12", "family": "family 23 model 49", "isa_flags": ["avx2", "fma"],
                   "vnni": False}
    machine = host.describe(AMD_EPYC_AVX2, MEMINFO)
    assert host.isa_text(machine) == "avx2, fma (no VNNI)"
    assert host.summary(machine).startswith("AMD EPYC 7B12 (family 23 model 49), ")
    assert ", 23 GiB RAM, " in host.summary(machine)


def test_no_flags_line_is_not_an_empty_flag_list():
    cpu = host.cpu("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu == {"model": "Some CPU", "family": None, "isa_flags": None, "vnni": None}
    assert host.isa_text({"cpu": cpu}) == host.NOT_RECORDED
    # x86 without any of the flags: say which were looked for
    machine = {"cpu": host.cpu("model name\t: Old\nflags\t\t: fpu sse sse2\n")}
    assert host.isa_text(machine) == "none of avx2, fma, avx512f, avx512_vnni, avx_vnni (no VNNI)"


def test_a_results_file_without_the_family_still_has_a_summary():
    machine = {**host.describe(AMD_EPYC_AVX2, MEMINFO), "cpu": {"model": "AMD EPYC", "isa_flags": [], "vnni": False}}
    assert host.summary(machine).startswith("AMD EPYC, ")


def test_this_machine_is_described():
    machine = host.describe()
    assert machine["cpu"]["model"] and machine["cores"] >= 1 and machine["os"]


def test_the_report_shows_the_flags_or_says_they_were_not_recorded(tmp_path):
    results = report.load(FIXTURE)
    assert "host" not in results["meta"]  # a results file from before the flags were recorded
    report.write(results, tmp_path / "old.md", tmp_path / "plots")
    assert "- CPU instruction sets (int8 speed and numerics depend on them): flags not recorded." in (
        tmp_path / "old.md").read_text()

    results["meta"]["host"] = host.describe(INTEL_VNNI, MEMINFO)
    report.write(results, tmp_path / "new.md", tmp_path / "plots")
    assert ("- CPU instruction sets (int8 speed and numerics depend on them): avx2, fma, avx512f, avx512_vnni, "
            "avx_vnni, amx_bf16, amx_int8, amx_tile (VNNI).") in (tmp_path / "new.md").read_text()


def test_every_tool_that_writes_results_records_the_machine_through_the_helper():
    writers = ["tools/bench/run.py", "tools/bench/streaming.py", "tools/bench/openai_front.py", "tools/soak.py",
               "tools/overload.py", "tools/rehearse_scaling.py", "tools/classifier_accuracy.py",
               "tools/int8_cross_cpu.py", "tools/mutation/run.py", "tools/bench/cpu_profile.py"]
    for path in writers:
        tree = ast.parse((REPO / path).read_text())
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and ast.unparse(node.func) == "host.describe"]
        assert calls, f"{path} writes a results file without host.describe()"
    # and no tool reads /proc/cpuinfo itself
    readers = [path for path in (REPO / "tools").rglob("*.py")
               if "/proc/cpuinfo" in path.read_text() and path.name != "host.py"]
    assert not readers, readers
