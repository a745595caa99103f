/* mixprec's CPU kernels, loaded with ctypes by mixprec_torch.cpu.loader.
 *
 * - mp_guard: the step guard's one pass over the gradients: optionally unscale them (in place
 *   or into float32 master gradients), and return the sum of their squares (inf or NaN when
 *   a gradient is non-finite or the squared norm overflows float32).
 * - mp_update: the fused optimizer update of compensated bfloat16 weights (master=kahan and
 *   master=stochastic) for SGD (momentum, Nesterov), Adam and AdamW: one pass per tensor that
 *   reads the weight, its compensation, the gradient and the optimizer state and writes them
 *   back, the update rule in float32 registers.
 * - mp_round_sr / mp_noise: stochastic rounding of a float32 buffer and the noise it adds.
 * - mp_maxabs: the largest magnitude over several tensors (the low-bit fused step's bounds).
 * - mp_lowbit_quantize / mp_lowbit_dequantize (mp_lowbit_index): the block-wise codec of the
 *   low-bit optimizer state (int8, int4, fp8), and mp_lowbit_update: the fused update of
 *   float32 weights whose SGD/Adam/AdamW state is kept low-bit, one pass per tensor that
 *   decodes each block of the state, applies the rule, writes the weight and encodes the block.
 *
 * Building. The file is built when the package is (setup.py: a plain shared library inside
 * mixprec_torch/cpu, shipped in the wheel; no Python headers), or by the developer build
 * (mixprec_torch.cpu.devbuild), always with the flags of the `mixprec-cflags:` line below and
 * never for the building machine's CPU (-march=native): the hot loops are compiled for
 * AVX-512, AVX2 and the baseline of the target (gcc/clang target_clones) and the loader picks
 * one at run time (mp_isa says which). The ABI number below is the only copy: the Python
 * reads it from this file.
 *
 * mixprec-cflags: -O2 -ftree-vectorize -ffp-contract=off -fno-math-errno -pthread
 *
 * Bit-exactness. Every float operation is rounded once (compiled with -ffp-contract=off: no
 * fused multiply-add, in every clone; no -ffast-math: x / a is a true division), in the order
 * of the torch fallbacks in mixprec_torch.compensated.fused_update, mixprec_torch.cpu.noise
 * and mixprec_torch.lowbit (codec, fused_step), so the two give the same bits; vectorising
 * changes no result (IEEE add, mul, div and sqrt are correctly rounded, and no sum is
 * reassociated except the guard's sum of squares, which only decides a flag; a maximum is
 * the same in any order). The stochastic-rounding noise is counter-based: element i of a
 * pass with key k gets the 16 bits (i mod 4) of splitmix64's output for the counter
 * k + (i / 4) * golden gamma, so it depends only on (seed, step, element), never on the
 * thread that draws it.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MP_F32 0
#define MP_BF16 1
#define MP_F16 2

#define MP_SGD 0
#define MP_ADAM 1

#define MP_PLAIN 0  /* float32 weight, updated in place */
#define MP_KAHAN 1  /* bfloat16 weight + bfloat16 compensation */
#define MP_SR 2     /* bfloat16 weight, rounded stochastically */

#define MP_GAMMA 0x9E3779B97F4A7C15ULL
#define MP_CHUNK 128
#define MP_MAX_THREADS 64

#define MP_ABI 6

/* The sha-256 prefix of this file as built (set by the build; "unknown" without it): the
 * loader refuses a library built from another version of the source (a stale in-place build
 * after an edit). */
#ifndef MP_SOURCE_ID
#define MP_SOURCE_ID "unknown"
#endif

/* Run-time ISA dispatch: the functions that hold the hot loops get one clone per ISA and an
 * ifunc resolver picks the best one this CPU runs (GNU/Linux on x86-64; elsewhere one
 * baseline build). Every helper they call is inlined (MP_INLINE), so its loops are compiled
 * for the clone's ISA too. -DMP_NO_CLONES builds a single version (for the tests that build
 * one ISA alone, e.g. with -mavx2). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(MP_NO_CLONES) && \
    defined(__has_attribute)
#if __has_attribute(target_clones)
#define MP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define MP_CLONE_LIST "avx512f,avx2,default"
#endif
#endif
#ifndef MP_CLONES
#define MP_CLONES
#define MP_CLONE_LIST ""
#endif

#define MP_INLINE static inline __attribute__((always_inline))

int mp_abi_version(void) { return MP_ABI; }

const char *mp_source_id(void) { return MP_SOURCE_ID; }

/* The clone the resolver picks on this CPU (its rule: the first of the list the CPU
 * supports), or the one ISA of a build without clones. */
const char *mp_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (MP_CLONE_LIST[0] != '\0') {
        if (__builtin_cpu_supports("avx512f")) return "avx512f";
        if (__builtin_cpu_supports("avx2")) return "avx2";
        return "default";
    }
#endif
#if defined(__AVX512F__)
    return "avx512f";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "baseline";
#endif
}

/* The ISAs the hot loops were compiled for ("" without clones). */
const char *mp_isa_clones(void) { return MP_CLONE_LIST; }

/* ------------------------------------------------------------------ conversions */

MP_INLINE float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

MP_INLINE uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

MP_INLINE float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* Round to nearest, ties to even; NaN becomes 0x7FC0 (c10::BFloat16's rule). */
MP_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    uint16_t rounded = (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded;
}

MP_INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        float v = (float)mant * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_to_f32(sign | 0x7F800000u | (mant << 13));
    return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

MP_INLINE float load_as_f32(const void *p, int32_t dtype, int64_t i) {
    if (dtype == MP_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dtype == MP_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

MP_INLINE void widen(float *restrict out, const void *restrict p, int32_t dtype, int64_t n) {
    if (dtype == MP_BF16) {
        const uint16_t *restrict b = (const uint16_t *)p;
        for (int64_t j = 0; j < n; j++) out[j] = bf16_to_f32(b[j]);
    } else {
        const float *restrict f = (const float *)p;
        for (int64_t j = 0; j < n; j++) out[j] = f[j];
    }
}

/* ------------------------------------------------------------------ noise */

MP_INLINE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* out[j] = noise of element first + j, j < count; out must hold count + 8 entries. */
MP_INLINE void fill_noise(uint64_t key, int64_t first, int64_t count, uint16_t *out) {
    int64_t block0 = first >> 2;
    int64_t skip = first - (block0 << 2);
    int64_t blocks = (skip + count + 3) >> 2;
    uint16_t tmp[MP_CHUNK + 16];
    uint64_t base = key + (uint64_t)block0 * MP_GAMMA;
    for (int64_t b = 0; b < blocks; b++) {
        uint64_t z = mix64(base + (uint64_t)b * MP_GAMMA);
        tmp[4 * b] = (uint16_t)z;
        tmp[4 * b + 1] = (uint16_t)(z >> 16);
        tmp[4 * b + 2] = (uint16_t)(z >> 32);
        tmp[4 * b + 3] = (uint16_t)(z >> 48);
    }
    memcpy(out, tmp + skip, (size_t)count * sizeof(uint16_t));
}

MP_INLINE uint16_t round_sr(float x, uint16_t noise) {
    return (uint16_t)((f32_to_bits(x) + (uint32_t)noise) >> 16);
}

/* ------------------------------------------------------------------ threads */

typedef void (*range_fn)(void *ctx, int64_t lo, int64_t hi, int tid);

typedef struct {
    range_fn fn;
    void *ctx;
    int64_t lo, hi;
    int tid;
} mp_job;

static void *run_job(void *arg) {
    mp_job *job = (mp_job *)arg;
    job->fn(job->ctx, job->lo, job->hi, job->tid);
    return NULL;
}

/* Split [0, total) into up to `threads` ranges of at least `min_each` elements (multiples of
 * 64) and run fn on each; the calling thread takes the first. Returns the ranges used. */
static int parallel(int64_t total, int threads, int64_t min_each, range_fn fn, void *ctx) {
    if (threads > MP_MAX_THREADS) threads = MP_MAX_THREADS;
    if (threads < 1) threads = 1;
    int64_t most = total / (min_each > 0 ? min_each : 1);
    if (most < threads) threads = most < 1 ? 1 : (int)most;
    if (threads == 1) {
        fn(ctx, 0, total, 0);
        return 1;
    }
    mp_job jobs[MP_MAX_THREADS];
    pthread_t ids[MP_MAX_THREADS];
    int started[MP_MAX_THREADS];
    int64_t each = ((total / threads) + 63) & ~(int64_t)63;
    int used = 0;
    for (int t = 0; t < threads; t++) {
        int64_t lo = each * t, hi = lo + each;
        if (lo >= total) break;
        if (hi > total || t == threads - 1) hi = total;
        jobs[t] = (mp_job){fn, ctx, lo, hi, t};
        used = t + 1;
    }
    for (int t = 1; t < used; t++)
        started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < used; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_job(&jobs[t]); /* could not start a thread: run it here */
    }
    return used;
}

/* The first item whose elements reach past `lo` in the virtual concatenation of the items
 * (item k is elements starts[k] .. starts[k + 1] - 1). */
static int64_t first_item(const int64_t *starts, int64_t count, int64_t lo) {
    int64_t a = 0, b = count;
    while (a < b) {
        int64_t mid = a + (b - a) / 2;
        if (starts[mid + 1] <= lo)
            a = mid + 1;
        else
            b = mid;
    }
    return a;
}

/* ------------------------------------------------------------------ the guard's pass */

typedef struct {
    const void *src;
    void *dst;     /* NULL: read only; may equal src (unscale in place) */
    int32_t sdt;
    int32_t ddt;   /* MP_F32 or MP_BF16 */
} mp_guard_item;

typedef struct {
    const uint64_t *src, *dst;
    const int32_t *sdt, *ddt;
    const int64_t *starts;
    int64_t count;
    float inv_scale;
    int32_t scaled;
    double partial[MP_MAX_THREADS];
} guard_ctx;

/* The sum of squares in 16 float32 lanes: a lane can only overflow when the whole sum does
 * (every term is >= 0), so this decides "the squared norm overflows float32" as one float32
 * sum would, in a vectorisable order. */
MP_INLINE void sum_squares(const float *restrict v, int64_t n, float *restrict acc) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) acc[k] += v[j + k] * v[j + k];
    for (; j < n; j++) acc[j & 15] += v[j] * v[j];
}

MP_INLINE void scale_into(float *restrict out, const float *restrict v, float k, int64_t n) {
    for (int64_t j = 0; j < n; j++) out[j] = v[j] * k;
}

/* bfloat16 store, rounded to nearest; out gets the stored values back as float32 */
MP_INLINE void narrow_bf16(uint16_t *restrict dst, float *restrict v, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        uint16_t b = f32_to_bf16(v[j]);
        dst[j] = b;
        v[j] = bf16_to_f32(b);
    }
}

/* Eight float32 lanes in a register (a GCC/clang vector extension; the baseline clone
 * splits it in two). The sums stay in registers, which an array indexed in the loop does
 * not (its every add went through memory: half the speed), and each operation is the same
 * IEEE operation per lane, so the lanes sum the same elements in the same order. */
typedef float mp_f32x8 __attribute__((vector_size(32)));

/* The float32 cases in one loop each (read only, or written as float32: an in-place unscale),
 * unscaled or not; a bfloat16 or float16 gradient is widened chunk by chunk instead (a
 * 16-bit load in this loop does not vectorise). Lane k of acc sums element k of each block
 * of 16 (two registers of eight); the elements after the last block go to lane j & 15, as
 * in sum_squares. In place (dst == fsrc) each block is read before it is written. */
#define GUARD_LOOP(SCALED, WRITE)                                              \
    do {                                                                      \
        int64_t j = a;                                                        \
        mp_f32x8 s0, s1, v0, v1;                                              \
        const mp_f32x8 k8 = {inv, inv, inv, inv, inv, inv, inv, inv};        \
        memcpy(&s0, acc, sizeof s0);                                          \
        memcpy(&s1, acc + 8, sizeof s1);                                      \
        for (; j + 16 <= b; j += 16) {                                        \
            memcpy(&v0, fsrc + j, sizeof v0);                                 \
            memcpy(&v1, fsrc + j + 8, sizeof v1);                             \
            if (SCALED) {                                                     \
                v0 = v0 * k8;                                                 \
                v1 = v1 * k8;                                                 \
            }                                                                 \
            if (WRITE) {                                                      \
                memcpy(dst + j, &v0, sizeof v0);                              \
                memcpy(dst + j + 8, &v1, sizeof v1);                          \
            }                                                                 \
            s0 += v0 * v0;                                                    \
            s1 += v1 * v1;                                                    \
        }                                                                     \
        memcpy(acc, &s0, sizeof s0);                                          \
        memcpy(acc + 8, &s1, sizeof s1);                                      \
        for (; j < b; j++) {                                                  \
            float v = fsrc[j];                                                \
            if (SCALED) v = v * inv;                                          \
            if (WRITE) dst[j] = v;                                            \
            acc[j & 15] += v * v;                                             \
        }                                                                     \
    } while (0)

MP_INLINE int guard_simple(const mp_guard_item *it, int64_t a, int64_t b, float inv, int scaled,
                        float *acc) {
    if (it->sdt != MP_F32 || (it->dst != NULL && it->ddt != MP_F32)) return 0;
    const float *fsrc = (const float *)it->src;
    float *dst = (float *)it->dst; /* may be fsrc itself: same index, read before write */
    int write = dst != NULL;
    if (write && scaled)
        GUARD_LOOP(1, 1);
    else if (write)
        GUARD_LOOP(0, 1);
    else if (scaled)
        GUARD_LOOP(1, 0);
    else
        GUARD_LOOP(0, 0);
    return 1;
}

MP_INLINE void guard_piece(const mp_guard_item *it, int64_t a, int64_t b, float inv, int scaled,
                        float *acc) {
    float xs[MP_CHUNK], ys[MP_CHUNK];
    if (guard_simple(it, a, b, inv, scaled, acc)) return;
    for (int64_t lo = a; lo < b; lo += MP_CHUNK) {
        int64_t n = lo + MP_CHUNK < b ? MP_CHUNK : b - lo;
        const float *v = xs;
        if (it->sdt == MP_F32 && !scaled && it->dst == NULL) {
            v = (const float *)it->src + lo; /* read in place */
        } else if (it->sdt == MP_F16) {
            const uint16_t *restrict h = (const uint16_t *)it->src + lo;
            for (int64_t j = 0; j < n; j++) xs[j] = f16_to_f32(h[j]);
        } else {
            widen(xs, it->sdt == MP_BF16 ? (const void *)((const uint16_t *)it->src + lo)
                                          : (const void *)((const float *)it->src + lo),
                  it->sdt, n);
        }
        if (scaled) {
            scale_into(ys, v, inv, n);
            v = ys;
        }
        if (it->dst != NULL) {
            if (it->ddt == MP_BF16) {
                float *w = (float *)v; /* xs or ys: a scratch array here */
                if (v != xs && v != ys) {
                    memcpy(ys, v, (size_t)n * sizeof(float));
                    w = ys;
                }
                narrow_bf16((uint16_t *)it->dst + lo, w, n);
                v = w;
            } else {
                memcpy((float *)it->dst + lo, v, (size_t)n * sizeof(float));
            }
        }
        sum_squares(v, n, acc);
    }
}

MP_CLONES static void guard_range(void *arg, int64_t lo, int64_t hi, int tid) {
    guard_ctx *c = (guard_ctx *)arg;
    float acc[16];
    for (int k = 0; k < 16; k++) acc[k] = 0.0f;
    for (int64_t k = first_item(c->starts, c->count, lo); k < c->count && c->starts[k] < hi; k++) {
        int64_t a = lo > c->starts[k] ? lo - c->starts[k] : 0;
        int64_t b = (hi < c->starts[k + 1] ? hi : c->starts[k + 1]) - c->starts[k];
        if (a >= b) continue;
        mp_guard_item it = {(const void *)(uintptr_t)c->src[k], (void *)(uintptr_t)c->dst[k],
                            c->sdt[k], c->ddt[k]};
        guard_piece(&it, a, b, c->inv_scale, c->scaled, acc);
    }
    double s = 0.0;
    for (int k = 0; k < 16; k++) s += (double)acc[k];
    c->partial[tid] = s;
}

/* Sum of squares of the (unscaled) gradients; writes them where dst is set (0: nowhere).
 * Tensor k is elements starts[k] .. starts[k+1] - 1 of the virtual concatenation. */
double mp_guard(int64_t count, const uint64_t *src, const uint64_t *dst, const int32_t *sdt,
                const int32_t *ddt, const int64_t *starts, float inv_scale, int32_t scaled,
                int32_t threads) {
    guard_ctx c;
    c.src = src;
    c.dst = dst;
    c.sdt = sdt;
    c.ddt = ddt;
    c.starts = starts;
    c.count = count;
    c.inv_scale = inv_scale;
    c.scaled = scaled;
    int used = parallel(starts[count], threads, 1 << 18, guard_range, &c);
    double s = 0.0;
    for (int t = 0; t < used; t++) s += c.partial[t];
    return s;
}

/* ------------------------------------------------------------------ the fused update */

typedef struct {
    void *w;            /* bfloat16 weight (kahan, sr) or float32 weight (plain) */
    uint16_t *c;        /* kahan: bfloat16 compensation */
    const void *g;      /* gradient */
    void *s0;           /* SGD: momentum buffer (or NULL); Adam: exp_avg */
    void *s1;           /* Adam: exp_avg_sq */
    int64_t n;
    int64_t index;      /* the noise counter of element 0 */
    float step_size;    /* Adam: lr / (1 - beta1^t) */
    float inv_bc2;      /* Adam: 1 / sqrt(1 - beta2^t) */
    int32_t wmode;      /* MP_PLAIN, MP_KAHAN, MP_SR */
    int32_t gdt;        /* gradient dtype */
    int32_t sdt;        /* state dtype: MP_F32, or MP_BF16 (rounded stochastically) */
    int32_t first;      /* SGD: the momentum buffer starts as the gradient */
} mp_item;

typedef struct {
    int32_t algo;       /* MP_SGD, MP_ADAM */
    int32_t maximize;
    int32_t decoupled;  /* AdamW: weight decay multiplies the weight */
    int32_t nesterov;
    float lr;
    float weight_decay;
    float decay_mul;    /* AdamW: 1 - lr * weight_decay */
    float beta1, omb1;  /* Adam: beta1 and 1 - beta1 */
    float beta2, omb2;
    float eps;
    float momentum;     /* SGD */
    float omd;          /* SGD: 1 - dampening */
    uint64_t key_w, key_s0, key_s1;
} mp_hyper;

/* The tensors of one update, as parallel arrays (built with Python's array module). */
typedef struct {
    const uint64_t *w, *c, *g, *s0, *s1;
    const int64_t *starts, *index;
    const float *step_size, *inv_bc2;
    const int32_t *wmode, *gdt, *sdt, *first;
} mp_items;

typedef struct {
    const mp_items *items;
    int64_t count;
    const mp_hyper *h;
} update_ctx;

/* One chunk of at most MP_CHUNK elements goes through small loops over float32 scratch
 * arrays (in L1): widen the weight, gradient and state, apply the update rule, round and
 * store. Each loop has few variants, so the file compiles in about a second, and each
 * vectorises. The chunk is small on purpose: measured on a Zen 4 core, the Adam update over
 * 16.8 M parameters took about 18 ms in chunks of 128 elements and 30 ms in chunks of 512
 * (the streams of weight, compensation, gradient and state are read in shorter bursts). */

MP_INLINE void widen_sum(float *restrict out, const uint16_t *restrict w, const uint16_t *restrict c,
                      int64_t n) {
    for (int64_t j = 0; j < n; j++) out[j] = bf16_to_f32(w[j]) + bf16_to_f32(c[j]);
}

/* store float32 values: as float32, or rounded stochastically into bfloat16 */
MP_INLINE void narrow_state(void *restrict p, int32_t dtype, const float *restrict v,
                         const uint16_t *restrict noise, int64_t n) {
    if (dtype == MP_BF16) {
        uint16_t *restrict b = (uint16_t *)p;
        for (int64_t j = 0; j < n; j++) b[j] = round_sr(v[j], noise[j]);
    } else {
        float *restrict f = (float *)p;
        for (int64_t j = 0; j < n; j++) f[j] = v[j];
    }
}

MP_INLINE void store_kahan(uint16_t *restrict w, uint16_t *restrict c, const float *restrict x,
                        int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        uint16_t wn = f32_to_bf16(x[j]);
        w[j] = wn;
        c[j] = f32_to_bf16(x[j] - bf16_to_f32(wn));
    }
}

MP_INLINE void store_sr(uint16_t *restrict w, const float *restrict x, const uint16_t *restrict noise,
                     int64_t n) {
    for (int64_t j = 0; j < n; j++) w[j] = round_sr(x[j], noise[j]);
}

MP_INLINE void negate(float *restrict g, int64_t n) {
    for (int64_t j = 0; j < n; j++) g[j] = -g[j];
}

/* g += x * wd (L2 weight decay, SGD and Adam) */
MP_INLINE void decay_grad(float *restrict g, const float *restrict x, float wd, int64_t n) {
    for (int64_t j = 0; j < n; j++) g[j] = g[j] + x[j] * wd;
}

MP_INLINE void scale(float *restrict x, float k, int64_t n) {
    for (int64_t j = 0; j < n; j++) x[j] = x[j] * k;
}

MP_INLINE void adam_rule(float *restrict x, const float *restrict g, float *restrict m,
                      float *restrict v, const mp_hyper *h, float step_size, float inv_bc2,
                      int64_t n) {
    const float omb1 = h->omb1, beta2 = h->beta2, omb2 = h->omb2, eps = h->eps;
    for (int64_t j = 0; j < n; j++) {
        float mj = m[j] + (g[j] - m[j]) * omb1;
        float vj = v[j] * beta2 + (g[j] * g[j]) * omb2;
        float d = sqrtf(vj) * inv_bc2 + eps;
        x[j] = x[j] - (mj / d) * step_size;
        m[j] = mj;
        v[j] = vj;
    }
}

/* buf = first ? g : buf * momentum + g * (1 - dampening); g = nesterov ? g + buf * momentum : buf */
MP_INLINE void momentum_rule(float *restrict g, float *restrict buf, const mp_hyper *h, int first,
                          int64_t n) {
    const float momentum = h->momentum, omd = h->omd;
    if (first) {
        for (int64_t j = 0; j < n; j++) buf[j] = g[j];
    } else {
        for (int64_t j = 0; j < n; j++) buf[j] = buf[j] * momentum + g[j] * omd;
    }
    if (h->nesterov) {
        for (int64_t j = 0; j < n; j++) g[j] = g[j] + buf[j] * momentum;
    } else {
        for (int64_t j = 0; j < n; j++) g[j] = buf[j];
    }
}

/* x -= g * lr */
MP_INLINE void sgd_rule(float *restrict x, const float *restrict g, float lr, int64_t n) {
    for (int64_t j = 0; j < n; j++) x[j] = x[j] - g[j] * lr;
}

MP_INLINE void update_piece(const mp_item *it, const mp_hyper *h, int64_t a, int64_t b) {
    float xs[MP_CHUNK], gs[MP_CHUNK], s0[MP_CHUNK], s1[MP_CHUNK];
    uint16_t nw[MP_CHUNK + 8], n0[MP_CHUNK + 8], n1[MP_CHUNK + 8];
    const int adam = h->algo == MP_ADAM;
    const int has_s0 = it->s0 != NULL;
    const int bf16_state = it->sdt == MP_BF16;
    for (int64_t lo = a; lo < b; lo += MP_CHUNK) {
        int64_t n = lo + MP_CHUNK < b ? MP_CHUNK : b - lo;
        int64_t index = it->index + lo;
        if (it->wmode == MP_KAHAN)
            widen_sum(xs, (const uint16_t *)it->w + lo, it->c + lo, n);
        else if (it->wmode == MP_SR)
            widen(xs, (const uint16_t *)it->w + lo, MP_BF16, n);
        else
            widen(xs, (const float *)it->w + lo, MP_F32, n);
        if (it->gdt == MP_BF16)
            widen(gs, (const uint16_t *)it->g + lo, MP_BF16, n);
        else
            widen(gs, (const float *)it->g + lo, MP_F32, n);
        if (h->maximize) negate(gs, n);
        int64_t el = bf16_state ? 2 : 4;
        if (adam) {
            if (h->weight_decay != 0.0f) {
                if (h->decoupled)
                    scale(xs, h->decay_mul, n);
                else
                    decay_grad(gs, xs, h->weight_decay, n);
            }
            widen(s0, (const char *)it->s0 + lo * el, it->sdt, n);
            widen(s1, (const char *)it->s1 + lo * el, it->sdt, n);
            adam_rule(xs, gs, s0, s1, h, it->step_size, it->inv_bc2, n);
            if (bf16_state) {
                fill_noise(h->key_s0, index, n, n0);
                fill_noise(h->key_s1, index, n, n1);
            }
            narrow_state((char *)it->s0 + lo * el, it->sdt, s0, n0, n);
            narrow_state((char *)it->s1 + lo * el, it->sdt, s1, n1, n);
        } else {
            if (h->weight_decay != 0.0f) decay_grad(gs, xs, h->weight_decay, n);
            if (has_s0) {
                if (!it->first) widen(s0, (const char *)it->s0 + lo * el, it->sdt, n);
                momentum_rule(gs, s0, h, it->first, n);
                if (bf16_state) fill_noise(h->key_s0, index, n, n0);
                narrow_state((char *)it->s0 + lo * el, it->sdt, s0, n0, n);
            }
            sgd_rule(xs, gs, h->lr, n);
        }
        if (it->wmode == MP_KAHAN) {
            store_kahan((uint16_t *)it->w + lo, it->c + lo, xs, n);
        } else if (it->wmode == MP_SR) {
            fill_noise(h->key_w, index, n, nw);
            store_sr((uint16_t *)it->w + lo, xs, nw, n);
        } else {
            float *restrict wf = (float *)it->w + lo;
            for (int64_t j = 0; j < n; j++) wf[j] = xs[j];
        }
    }
}

MP_CLONES static void update_range(void *arg, int64_t lo, int64_t hi, int tid) {
    update_ctx *c = (update_ctx *)arg;
    (void)tid;
    const mp_items *t = c->items;
    for (int64_t k = first_item(t->starts, c->count, lo); k < c->count && t->starts[k] < hi; k++) {
        int64_t a = lo > t->starts[k] ? lo - t->starts[k] : 0;
        int64_t b = (hi < t->starts[k + 1] ? hi : t->starts[k + 1]) - t->starts[k];
        if (a >= b) continue;
        mp_item it = {(void *)(uintptr_t)t->w[k], (uint16_t *)(uintptr_t)t->c[k],
                      (const void *)(uintptr_t)t->g[k], (void *)(uintptr_t)t->s0[k],
                      (void *)(uintptr_t)t->s1[k], t->starts[k + 1] - t->starts[k], t->index[k],
                      t->step_size[k], t->inv_bc2[k], t->wmode[k], t->gdt[k], t->sdt[k],
                      t->first[k]};
        update_piece(&it, c->h, a, b);
    }
}

void mp_update(int64_t count, const mp_items *items, const mp_hyper *h, int32_t threads) {
    update_ctx c = {items, count, h};
    parallel(items->starts[count], threads, 1 << 16, update_range, &c);
}

/* ------------------------------------------------------------------ stochastic rounding */

typedef struct {
    uint32_t *bits;
    uint64_t key;
    int64_t index;
} sr_ctx;

MP_CLONES static void sr_range(void *arg, int64_t lo, int64_t hi, int tid) {
    sr_ctx *c = (sr_ctx *)arg;
    uint16_t noise[MP_CHUNK + 8];
    (void)tid;
    for (int64_t a = lo; a < hi; a += MP_CHUNK) {
        int64_t len = a + MP_CHUNK < hi ? MP_CHUNK : hi - a;
        fill_noise(c->key, c->index + a, len, noise);
        for (int64_t j = 0; j < len; j++)
            c->bits[a + j] = (c->bits[a + j] + (uint32_t)noise[j]) & 0xFFFF0000u;
    }
}

/* Round n float32 values (as bits) stochastically onto the bfloat16 grid, in place. */
void mp_round_sr(uint32_t *bits, int64_t n, uint64_t key, int64_t index, int32_t threads) {
    sr_ctx c = {bits, key, index};
    parallel(n, threads, 1 << 18, sr_range, &c);
}

/* The noise of elements index .. index + n - 1 (for tests and the fallback's checks). */
MP_CLONES static void noise_into(uint16_t *out, int64_t n, uint64_t key, int64_t index) {
    uint16_t buf[MP_CHUNK + 8];
    for (int64_t a = 0; a < n; a += MP_CHUNK) {
        int64_t len = a + MP_CHUNK < n ? MP_CHUNK : n - a;
        fill_noise(key, index + a, len, buf);
        memcpy(out + a, buf, (size_t)len * sizeof(uint16_t));
    }
}

void mp_noise(uint16_t *out, int64_t n, uint64_t key, int64_t index) {
    noise_into(out, n, key, index);
}

/* ------------------------------------------------------------------ largest magnitude */

typedef struct {
    const uint64_t *src;
    const int32_t *dt;
    const int64_t *starts;
    int64_t count;
    uint32_t partial[MP_MAX_THREADS];
} maxabs_ctx;

/* The largest |v| as the bits of a non-negative float32 (whose order is the bits' order; a
 * NaN's bits are above +inf's), in 16 lanes. */
MP_CLONES static void maxabs_range(void *arg, int64_t lo, int64_t hi, int tid) {
    maxabs_ctx *c = (maxabs_ctx *)arg;
    uint32_t acc[16];
    for (int k = 0; k < 16; k++) acc[k] = 0;
    for (int64_t item = first_item(c->starts, c->count, lo);
         item < c->count && c->starts[item] < hi; item++) {
        int64_t a = lo > c->starts[item] ? lo - c->starts[item] : 0;
        int64_t b = (hi < c->starts[item + 1] ? hi : c->starts[item + 1]) - c->starts[item];
        if (c->dt[item] == MP_BF16) {
            const uint16_t *restrict v = (const uint16_t *)(uintptr_t)c->src[item];
            for (int64_t j = a; j < b; j++) {
                uint32_t u = (uint32_t)(v[j] & 0x7FFFu) << 16;
                acc[j & 15] = acc[j & 15] > u ? acc[j & 15] : u;
            }
        } else {
            const uint32_t *restrict v = (const uint32_t *)(uintptr_t)c->src[item];
            int64_t j = a;
            for (; j + 16 <= b; j += 16)
                for (int k = 0; k < 16; k++) {
                    uint32_t u = v[j + k] & 0x7FFFFFFFu;
                    acc[k] = acc[k] > u ? acc[k] : u;
                }
            for (; j < b; j++) {
                uint32_t u = v[j] & 0x7FFFFFFFu;
                acc[0] = acc[0] > u ? acc[0] : u;
            }
        }
    }
    uint32_t m = 0;
    for (int k = 0; k < 16; k++) m = m > acc[k] ? m : acc[k];
    c->partial[tid] = m;
}

/* The largest |v| over `count` float32 or bfloat16 tensors (dtype codes dt; tensor k is
 * elements starts[k] .. starts[k + 1] - 1 of their virtual concatenation): NaN where one
 * holds a NaN, +inf where one holds an infinity, 0 for none. */
float mp_maxabs(int64_t count, const uint64_t *src, const int32_t *dt, const int64_t *starts,
                int32_t threads) {
    maxabs_ctx c;
    memset(&c, 0, sizeof(c));
    c.src = src;
    c.dt = dt;
    c.starts = starts;
    c.count = count;
    if (count <= 0 || starts[count] == 0) return 0.0f;
    int used = parallel(starts[count], threads, 1 << 18, maxabs_range, &c);
    uint32_t m = 0;
    for (int t = 0; t < used; t++) m = m > c.partial[t] ? m : c.partial[t];
    return bits_to_f32(m);
}

/* ------------------------------------------------------------------ low-bit state */

/* The block-wise codec of mixprec.numerics.lowbit, code for code the torch twin's
 * (mixprec_torch.lowbit.codec): per block of `block` elements a = max |x| (NaN where the
 * block holds one), n = x / a (a true float32 division; a divides only where a > 0, else 1),
 * code = #{mids < n} (NaN: all of them, as torch.searchsorted has it), decoded as
 * values[code] * a; 4-bit codes two a byte, the even element in the low nibble, a zero
 * nibble after an odd last element.
 *
 * The search. A binary search over 255 midpoints is eight dependent loads an element, the
 * slowest part of a step by far; instead an index of buckets answers in one load and one
 * compare. Each float32 n maps to a 32-bit key that orders as the floats do (-0 made +0
 * first, as the comparison sees them equal); a bucket is a run of 2^shift keys, shift = 23 - M
 * (M mantissa bits: the smallest of 3 .. 7 that leaves no bucket with two midpoints, chosen
 * per map by mp_lowbit_index). Only the buckets the map spans are kept: the magnitude |n| is
 * first clamped to [lo, hi], lo the start of the bucket below the smallest |midpoint| and hi
 * that of the bucket above the largest (every magnitude below lo, or above hi, has lo's code,
 * or hi's, with its sign: no midpoint lies between), and NaN is made +hi (above every
 * midpoint, as torch.searchsorted has it). So an index of a few KB (L1) for 2 * nb buckets,
 * the negative ones first (in key order), answers for each: how many midpoints lie below it,
 * and the low `shift` bits of the key of the one midpoint inside it (if any). A bucket
 * holding two midpoints or more is marked, and its elements take the binary search: every
 * answer is the search's.
 *
 * The index's words: MP_INDEX_HEAD words (shift, lo, hi, nb), then the 2 * nb entries: the
 * count below (bits 0-7), MP_SLOW (bit 8), the midpoint's low key bits (bits 9-31; all ones
 * where the bucket holds none: no key's low bits are above them). */

typedef struct {
    const float *values;    /* 2^bits decoded values: the map, padded with NaN */
    const float *mids;      /* the map's nmids midpoints, ascending */
    const uint32_t *index;  /* from mp_lowbit_index */
    int32_t nmids;          /* at most 2^bits - 1 */
    int32_t bits;           /* 8, or 4 (two codes a byte) */
} mp_map;

#define MP_SLOW 0x100u      /* an index entry whose bucket needs the binary search */
#define MP_INDEX_HEAD 4     /* shift, lo, hi, nb */
#define MP_MID_SHIFT 9      /* an entry's midpoint bits */

MP_INLINE uint32_t order_key(float n) {
    uint32_t u = f32_to_bits(n + 0.0f); /* -0 + 0 = +0 */
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

/* #{mids < n}; NaN above every midpoint */
static uint32_t code_search(const mp_map *m, float n) {
    if (n != n) return (uint32_t)m->nmids;
    int32_t lo = 0, hi = m->nmids;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (m->mids[mid] < n)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (uint32_t)lo;
}

/* The index of the midpoints (ascending, finite, at most 255; see the section's comment)
 * into `index` where `capacity` words hold it. Returns the number of words it takes (ask
 * with capacity 0 first). */
int64_t mp_lowbit_index(const float *mids, int32_t nmids, uint32_t *index, int64_t capacity) {
    uint32_t shift = 16, lo = 0, hi = 0;
    if (nmids > 0) {
        uint32_t small = 0x7F800000u, large = 0;
        for (int32_t i = 0; i < nmids; i++) {
            uint32_t mag = f32_to_bits(mids[i]) & 0x7FFFFFFFu;
            small = mag < small ? mag : small;
            large = mag > large ? mag : large;
        }
        for (uint32_t bits = 3; bits <= 7; bits++) { /* the fewest that crowd no bucket */
            shift = 23 - bits;
            int crowded = 0;
            for (int32_t i = 1; i < nmids; i++)
                crowded |= order_key(mids[i]) >> shift == order_key(mids[i - 1]) >> shift;
            if (!crowded) break;
        }
        lo = small >> shift ? ((small >> shift) - 1) << shift : 0;
        hi = ((large >> shift) + 1) << shift;
    }
    uint32_t nb = (hi >> shift) - (lo >> shift) + 1;
    int64_t words = MP_INDEX_HEAD + 2 * (int64_t)nb;
    if (index == NULL || capacity < words) return words;
    index[0] = shift;
    index[1] = lo;
    index[2] = hi;
    index[3] = nb;
    uint32_t *entry = index + MP_INDEX_HEAD;
    const uint64_t width = (uint64_t)1 << shift;
    int32_t j = 0;
    for (uint32_t p = 0; p < 2 * nb; p++) {
        /* the bucket's first key: negative buckets from the largest magnitude down */
        uint64_t b = (lo >> shift) + (p < nb ? nb - 1 - p : p - nb);
        uint64_t first = p < nb ? 0x80000000u - ((b + 1) << shift) : 0x80000000u + (b << shift);
        while (j < nmids && order_key(mids[j]) < first) j++;
        int32_t inside = 0;
        while (j + inside < nmids && order_key(mids[j + inside]) < first + width) inside++;
        if (inside > 1)
            entry[p] = (uint32_t)j | MP_SLOW;
        else if (inside == 1)
            entry[p] = (uint32_t)j | (uint32_t)((order_key(mids[j]) - first) << MP_MID_SHIFT);
        else
            entry[p] = (uint32_t)j | (uint32_t)((width - 1) << MP_MID_SHIFT);
    }
    return words;
}

/* The largest |v| of a block as the bits of a non-negative float32, in 16 lanes: the bits of
 * non-negative floats order as their values, a NaN's above +inf's, so this is the twin's amax
 * where the block is finite, +inf where its worst is an infinity, a NaN where it holds one. */
MP_INLINE uint32_t block_top(const float *restrict v, int64_t len) {
    uint32_t acc[16];
    for (int k = 0; k < 16; k++) acc[k] = 0;
    int64_t j = 0;
    for (; j + 16 <= len; j += 16)
        for (int k = 0; k < 16; k++) {
            uint32_t u = f32_to_bits(v[j + k]) & 0x7FFFFFFFu;
            acc[k] = acc[k] > u ? acc[k] : u;
        }
    for (; j < len; j++) {
        uint32_t u = f32_to_bits(v[j]) & 0x7FFFFFFFu;
        acc[0] = acc[0] > u ? acc[0] : u;
    }
    uint32_t top = 0;
    for (int k = 0; k < 16; k++) top = top > acc[k] ? top : acc[k];
    return top;
}

/* The scratch of one block's encoding (len <= block entries each). */
typedef struct {
    uint32_t *keys;
    uint32_t *entries;
    uint8_t *codes;
} mp_encode_scratch;

/* Encode the len values v of one block: its absmax into *absmax and its codes into out (the
 * block's first byte). Returns 1 where the absmax is not finite; then, with `keep`, writes
 * nothing. Three loops that vectorise around one of table loads (the index), and the binary
 * search for the rare element whose bucket holds two midpoints or more. */
MP_INLINE int encode_block(const mp_map *m, const float *restrict v, mp_encode_scratch *s,
                           int64_t len, uint8_t *restrict out, float *absmax, int keep) {
    uint32_t top = block_top(v, len);
    int bad = top >= 0x7F800000u;
    if (bad && keep) return 1;
    const float a = bits_to_f32(top);
    *absmax = a;
    const float d = a > 0.0f ? a : 1.0f; /* NaN or 0: divide by 1, as the twin does */
    uint32_t *restrict keys = s->keys;
    uint32_t *restrict entries = s->entries;
    const uint32_t shift = m->index[0], lo = m->index[1], hi = m->index[2];
    const uint32_t nb = m->index[3], base = lo >> shift, low = (1u << shift) - 1u;
    const uint32_t *restrict index = m->index + MP_INDEX_HEAD;
    /* keys: the clamped magnitude, its bits flipped where n < 0 (their low bits are the
     * key's); entries: the bucket's place in the index (see the section's comment) */
    for (int64_t j = 0; j < len; j++) {
        uint32_t u = f32_to_bits(v[j] / d + 0.0f); /* -0 + 0 = +0 */
        uint32_t mag = u & 0x7FFFFFFFu;
        uint32_t neg = (uint32_t)((int32_t)u >> 31) & (mag > 0x7F800000u ? 0u : ~0u);
        uint32_t c = mag < lo ? lo : mag;
        c = c > hi ? hi : c; /* NaN: +hi */
        keys[j] = c ^ neg;
        entries[j] = nb + (((c >> shift) - base) ^ neg);
    }
    for (int64_t j = 0; j < len; j++) entries[j] = index[entries[j]];
    uint8_t *restrict c = m->bits == 4 ? s->codes : out;
    uint32_t slow = 0;
    for (int64_t j = 0; j < len; j++) {
        uint32_t e = entries[j];
        c[j] = (uint8_t)((e & 0xFFu) + ((keys[j] & low) > (e >> MP_MID_SHIFT)));
        slow |= e;
    }
    if (__builtin_expect((slow & MP_SLOW) != 0, 0))
        for (int64_t j = 0; j < len; j++)
            if (entries[j] & MP_SLOW) c[j] = (uint8_t)code_search(m, v[j] / d);
    if (m->bits == 4) {
        const uint8_t *restrict codes = s->codes;
        int64_t pairs = len / 2;
        for (int64_t j = 0; j < pairs; j++)
            out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
        if (len & 1) out[pairs] = codes[len - 1];
    }
    return bad;
}

/* Scratch for blocks of `block` elements: one allocation (free s->keys), NULL on failure. */
static int encode_scratch(mp_encode_scratch *s, int64_t block, int64_t floats, float **extra) {
    size_t words = (size_t)block * (size_t)(2 + floats);
    uint32_t *buf = (uint32_t *)malloc(words * sizeof(uint32_t) + (size_t)block);
    if (buf == NULL) return 0;
    s->keys = buf;
    s->entries = buf + block;
    s->codes = (uint8_t *)(buf + words);
    if (extra != NULL) *extra = (float *)(buf + 2 * block);
    return 1;
}

/* values[code] * a for the len elements of one block (codes: the block's first byte) */
MP_INLINE void decode_block(const mp_map *m, const uint8_t *restrict codes, float a,
                            float *restrict out, int64_t len) {
    const float *restrict values = m->values;
    if (m->bits == 4) {
        int64_t pairs = len / 2;
        for (int64_t j = 0; j < pairs; j++) {
            uint32_t byte = codes[j];
            out[2 * j] = values[byte & 15u] * a;
            out[2 * j + 1] = values[byte >> 4] * a;
        }
        if (len & 1) out[len - 1] = values[codes[pairs] & 15u] * a;
    } else {
        for (int64_t j = 0; j < len; j++) out[j] = values[codes[j]] * a;
    }
}

MP_INLINE int64_t code_offset(const mp_map *m, int64_t element) {
    return m->bits == 4 ? element >> 1 : element;
}

typedef struct {
    const float *x;
    uint8_t *codes;
    float *absmax;
    const mp_map *m;
    int64_t n, block;
    int64_t bad[MP_MAX_THREADS];
    int32_t failed;
} codec_ctx;

MP_CLONES static void quantize_range(void *arg, int64_t lo, int64_t hi, int tid) {
    codec_ctx *c = (codec_ctx *)arg;
    int64_t block = c->block, bad = 0;
    mp_encode_scratch s;
    if (!encode_scratch(&s, block, 0, NULL)) {
        c->failed = 1;
        c->bad[tid] = 0;
        return;
    }
    for (int64_t k = lo; k < hi; k++) {
        int64_t first = k * block;
        int64_t len = c->n - first < block ? c->n - first : block;
        bad += encode_block(c->m, c->x + first, &s, len, c->codes + code_offset(c->m, first),
                            c->absmax + k, 0);
    }
    free(s.keys);
    c->bad[tid] = bad;
}

static int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

static int64_t min_blocks(int64_t block) {
    int64_t each = (1 << 16) / block;
    return each > 0 ? each : 1;
}

/* Codes and absmax of the n float32 values x in blocks of `block` (codes: code_count bytes,
 * absmax: one float per block). Returns how many blocks have an absmax that is not finite,
 * or -1 where no scratch memory could be had. */
int64_t mp_lowbit_quantize(const float *x, int64_t n, int64_t block, const mp_map *m,
                           uint8_t *codes, float *absmax, int32_t threads) {
    codec_ctx c;
    memset(&c, 0, sizeof(c));
    c.x = x;
    c.codes = codes;
    c.absmax = absmax;
    c.m = m;
    c.n = n;
    c.block = block;
    if (n <= 0) return 0;
    int used = parallel(blocks_of(n, block), threads, min_blocks(block), quantize_range, &c);
    if (c.failed) return -1;
    int64_t bad = 0;
    for (int t = 0; t < used; t++) bad += c.bad[t];
    return bad;
}

typedef struct {
    const uint8_t *codes;
    const float *absmax;
    float *out;
    const mp_map *m;
    int64_t n, block;
} decode_ctx;

MP_CLONES static void dequantize_range(void *arg, int64_t lo, int64_t hi, int tid) {
    decode_ctx *c = (decode_ctx *)arg;
    (void)tid;
    for (int64_t k = lo; k < hi; k++) {
        int64_t first = k * c->block;
        int64_t len = c->n - first < c->block ? c->n - first : c->block;
        decode_block(c->m, c->codes + code_offset(c->m, first), c->absmax[k], c->out + first,
                     len);
    }
}

/* The n float32 values that codes and absmax stand for, into out. */
void mp_lowbit_dequantize(const uint8_t *codes, const float *absmax, int64_t n, int64_t block,
                          const mp_map *m, float *out, int32_t threads) {
    decode_ctx c = {codes, absmax, out, m, n, block};
    if (n <= 0) return;
    parallel(blocks_of(n, block), threads, min_blocks(block), dequantize_range, &c);
}

/* The fused update of float32 weights whose optimizer state is kept low-bit: per block,
 * decode the state, apply the update rule (as mp_update's, float32 weights), write the weight
 * and encode the block's new state (its absmax over the new values, then the codes). The new
 * codes and absmax may be the old ones' memory (a block is decoded before it is encoded). A
 * block whose new state is not finite keeps its codes and absmax (the caller's bounds make
 * that impossible: see mixprec_torch.lowbit.fused_step). s0 is SGD's momentum buffer or
 * Adam's exp_avg (the signed map), s1 Adam's exp_avg_sq (the unsigned map). */
typedef struct {
    const uint64_t *w, *g;      /* float32 weight (updated in place), gradient */
    const uint64_t *c0, *a0;    /* s0's codes and absmax (0: none yet: zeros; SGD: the grad) */
    const uint64_t *c1, *a1;
    const uint64_t *o0, *b0;    /* s0's new codes and absmax (0: no s0, SGD without momentum) */
    const uint64_t *o1, *b1;
    const int64_t *starts;      /* running element counts */
    const int64_t *bstarts;     /* running block counts */
    const float *step_size, *inv_bc2;
    const int32_t *gdt;
    int32_t *bad;               /* per tensor: bit 0 s0, bit 1 s1 has a non-finite block */
} mp_lowbit_items;

typedef struct {
    const mp_lowbit_items *items;
    int64_t count, block;
    const mp_hyper *h;
    const mp_map *m0, *m1;
    int64_t bad[MP_MAX_THREADS];
    int32_t failed;
} lowbit_ctx;

typedef struct {
    float *s0, *s1, *g;
    mp_encode_scratch enc;
} lowbit_scratch;

MP_INLINE int lowbit_block(const lowbit_ctx *c, int64_t item, int64_t k, lowbit_scratch *s) {
    const mp_lowbit_items *t = c->items;
    const mp_hyper *h = c->h;
    const mp_map *m0 = c->m0, *m1 = c->m1;
    int64_t n = t->starts[item + 1] - t->starts[item];
    int64_t first = k * c->block;
    int64_t len = n - first < c->block ? n - first : c->block;
    float *restrict x = (float *)(uintptr_t)t->w[item] + first;
    const void *g = (const void *)(uintptr_t)t->g[item];
    const uint8_t *c0 = (const uint8_t *)(uintptr_t)t->c0[item];
    const uint8_t *c1 = (const uint8_t *)(uintptr_t)t->c1[item];
    uint8_t *o0 = (uint8_t *)(uintptr_t)t->o0[item];
    uint8_t *o1 = (uint8_t *)(uintptr_t)t->o1[item];
    float *s0 = s->s0, *s1 = s->s1, *gs = s->g;
    int bad = 0;
    /* the weight and gradient two blocks ahead: their first touch stalled this pass */
    if (first + 3 * c->block <= n) {
        const char *px = (const char *)(x + 2 * c->block);
        int64_t size = t->gdt[item] == MP_BF16 ? 2 : 4;
        const char *pg = (const char *)g + (first + 2 * c->block) * size;
        for (int64_t o = 0; o < c->block * 4; o += 64) {
            __builtin_prefetch(px + o, 1);
            __builtin_prefetch(pg + o, 0);
        }
    }
    if (t->gdt[item] == MP_BF16)
        widen(gs, (const uint16_t *)g + first, MP_BF16, len);
    else
        widen(gs, (const float *)g + first, MP_F32, len);
    if (h->maximize) negate(gs, len);
    if (h->algo == MP_ADAM) {
        if (h->weight_decay != 0.0f) {
            if (h->decoupled)
                scale(x, h->decay_mul, len);
            else
                decay_grad(gs, x, h->weight_decay, len);
        }
        if (c0 != NULL) {
            const float a0 = ((const float *)(uintptr_t)t->a0[item])[k];
            const float a1 = ((const float *)(uintptr_t)t->a1[item])[k];
            decode_block(m0, c0 + code_offset(m0, first), a0, s0, len);
            decode_block(m1, c1 + code_offset(m1, first), a1, s1, len);
        } else {
            memset(s0, 0, (size_t)len * sizeof(float));
            memset(s1, 0, (size_t)len * sizeof(float));
        }
        adam_rule(x, gs, s0, s1, h, t->step_size[item], t->inv_bc2[item], len);
        bad |= encode_block(m0, s0, &s->enc, len, o0 + code_offset(m0, first),
                            (float *)(uintptr_t)t->b0[item] + k, 1);
        bad |= encode_block(m1, s1, &s->enc, len, o1 + code_offset(m1, first),
                            (float *)(uintptr_t)t->b1[item] + k, 1) << 1;
    } else {
        if (h->weight_decay != 0.0f) decay_grad(gs, x, h->weight_decay, len);
        if (o0 != NULL) {
            if (c0 != NULL)
                decode_block(m0, c0 + code_offset(m0, first),
                             ((const float *)(uintptr_t)t->a0[item])[k], s0, len);
            momentum_rule(gs, s0, h, c0 == NULL, len);
            bad |= encode_block(m0, s0, &s->enc, len, o0 + code_offset(m0, first),
                                (float *)(uintptr_t)t->b0[item] + k, 1);
        }
        sgd_rule(x, gs, h->lr, len);
    }
    return bad;
}

MP_CLONES static void lowbit_range(void *arg, int64_t lo, int64_t hi, int tid) {
    lowbit_ctx *c = (lowbit_ctx *)arg;
    const mp_lowbit_items *t = c->items;
    int64_t block = c->block, bad = 0;
    lowbit_scratch s;
    float *floats = NULL;
    if (!encode_scratch(&s.enc, block, 3, &floats)) {
        c->failed = 1;
        c->bad[tid] = 0;
        return;
    }
    s.s0 = floats;
    s.s1 = floats + block;
    s.g = floats + 2 * block;
    for (int64_t item = first_item(t->bstarts, c->count, lo);
         item < c->count && t->bstarts[item] < hi; item++) {
        int64_t a = lo > t->bstarts[item] ? lo - t->bstarts[item] : 0;
        int64_t b = (hi < t->bstarts[item + 1] ? hi : t->bstarts[item + 1]) - t->bstarts[item];
        int flags = 0;
        for (int64_t k = a; k < b; k++) {
            int found = lowbit_block(c, item, k, &s);
            bad += found != 0;
            flags |= found;
        }
        if (flags) __atomic_fetch_or(&t->bad[item], flags, __ATOMIC_RELAXED);
    }
    free(s.enc.keys);
    c->bad[tid] = bad;
}

/* One fused low-bit update over `count` tensors (blocks of `block` elements, the signed map
 * m0 for s0, the unsigned m1 for s1). Returns the number of blocks whose new state is not
 * finite (bad says which tensors), or -1 where no scratch memory could be had. */
int64_t mp_lowbit_update(int64_t count, const mp_lowbit_items *items, const mp_hyper *h,
                         const mp_map *m0, const mp_map *m1, int64_t block, int32_t threads) {
    lowbit_ctx c;
    memset(&c, 0, sizeof(c));
    c.items = items;
    c.count = count;
    c.block = block;
    c.h = h;
    c.m0 = m0;
    c.m1 = m1;
    if (count <= 0 || items->bstarts[count] == 0) return 0;
    int used = parallel(items->bstarts[count], threads, min_blocks(block), lowbit_range, &c);
    if (c.failed) return -1;
    int64_t bad = 0;
    for (int t = 0; t < used; t++) bad += c.bad[t];
    return bad;
}
