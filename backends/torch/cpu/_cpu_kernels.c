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
 * fused multiply-add, in every clone), in the order of the torch fallback in
 * mixprec_torch.compensated.fused_update and mixprec_torch.cpu.noise, so the two give the
 * same bits; vectorising changes no result (IEEE add, mul, div and sqrt are correctly
 * rounded, and no sum is reassociated except the guard's sum of squares, which only decides
 * a flag). The stochastic-rounding noise is counter-based: element i of a pass with key k
 * gets the 16 bits (i mod 4) of splitmix64's output for the counter k + (i / 4) * golden
 * gamma, so it depends only on (seed, step, element), never on the thread that draws it.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
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

#define MP_ABI 4

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

/* The float32 cases in one loop each (read only, or written as float32: an in-place unscale),
 * unscaled or not; a bfloat16 or float16 gradient is widened chunk by chunk instead (a
 * 16-bit load in this loop does not vectorise). */
#define GUARD_LOOP(LOAD, SCALED, WRITE)                                        \
    do {                                                                      \
        int64_t j = a;                                                        \
        for (; j + 16 <= b; j += 16)                                          \
            for (int k = 0; k < 16; k++) {                                    \
                float v = LOAD(j + k);                                        \
                if (SCALED) v = v * inv;                                      \
                if (WRITE) dst[j + k] = v;                                    \
                acc[k] += v * v;                                              \
            }                                                                 \
        for (; j < b; j++) {                                                  \
            float v = LOAD(j);                                                \
            if (SCALED) v = v * inv;                                          \
            if (WRITE) dst[j] = v;                                            \
            acc[j & 15] += v * v;                                             \
        }                                                                     \
    } while (0)

#define LOAD_F32(i) (fsrc[i])

MP_INLINE int guard_simple(const mp_guard_item *it, int64_t a, int64_t b, float inv, int scaled,
                        float *acc) {
    if (it->sdt != MP_F32 || (it->dst != NULL && it->ddt != MP_F32)) return 0;
    const float *fsrc = (const float *)it->src;
    float *dst = (float *)it->dst; /* may be fsrc itself: same index, read before write */
    int write = dst != NULL;
    if (write && scaled)
        GUARD_LOOP(LOAD_F32, 1, 1);
    else if (write)
        GUARD_LOOP(LOAD_F32, 0, 1);
    else if (scaled)
        GUARD_LOOP(LOAD_F32, 1, 0);
    else
        GUARD_LOOP(LOAD_F32, 0, 0);
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
                      float *restrict v, const mp_hyper *h, const mp_item *it, int64_t n) {
    const float omb1 = h->omb1, beta2 = h->beta2, omb2 = h->omb2, eps = h->eps;
    const float step_size = it->step_size, inv_bc2 = it->inv_bc2;
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
            adam_rule(xs, gs, s0, s1, h, it, n);
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
