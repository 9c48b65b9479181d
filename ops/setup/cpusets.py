"""The candidate instruction sets: each of ggml's x86 options with the C program that proves it runs.

ops/setup/cpuprobe.py compiles each program with its set's flags and runs it in a child process;
this module is the table it runs (and the programs' shared C text), nothing that executes.

Standard library only: setup runs the probe with the system's Python before the venv has anything.
"""

from __future__ import annotations

from dataclasses import dataclass

# The programs read their inputs from argc so that the compiler cannot fold the intrinsics into
# constants (and so emit no instruction at all), and are compiled with -O0 for the same reason.
_PRELUDE = """
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
"""

_AMX_SETUP = """
typedef struct { uint8_t palette; uint8_t start_row; uint8_t reserved[14];
                 uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) tilecfg;
static int amx_permission(void) {
    /* Linux: ask for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
static void amx_config(int rows, int colsb) {
    tilecfg c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int i = 0; i < 3; i++) { c.colsb[i] = colsb; c.rows[i] = rows; }
    _tile_loadconfig(&c);
}
"""

# ggml's AMX kernels configure the tiles from a struct on the stack (ggml-cpu/amx/mmq.cpp,
# ggml_tile_config_init). Some compilers (GCC 12 among them) give ``ldtilecfg`` a memory operand
# of 8 bytes, not 64, and drop the stores of the rows and column widths as dead: the tiles are
# left unconfigured and the first tile instruction traps (SIGILL), on a CPU whose AMX works. The
# plain program above cannot see that (it configures through memset and a loop); this one is
# ggml's function, as ggml's build compiles it.
_AMX_GGML_FORM = """
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <unistd.h>
#include <sys/syscall.h>
struct tile_config_t {
    uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0}; uint8_t rows[16] = {0};
};
inline void tile_config_init(void) {
    static thread_local bool done = false;
    if (done) return;
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1; tc.start_row = 0;
    tc.rows[0] = 8;  tc.colsb[0] = 64;  tc.rows[1] = 8;  tc.colsb[1] = 64;
    tc.rows[2] = 16; tc.colsb[2] = 32;  tc.rows[3] = 16; tc.colsb[3] = 32;
    tc.rows[4] = 16; tc.colsb[4] = 64;  tc.rows[5] = 16; tc.colsb[5] = 64;
    tc.rows[6] = 16; tc.colsb[6] = 64;  tc.rows[7] = 16; tc.colsb[7] = 64;
    _tile_loadconfig(&tc);
    done = true;
}
int main(int argc, char **) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 3;
    tile_config_init();
    alignas(64) static int32_t r[16 * 16]; r[0] = 7;
    _tile_zero(4); _tile_stored(4, r, 64); _tile_release();
    if (r[0] == 0 && argc == 1) puts("ok");
    return 0;
}
"""
GGML_FORM_LEVELS = ("-O1", "-O2", "-O3")  # ggml builds with -O3; what survives depends on inlining


@dataclass(frozen=True)
class Candidate:
    """One ggml instruction-set option (``GGML_<name>``) and the program that proves it runs."""

    name: str
    flags: tuple[str, ...]  # the compiler's flags for it (those ggml's CMake adds for the option)
    requires: tuple[str, ...]  # options that must also be kept (ggml's code assumes them)
    body: str  # C statements of main(int argc, ...): print "ok" when the answer is right
    support: str = ""  # C declarations the body uses
    # a C++ program written the way ggml's kernels use the set, compiled at each of
    # GGML_FORM_LEVELS by the C++ compiler: the set is kept only if it runs too (see AMX_TILE)
    ggml_form: str = ""

    def source(self) -> str:
        """The C program: ``main`` around the body, after the headers and the support declarations."""
        main = f"int main(int argc, char **argv) {{ (void)argv; {self.body} return 0; }}"
        return f"{_PRELUDE}{self.support}\n{main}\n"


CANDIDATES: tuple[Candidate, ...] = (
    Candidate(
        "SSE42",
        ("-msse4.2",),
        (),
        'unsigned c = _mm_crc32_u32(0, (unsigned)argc); if (c == _mm_crc32_u32(0, 1u) && c != 0) puts("ok");',
    ),
    Candidate(
        "AVX",
        ("-mavx",),
        ("SSE42",),
        "float o[8]; __m256 x = _mm256_set1_ps((float)argc); _mm256_storeu_ps(o, _mm256_add_ps(x, x));"
        ' if (o[7] == 2.0f) puts("ok");',
    ),
    Candidate(
        "F16C",
        ("-mf16c",),
        ("AVX",),
        "float o[4]; __m128i h = _mm_cvtps_ph(_mm_set1_ps(1.5f * argc), 0); _mm_storeu_ps(o, _mm_cvtph_ps(h));"
        ' if (o[3] == 1.5f) puts("ok");',
    ),
    Candidate(
        "FMA",
        ("-mfma",),
        ("AVX",),
        "float o[8]; __m256 x = _mm256_set1_ps((float)argc);"
        ' _mm256_storeu_ps(o, _mm256_fmadd_ps(x, x, x)); if (o[0] == 2.0f) puts("ok");',
    ),
    Candidate(
        "BMI2",
        ("-mbmi2",),
        (),
        'if (_pdep_u32(3u * argc, 0xF0u) == 0x30u) puts("ok");',
    ),
    Candidate(
        "AVX2",
        ("-mavx2",),
        ("AVX", "FMA", "F16C"),
        "int o[8]; __m256i x = _mm256_set1_epi32(argc); _mm256_storeu_si256((__m256i *)o, _mm256_add_epi32(x, x));"
        ' if (o[5] == 2) puts("ok");',
    ),
    Candidate(
        "AVX_VNNI",
        ("-mavxvnni",),
        ("AVX2",),
        "int o[8]; __m256i a = _mm256_set1_epi8((char)argc), b = _mm256_set1_epi8(2);"
        " _mm256_storeu_si256((__m256i *)o, _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b));"
        ' if (o[0] == 8) puts("ok");',
    ),
    Candidate(
        # ggml's GGML_AVX512 turns on all five of these together: each gets an instruction here
        "AVX512",
        ("-mavx512f", "-mavx512cd", "-mavx512vl", "-mavx512dq", "-mavx512bw"),
        ("AVX2",),
        "int o[16]; __m512i x = _mm512_set1_epi32(argc);"
        " __m512i f = _mm512_add_epi32(x, x);"  # F
        " __m512i c = _mm512_conflict_epi32(x);"  # CD: every lane equals all lanes before it
        " __m512i b = _mm512_add_epi8(x, x);"  # BW
        " __m512d d = _mm512_cvtepi64_pd(_mm512_set1_epi64(argc));"  # DQ
        " __m256i v = _mm256_maskz_add_epi32(0x0F, _mm256_set1_epi32(argc), _mm256_set1_epi32(argc));"  # VL
        " int s = 0; double dd[8]; int vv[8];"
        " _mm512_storeu_si512(o, f); s += o[15] == 2;"
        " _mm512_storeu_si512(o, c); s += o[15] == 0x7FFF;"
        " _mm512_storeu_si512(o, b); s += o[0] == 2;"
        " _mm512_storeu_pd(dd, d); s += dd[7] == 1.0;"
        " _mm256_storeu_si256((__m256i *)vv, v); s += vv[0] == 2 && vv[7] == 0;"
        ' if (s == 5) puts("ok");',
    ),
    Candidate(
        "AVX512_VBMI",
        ("-mavx512vbmi",),
        ("AVX512",),
        "char o[64]; __m512i idx = _mm512_set1_epi8((char)argc), t = _mm512_set_epi8("
        "63,62,61,60,59,58,57,56,55,54,53,52,51,50,49,48,47,46,45,44,43,42,41,40,39,38,37,36,35,34,33,32,"
        "31,30,29,28,27,26,25,24,23,22,21,20,19,18,17,16,15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);"
        ' _mm512_storeu_si512(o, _mm512_permutexvar_epi8(idx, t)); if (o[9] == 1) puts("ok");',
    ),
    Candidate(
        "AVX512_VNNI",
        ("-mavx512vnni",),
        ("AVX512",),
        "int o[16]; __m512i a = _mm512_set1_epi8((char)argc), b = _mm512_set1_epi8(3);"
        ' _mm512_storeu_si512(o, _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b)); if (o[15] == 12) puts("ok");',
    ),
    Candidate(
        "AVX512_BF16",
        ("-mavx512bf16",),
        ("AVX512",),
        "float o[16]; __m512 x = _mm512_set1_ps((float)argc); __m512bh h = _mm512_cvtne2ps_pbh(x, x);"
        ' _mm512_storeu_ps(o, _mm512_dpbf16_ps(_mm512_setzero_ps(), h, h)); if (o[0] == 2.0f) puts("ok");',
    ),
    Candidate(
        "AMX_TILE",
        ("-mamx-tile",),
        ("AVX512",),
        "static int32_t r[16 * 16]; r[0] = 7; if (!amx_permission()) return 3; amx_config(16, 64);"
        ' _tile_zero(0); _tile_stored(0, r, 64); _tile_release(); if (r[0] == 0 && argc == 1) puts("ok");',
        _AMX_SETUP,
        _AMX_GGML_FORM,
    ),
    Candidate(
        # ggml's AMX kernels need AVX512-VNNI beside the tiles (ggml-cpu/amx: __AMX_INT8__ && __AVX512VNNI__)
        "AMX_INT8",
        ("-mamx-tile", "-mamx-int8"),
        ("AMX_TILE", "AVX512_VNNI"),
        "static int8_t a[16 * 64], b[16 * 64]; static int32_t r[16 * 16];"
        " for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)argc; b[i] = 2; }"
        " if (!amx_permission()) return 3; amx_config(16, 64);"
        " _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_dpbssd(0, 1, 2);"
        ' _tile_stored(0, r, 64); _tile_release(); if (r[0] == 128) puts("ok");',
        _AMX_SETUP,
    ),
    Candidate(
        "AMX_BF16",
        ("-mamx-tile", "-mamx-bf16"),
        ("AMX_TILE", "AVX512_BF16"),
        "static uint16_t a[16 * 32], b[16 * 32]; static float r[16 * 16];"
        " for (int i = 0; i < 16 * 32; i++) { a[i] = 0x3F80 * argc; b[i] = 0x3F80; }"  # bf16 1.0
        " if (!amx_permission()) return 3; amx_config(16, 64);"
        " _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_dpbf16ps(0, 1, 2);"
        ' _tile_stored(0, r, 64); _tile_release(); if (r[0] == 32.0f) puts("ok");',
        _AMX_SETUP,
    ),
)
