"""The CPU level whose prebuilt kernels a CPU runs, from its /proc/cpuinfo flags; and that a level asks
for every instruction set its compiler flags let the compiler use (or its kernels die of SIGILL)."""
import shutil
import subprocess

import pytest

from epdserve.kernels import cpu_levels

HASWELL = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse "
           "sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon pebs bts rep_good nopl "
           "xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg "
           "fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c "
           "rdrand lahf_lm abm cpuid_fault epb invpcid_single pti intel_ppin ssbd ibrs ibpb stibp tpr_shadow vnmi "
           "flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm xsaveopt "
           "cqm_llc cqm_occup_llc dtherm ida arat pln pts md_clear flush_l1d")
ICE_LAKE = HASWELL + (" avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw "
                      "avx512vl xsavec xgetbv1 xsaves avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq "
                      "avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid")
SAPPHIRE_RAPIDS = ICE_LAKE + " avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8"
ZEN4 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
        "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid extd_apicid tsc_known_freq "
        "pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor "
        "lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single ssbd ibrs "
        "ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap "
        "avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 "
        "clzero xsaveerptr wbnoinvd arat avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni "
        "avx512_bitalg avx512_vpopcntdq rdpid fsrm")
SANDY_BRIDGE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
                "ht syscall nx rdtscp lm constant_tsc pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 x2apic popcnt aes "
                "xsave avx lahf_lm")
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve bf16 i8mm"


@pytest.mark.parametrize("flags, machine, level", [
    (ZEN4, "x86_64", "avx512_bf16"),
    (SAPPHIRE_RAPIDS, "x86_64", "avx512_bf16"),
    (ICE_LAKE, "x86_64", "avx2"),  # AVX-512 without BF16
    (ZEN4.replace(" avx512_bf16", ""), "x86_64", "avx2"),  # a VM that hides BF16
    (HASWELL, "x86_64", "avx2"),
    (HASWELL.replace(" movbe", ""), "x86_64", None),  # an x86-64-v3 instruction missing
    (SANDY_BRIDGE, "x86_64", None),
    (GRAVITON3, "aarch64", None),
    ("", "x86_64", None),  # no /proc/cpuinfo
], ids=["zen4", "sapphire-rapids", "ice-lake", "zen4-without-bf16", "haswell", "haswell-without-movbe",
        "sandy-bridge", "graviton3", "no-flags"])
def test_the_best_level_the_cpu_has(flags, machine, level):
    chosen = cpu_levels.level_for(frozenset(flags.split()), machine)
    assert (chosen.name if chosen else None) == level


# Which /proc/cpuinfo flag each of GCC's instruction-set macros needs.
MACRO_FLAGS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2", "__CRC32__": "sse4_2",
    "__POPCNT__": "popcnt", "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cx16", "__LAHF_SAHF__": "lahf_lm",
    "__AVX__": "avx", "__AVX2__": "avx2", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__F16C__": "f16c", "__FMA__": "fma",
    "__LZCNT__": "abm", "__MOVBE__": "movbe", "__XSAVE__": "xsave", "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw", "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512BF16__": "avx512_bf16",
}


def predefined_macros(*cflags: str) -> set[str]:
    done = subprocess.run(["g++", *cflags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True,
                          check=True)
    return {line.split()[1] for line in done.stdout.splitlines()}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
@pytest.mark.parametrize("level", [lv for lv in cpu_levels.LEVELS if lv.machine == "x86_64"], ids=lambda lv: lv.name)
def test_a_level_needs_every_instruction_set_its_flags_enable(level):
    enabled = predefined_macros(*level.cflags) - predefined_macros("-march=x86-64")
    # FMA's own consequences, and the tuning's name.
    enabled = {m for m in enabled if not m.startswith(("__FP_FAST_FMA", "__tune_"))}
    unknown = enabled - MACRO_FLAGS.keys()
    assert not unknown, f"{level.name}'s flags enable {sorted(unknown)}: name their /proc/cpuinfo flags here"
    assert {MACRO_FLAGS[m] for m in enabled} <= level.cpu_flags
