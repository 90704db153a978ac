/* mixprec's range counter for CPUs: the bins of range_bins.py in one pass over the values.
 *
 * Built at first use by range_native.py with the system's C compiler (under half a second) and called
 * through ctypes; MIXPREC_ENDS and MIXPREC_N_ENDS are given on the compiler's command line (range_bins's ends).
 * For each run of consecutive values it writes the count of every bin and the largest finite
 * |x * scale| as an fp32 bit pattern: the numbers range_bins.count_piece returns, by the same fp32
 * arithmetic (one IEEE multiply, then the bit pattern; built without -ffast-math, so subnormals stay).
 *
 * Why not torch: a bin per value is 14 compares (vectorised here) and one increment of a counter; torch's
 * bincount is a serial loop that first scans for its min and max and reads an index tensor that another
 * kernel wrote. Here the bins of a block of 256 values live in the L1 cache between the two loops, and
 * four sub-histograms let the increments of equal bins overlap.
 */
#include <stdint.h>
#include <string.h>

#define N_BINS (256 + MIXPREC_N_ENDS)
#define BLOCK 256
#define N_SUB 4
#define ABS_MASK 0x7fffffffu
#define INF_BITS 0x7f800000u

static const uint32_t ENDS[MIXPREC_N_ENDS] = {MIXPREC_ENDS};

enum { FP32 = 0, FP16 = 1, BF16 = 2 };

static inline uint32_t bits_of(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float float_of(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

/* |x[i] * scale| as fp32 bit patterns, for one block. fp16 and bf16 widen exactly first, in integers (no
 * float arithmetic on a subnormal input, which a flush-to-zero mode could change): bf16 is the top half of an
 * fp32; an fp16 normal is its bits moved up 13 places with the exponent bias raised by 112, a subnormal
 * is its significand times 2**-24 (an fp32 normal), and all-ones exponents stay inf and NaN. */
static inline void load_block(const void *x, int dtype, int64_t at, int64_t m, float scale, uint32_t *bits) {
    if (dtype == FP32) {
        const float *p = (const float *)x + at;
        for (int64_t i = 0; i < m; i++) bits[i] = bits_of(p[i] * scale) & ABS_MASK;
    } else if (dtype == BF16) {
        const uint16_t *p = (const uint16_t *)x + at;
        for (int64_t i = 0; i < m; i++) bits[i] = bits_of(float_of((uint32_t)p[i] << 16) * scale) & ABS_MASK;
    } else {
        const uint16_t *p = (const uint16_t *)x + at;
        for (int64_t i = 0; i < m; i++) {
            uint32_t h = p[i] & 0x7fffu, exponent = h >> 10;
            uint32_t normal = (h << 13) + (112u << 23), special = INF_BITS | (h & 0x3ffu) << 13;
            uint32_t subnormal = bits_of((float)(int32_t)(h & 0x3ffu) * 0x1p-24f);   /* all three: no branch */
            uint32_t is_special = 0u - (exponent == 31), is_subnormal = 0u - (exponent == 0);
            uint32_t wide = (special & is_special) | (subnormal & is_subnormal)
                          | (normal & ~(is_special | is_subnormal));
            bits[i] = bits_of(float_of(wide) * scale) & ABS_MASK;
        }
    }
}

/* Counts and largest finite |x * scale| of each of the n_runs consecutive runs of x. counts: n_runs rows
 * of N_BINS (written, not added to); amax: n_runs fp32 bit patterns (0 where a run has nothing finite). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MIXPREC_NO_CLONES)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void mixprec_count_runs(const void *x, int32_t dtype, float scale, const int64_t *runs, int64_t n_runs,
                        int64_t *counts, int32_t *amax) {
    int64_t sub[N_SUB][N_BINS];
    uint32_t bits[BLOCK];
    int32_t bins[BLOCK];
    int64_t at = 0;
    for (int64_t r = 0; r < n_runs; r++) {
        memset(sub, 0, sizeof sub);
        int32_t largest = 0;
        for (int64_t done = 0; done < runs[r]; done += BLOCK) {
            int64_t m = runs[r] - done < BLOCK ? runs[r] - done : BLOCK;
            load_block(x, dtype, at + done, m, scale, bits);
            for (int64_t i = 0; i < m; i++) {
                uint32_t u = bits[i], bin = u >> 23;            /* the exponent field ... */
                for (int k = 0; k < MIXPREC_N_ENDS; k++)
                    bin += u >= ENDS[k];                        /* ... plus the ends at or below u */
                bins[i] = (int32_t)bin;
                int32_t finite = u < INF_BITS ? (int32_t)u : 0; /* patterns order like the values */
                largest = finite > largest ? finite : largest;
            }
            int64_t i = 0;
            for (; i + N_SUB <= m; i += N_SUB)
                for (int s = 0; s < N_SUB; s++) sub[s][bins[i + s]]++;
            for (; i < m; i++) sub[0][bins[i]]++;
        }
        for (int b = 0; b < N_BINS; b++) {
            int64_t total = 0;
            for (int s = 0; s < N_SUB; s++) total += sub[s][b];
            counts[r * N_BINS + b] = total;
        }
        amax[r] = largest;
        at += runs[r];
    }
}
