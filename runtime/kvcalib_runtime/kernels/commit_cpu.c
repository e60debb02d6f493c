/* A decode step's writes into the quantized cache on the CPU (commit_native.py calls it and checks
 * every buffer first): for each stream (one layer's keys or values) and sequence, the flush of
 * the position that leaves the residual ring into the body (quantized and packed), the new token
 * into the ring, and the body's new size. This is kvstream.Stream.append for the layouts it
 * takes, bit for bit: the quantizer computes layouts.quant's fp32 operations in their order
 * (metadata rounded first, IEEE division, round half to even; the library is built without FMA
 * contraction), the metadata bytes and E4M3 slots by the same integer bit work as
 * layouts.metabyte / layouts.fp8 (and the Triton kernel's kernels.tiles).
 *
 * Layouts: a tensor left in full precision (EXACT); calibrated per-channel ranges (STATIC: any
 * width of code, uniform or codebook levels, symmetric or not, K exact slots by the "error" or
 * "outside" rule, deltas in float32 or E4M3); per-token groups of a row (TOKEN: metadata in
 * float32 or one byte each, no outliers). Every other layout stays in torch.
 */

#include <stdint.h>
#include <string.h>

#define ROUNDING 12582912.0f /* 1.5 * 2**23: (v + R) - R rounds |v| < 2**22 half to even */
#define FP8_MAX 448.0f
#define SCALE_BASE 856                /* layouts.metabyte.BASE */
#define SCALE_CARRY ((1 << 20) - 1)   /* layouts.metabyte.CARRY */
#define MAX_WIDTH 1024                /* channels a row may have */

enum { EXACT = 0, STATIC = 1, TOKEN = 2 };

typedef struct {
    int32_t kind, heads, width;
    int32_t body_slots;  /* S: position p in slot p % S (0: no body) */
    int32_t ring;        /* the residual ring's slots R (tail [B, heads, R, width]) */
    int32_t residual, flush;
    float *tail;
    int64_t tail_seq;    /* elements between sequences, here and in every buffer below */
    int64_t *n_body;     /* [B] */
    int64_t n_body_seq;
    float *exact;        /* EXACT: [B, heads, S, width] */
    int64_t exact_seq;
    /* codes [B, heads, S, nbytes], code j of a row at bits [j * bits, (j + 1) * bits) */
    uint8_t *codes;
    int64_t codes_seq;
    int32_t bits, nbytes, symmetric, codebook;
    const float *levels, *mids; /* codebook: [heads, 2**bits], [heads, 2**bits - 1] */
    /* STATIC: scale and offset (NULL when symmetric) float32 [heads, width] as the body stores
     * them; lo and hi, the calibrated range, for the "outside" rule */
    const float *static_scale, *static_offset, *lo, *hi;
    /* TOKEN: `groups` a row, metadata [B, heads, S, groups] float32 (byte 0) or one byte each
     * (byte 1: scale code and zero point, offset NULL when symmetric) */
    int32_t groups, byte;
    void *scale, *offset;
    int64_t meta_seq;
    float clip, span, zero_step; /* span: levels' reach in scales; zero_step fp32(span / 255) */
    /* exact slots [B, heads, S, k]: index (index_bytes 1 or 2), delta (float32, or E4M3) */
    int32_t k, error_rule, fp8, index_bytes;
    void *slot_index, *slot_delta;
    int64_t slot_seq;
    int32_t fresh;       /* this stream's new tokens: fresh + this * B * heads * width */
} stream_t;

static inline uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float round_even(float v) { return (v + ROUNDING) - ROUNDING; }

static inline float clampf(float v, float low, float high) {
    return v < low ? low : v > high ? high : v;
}

static inline float absf(float v) { return v < 0 ? -v : v; }

/* layouts.fp8.encode: saturated at +-FP8_MAX, below 2**-6 rounded by an fp32 addition of 2**14,
 * else by rounding the mantissa's 20 dropped bits half to even */
static uint8_t fp8_encode(float steps) {
    const float x = clampf(steps, -FP8_MAX, FP8_MAX), f = absf(x);
    const int32_t a = (int32_t)bits_of(f);
    int32_t code;
    if (a < (121 << 23))
        code = (int32_t)bits_of(f + 16384.0f) - (141 << 23);
    else
        code = (a + ((-120 * (1 << 23)) + 0x7FFFF) + ((a >> 20) & 1)) >> 20;
    return (uint8_t)(code | ((int32_t)bits_of(x) < 0 ? 0x80 : 0));
}

/* layouts.metabyte: the scale's byte (rounded up) and its value, the zero point's byte */
static uint8_t scale_encode(float scale) {
    const int64_t code = (((int64_t)(int32_t)bits_of(scale) + SCALE_CARRY) >> 20) - SCALE_BASE;
    return (uint8_t)(code < 0 ? 0 : code > 255 ? 255 : code);
}

static float scale_decode(uint8_t code) { return float_of((uint32_t)(code + SCALE_BASE) << 20); }

static uint8_t zero_encode(float lo, float scale, float span) {
    const float reach = scale * span;
    const float z = (-lo * 255.0f) / (reach > 0 ? reach : 1.0f);
    return (uint8_t)round_even(clampf(z, 0.0f, 255.0f));
}

static void pack(const uint8_t *code, int width, int bits, uint8_t *out) {
    uint32_t acc = 0;
    int held = 0, o = 0;
    for (int j = 0; j < width; j++) {
        acc |= (uint32_t)code[j] << held;
        for (held += bits; held >= 8; held -= 8, acc >>= 8)
            out[o++] = (uint8_t)acc;
    }
    if (held)
        out[o] = (uint8_t)acc;
}

/* quant.quantize of row x [width] of head h at body slot `slot` of sequence b, written there */
static void quantize_row(const stream_t *s, int64_t b, int h, int64_t slot, const float *x) {
    const int w = s->width, levels_n = 1 << s->bits, qmax = (1 << (s->bits - 1)) - 1;
    const int64_t row = (int64_t)h * s->body_slots + slot;
    float scale[MAX_WIDTH], offset[MAX_WIDTH];
    if (s->kind == STATIC) {
        for (int c = 0; c < w; c++) {
            scale[c] = s->static_scale[h * w + c];
            offset[c] = s->static_offset ? s->static_offset[h * w + c] : 0.0f;
        }
    } else {
        const int size = w / s->groups;
        const int64_t meta = b * s->meta_seq + row * s->groups;
        for (int g = 0; g < s->groups; g++) {
            float lo = x[g * size], hi = x[g * size];
            for (int c = g * size + 1; c < (g + 1) * size; c++) {
                lo = x[c] < lo ? x[c] : lo;
                hi = x[c] > hi ? x[c] : hi;
            }
            lo *= s->clip;
            hi *= s->clip;
            float sc, off = 0.0f;
            if (s->symmetric) {
                const float absmax = absf(lo) > absf(hi) ? absf(lo) : absf(hi);
                sc = s->codebook ? absmax : absmax / (float)qmax;
            } else {
                if (s->byte) {
                    lo = lo < 0.0f ? lo : 0.0f;
                    hi = hi > 0.0f ? hi : 0.0f;
                }
                sc = (hi - lo) / s->span;
                off = lo;
            }
            if (s->byte) {
                const uint8_t code = scale_encode(sc);
                ((uint8_t *)s->scale)[meta + g] = code;
                sc = scale_decode(code);
                if (!s->symmetric) {
                    const uint8_t zero = zero_encode(off, sc, s->span);
                    ((uint8_t *)s->offset)[meta + g] = zero;
                    off = -((float)zero * s->zero_step) * sc;
                }
            } else {
                ((float *)s->scale)[meta + g] = sc;
                if (!s->symmetric)
                    ((float *)s->offset)[meta + g] = off;
            }
            for (int c = g * size; c < (g + 1) * size; c++) {
                scale[c] = sc;
                offset[c] = off;
            }
        }
    }
    uint8_t code[MAX_WIDTH];
    float error[MAX_WIDTH], excess[MAX_WIDTH];
    const float *mids = s->codebook ? s->mids + (int64_t)h * (levels_n - 1) : 0;
    const float *book = s->codebook ? s->levels + (int64_t)h * levels_n : 0;
    for (int c = 0; c < w; c++) {
        const float step = scale[c] > 0 ? scale[c] : 1.0f;
        const float t = (s->symmetric ? x[c] : x[c] - offset[c]) / step;
        int q;
        float level;
        if (s->codebook) {
            q = 0;
            for (int j = 0; j < levels_n - 1; j++)
                q += t > mids[j];
            level = book[q];
        } else if (s->symmetric) {
            q = (int)round_even(clampf(t, (float)-qmax, (float)qmax)) + qmax;
            level = (float)(q - qmax);
        } else {
            q = (int)round_even(clampf(t, 0.0f, (float)(levels_n - 1)));
            level = (float)q;
        }
        code[c] = (uint8_t)q;
        if (s->k) {
            float base = level * scale[c];
            if (!s->symmetric)
                base = base + offset[c];
            error[c] = x[c] - base;
            excess[c] = absf(s->error_rule ? error[c]
                                           : x[c] - clampf(x[c], s->lo[h * w + c], s->hi[h * w + c]));
        }
    }
    pack(code, w, s->bits, s->codes + b * s->codes_seq + row * s->nbytes);
    const int64_t at = b * s->slot_seq + row * s->k;
    for (int k = 0; k < s->k; k++) { /* the largest excess > 0 first, the lower channel on ties */
        int index = 0;
        for (int c = 1; c < w; c++)
            index = excess[c] > excess[index] ? c : index;
        const int used = excess[index] > 0;
        const float delta = used ? error[index] : 0.0f;
        excess[index] = -1.0f;
        index = used ? index : 0;
        if (s->index_bytes == 1)
            ((uint8_t *)s->slot_index)[at + k] = (uint8_t)index;
        else
            ((int16_t *)s->slot_index)[at + k] = (int16_t)index;
        if (s->fp8) {
            const float step = scale[index] > 0 ? scale[index] : 1.0f;
            ((uint8_t *)s->slot_delta)[at + k] = fp8_encode(delta / step);
        } else {
            ((float *)s->slot_delta)[at + k] = delta;
        }
    }
}

/* scheme.quantized_prefix: the body's size once position t attends */
static int64_t quantized_prefix(int64_t t, int64_t residual, int64_t flush) {
    const int64_t over = t + 1 - residual > 0 ? t + 1 - residual : 0;
    const int64_t size = (over + flush - 1) / flush * flush;
    return size < t ? size : t;
}

/* One decode step's writes of `count` streams for B sequences: sequence b's new token (at
 * position lengths[b]) of stream i at fresh + ((i.fresh * B + b) * heads) * width. */
void kvcalib_commit(const stream_t *streams, int32_t count, const float *fresh, int64_t batch,
                    const int64_t *lengths) {
    for (int i = 0; i < count; i++) {
        const stream_t *s = streams + i;
        const int w = s->width;
        for (int64_t b = 0; b < batch; b++) {
            const int64_t n = lengths[b];
            const float *new_ = fresh + (s->fresh * batch + b) * s->heads * w;
            int64_t *n_body = s->n_body + b * s->n_body_seq;
            if (n < 0 || *n_body < 0)
                continue; /* never a cache's state: nothing is read or written */
            if (s->kind == EXACT) {
                for (int h = 0; s->body_slots && h < s->heads; h++)
                    memcpy(s->exact + b * s->exact_seq + ((int64_t)h * s->body_slots +
                                                          n % s->body_slots) * w,
                           new_ + h * w, w * sizeof(float));
                *n_body = n + 1 > *n_body ? n + 1 : *n_body;
                continue;
            }
            float *tail = s->tail + b * s->tail_seq;
            const int64_t start = *n_body, want = quantized_prefix(n + 1, s->residual, s->flush);
            const int64_t target = want > start ? want : start;
            for (int64_t p = start; s->body_slots && start < target && p < start + s->flush; p++)
                for (int h = 0; h < s->heads; h++) {
                    const float *x = p < n ? tail + ((int64_t)h * s->ring + p % s->ring) * w
                                           : new_ + h * w;
                    quantize_row(s, b, h, p % s->body_slots, x);
                }
            for (int h = 0; s->residual && h < s->heads; h++)
                memcpy(tail + ((int64_t)h * s->ring + n % s->ring) * w, new_ + h * w,
                       w * sizeof(float));
            *n_body = target;
        }
    }
}
