/* Run-time ISA detection. AVX-512 needs both the CPU bit (cpuid leaf 7, EBX bit 16)
 * and the OS enabling the opmask and ZMM state in XCR0 (bits 1, 2, 5, 6, 7); a CPU can
 * report the former without the latter (e.g. under some hypervisors), so both are read.
 * AVX2 + FMA: cpuid leaf 7 EBX bit 5 and leaf 1 ECX bit 12, with the XMM and YMM state
 * (XCR0 bits 1, 2). */
#include "ttile_runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t read_xcr0(void)
{
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int detect_avx512f(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    const unsigned osxsave = 1u << 27, fma = 1u << 12;
    if ((ecx & osxsave) == 0 || (ecx & fma) == 0)
        return 0;
    const uint64_t zmm_state = (1u << 1) | (1u << 2) | (1u << 5) | (1u << 6) | (1u << 7);
    if ((read_xcr0() & zmm_state) != zmm_state)
        return 0;
    if (__get_cpuid_max(0, 0) < 7)
        return 0;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    return (ebx >> 16) & 1u;
}

/* AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16): cpuid leaf 7 subleaf 1 EAX bit 5, on top of
 * AVX-512F with its state enabled, and AVX512BW + VL (leaf 7 EBX bits 30, 31), which the
 * bf16 kernels use for 16-bit masked loads and which every CPU with AVX512_BF16 has. */
static int detect_avx512bf16(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!detect_avx512f())
        return 0;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const unsigned bw_vl = (1u << 30) | (1u << 31);
    if ((ebx & bw_vl) != bw_vl || eax < 1)
        return 0;
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    return (eax >> 5) & 1u;
}

/* AMX-BF16 and AMX-TILE (leaf 7 EDX bits 22 and 24) with the OS enabling the tile
 * configuration and tile data state (XCR0 bits 17 and 18). Linux still hands the tile
 * data state to a process only when asked (ttile_amx_request). */
static int detect_amx_bf16(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!detect_avx512bf16())
        return 0;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const unsigned amx = (1u << 22) | (1u << 24);
    if ((edx & amx) != amx)
        return 0;
    const uint64_t tile_state = (1ull << 17) | (1ull << 18);
    return (read_xcr0() & tile_state) == tile_state;
}

static int detect_avx2(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    const unsigned osxsave = 1u << 27, fma = 1u << 12, avx = 1u << 28;
    if ((ecx & osxsave) == 0 || (ecx & fma) == 0 || (ecx & avx) == 0)
        return 0;
    const uint64_t ymm_state = (1u << 1) | (1u << 2);
    if ((read_xcr0() & ymm_state) != ymm_state)
        return 0;
    if (__get_cpuid_max(0, 0) < 7)
        return 0;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    return (ebx >> 5) & 1u;
}

/* cpuid traps to the hypervisor in a VM (several microseconds), so it runs once and the
 * answer is kept; a race between two first callers only computes it twice. */
int ttile_cpu_has_avx512f(void)
{
    static volatile int cached = -1;
    if (cached < 0)
        cached = detect_avx512f();
    return cached;
}

int ttile_cpu_has_avx2(void)
{
    static volatile int cached = -1;
    if (cached < 0)
        cached = detect_avx2();
    return cached;
}

int ttile_cpu_has_avx512bf16(void)
{
    static volatile int cached = -1;
    if (cached < 0)
        cached = detect_avx512bf16();
    return cached;
}

int ttile_cpu_has_amx_bf16(void)
{
    static volatile int cached = -1;
    if (cached < 0)
        cached = detect_amx_bf16();
    return cached;
}

/* Linux (5.16 on) gives a process the AMX tile data state only after
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the first tile
 * instruction faults. The permission is the whole process's, so it is asked once. */
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
int ttile_amx_request(void)
{
    static volatile int cached = -1;
    if (cached < 0) {
        int ok = 0;
#if defined(__linux__) && defined(SYS_arch_prctl)
        if (ttile_cpu_has_amx_bf16())
            ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                         18 /* XFEATURE_XTILEDATA */) == 0;
#endif
        cached = ok;
    }
    return cached;
}

static int64_t detect_l2_bytes(void)
{
    unsigned eax, ebx, ecx, edx;
    if (__get_cpuid_max(0x80000000u, 0) < 0x80000006u)
        return 0;
    __cpuid(0x80000006u, eax, ebx, ecx, edx);
    return (int64_t)(ecx >> 16) * 1024;   /* ECX[31:16]: L2 size in KiB */
}

int64_t ttile_cpu_l2_bytes(void)
{
    static volatile int64_t cached = -1;
    if (cached < 0)
        cached = detect_l2_bytes();
    return cached;
}
#else
int ttile_cpu_has_avx512f(void) { return 0; }
int ttile_cpu_has_avx2(void) { return 0; }
int ttile_cpu_has_avx512bf16(void) { return 0; }
int ttile_cpu_has_amx_bf16(void) { return 0; }
int ttile_amx_request(void) { return 0; }
int64_t ttile_cpu_l2_bytes(void) { return 0; }
#endif

/* Half the L2 holds the panels a thread reuses across an output row, the other half the
 * input rows and outputs they meet; at most 512 KiB, the value measured best on the 1 and
 * 2 MiB L2s of Zen 4, Zen 5 and a Xeon (model 167), and the value when the L2 is
 * unknown. */
static int64_t default_cache_bytes(void)
{
    const int64_t l2 = ttile_cpu_l2_bytes();
    const int64_t most = 512 << 10;
    return l2 >= (128 << 10) && l2 / 2 < most ? l2 / 2 : most;
}

static volatile int64_t generic_cache_bytes = -1;

int64_t ttile_generic_cache_bytes(void)
{
    if (generic_cache_bytes <= 0)
        generic_cache_bytes = default_cache_bytes();
    return generic_cache_bytes;
}

void ttile_set_generic_cache_bytes(int64_t bytes)
{
    generic_cache_bytes = bytes > 0 ? bytes : default_cache_bytes();
}

/* The L3 a core shares, from the cache topology leaf (AMD's 0x8000001D, Intel's 4), 0
 * when unknown. Not AMD's leaf 0x80000006 nor glibc's sysconf, which under KVM on a Zen 5
 * report the whole socket's 384 MB where a core shares 32 MB. */
static int64_t detect_l3_bytes(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax, ebx, ecx, edx;
    const unsigned leaf = __get_cpuid_max(0x80000000u, 0) >= 0x8000001Du ? 0x8000001Du : 4u;
    if (leaf == 4u && __get_cpuid_max(0, 0) < 4u)
        return 0;
    for (unsigned i = 0; i < 8; i++) {
        __cpuid_count(leaf, i, eax, ebx, ecx, edx);
        if ((eax & 31u) == 0)   /* no more caches */
            break;
        if (((eax >> 5) & 7u) == 3u)
            return (int64_t)(((ebx >> 22) & 0x3ffu) + 1) * (((ebx >> 12) & 0x3ffu) + 1)
                   * ((ebx & 0xfffu) + 1) * ((int64_t)ecx + 1);
    }
#endif
    return 0;
}

static int64_t default_stream_bytes(void)
{
    const int64_t l3 = detect_l3_bytes(), floor = TTILE_STREAM_BYTES;
    if (l3 <= 0)
        return 4 * floor;
    return l3 > floor ? l3 : floor;
}

static volatile int64_t generic_stream_bytes = -1;

int64_t ttile_generic_stream_bytes(void)
{
    if (generic_stream_bytes <= 0)
        generic_stream_bytes = default_stream_bytes();
    return generic_stream_bytes;
}

void ttile_set_generic_stream_bytes(int64_t bytes)
{
    generic_stream_bytes = bytes > 0 ? bytes : default_stream_bytes();
}
