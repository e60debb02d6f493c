/* One sequence's decode attention on the CPU over quantized bodies (decode_native.py calls it
 * and checks every shape first): kvcalib_scores writes the query's scores against every position
 * the sequence holds (RoPE moved onto the query, -inf where not attended), torch takes the
 * softmax, kvcalib_sum writes the probabilities' sum of the values. No body is written out: its
 * rows are read by table TILE at a time into a buffer, their per-token scale and offset and exact
 * slots applied, and used while they are in L1; the positions after them (a body's rows past the
 * other's, the ring, the sink slots, the new token) follow one by one.
 *
 * The tables are decode_torch's (`_window_table`): window j of a stored row (a byte, or a quarter
 * of a 3-byte word) of value x reads `per` floats at row rows[h * rows_per_head + j] + x of
 * `table`. A tensor left in full precision is read as it lies. The common shapes (8-bit windows of 1, 2 or 4 codes, 6-bit windows of 2; head_dim 64
 * or 128) are compiled with them as constants, so a row's loops unroll and the sums stay in
 * registers; any other runs the same code with them read at run time.
 */

#include <math.h> /* INFINITY */
#include <stdint.h>
#include <string.h>

#define MAX_ROW 1024 /* floats a read row may take (windows * per); wider rows stay in torch */
#define TILE 16      /* rows read before they are used */
#define MAX_Q 8192   /* floats of a sequence's queries (heads * groups * D) */
#define INLINE static inline __attribute__((always_inline))

typedef float v8 __attribute__((vector_size(32)));

INLINE v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

typedef struct {
    const float *table;        /* [rows, per] */
    const int32_t *rows;       /* [heads, rows_per_head]: the table row of window value 0 */
    int32_t rows_per_head;     /* windows (static channels: a row per window) or 1 */
    const uint8_t *codes;      /* row t of head h at codes + h * head_stride + t * nbytes */
    int64_t head_stride;
    int32_t nbytes, window, per, width; /* window: 8 (a byte) or 6 (a quarter of 3 bytes) */
    /* per-token metadata, groups a row at scale + h * meta_stride + t * groups: meta 0 none
     * (static: in the table), 1 float32 scale and offset, 2 bytes (scale scale_table[code],
     * offset -(zero * zero_step) * scale, layouts.metabyte) */
    int32_t meta, groups;
    const void *scale, *offset; /* offset NULL: none */
    int64_t meta_stride;
    const float *scale_table;  /* [256] */
    float zero_step;
    /* exact slots, slots a row at slot_index + h * slot_stride + t * slots (index_bytes 1 or 2
     * each): slot_code 0 adds a float32 delta, 1 an E4M3 byte's fp8_table[code] * step[h, c] */
    int32_t slots, index_bytes, slot_code;
    const void *slot_index, *slot_delta; /* slot_index NULL: none */
    int64_t slot_stride;
    const float *fp8_table;    /* [256] */
    const float *step;         /* [heads, width] */
    /* a tensor left in full precision: row t of head h at exact + h * head_stride + t * width
     * (float32; window 8, per 1, nbytes width, no table) */
    const float *exact;
} body_t;

/* Row t of head h into out[0, d): `wide` and `each` (the window's bits and codes, 0: the body's
 * own) and `d` are constants where the caller's are. */
INLINE void read_row(const body_t *b, int h, int64_t t, float *restrict out, const int wide,
                     const int each, const int d) {
    if (b->exact) {
        memcpy(out, b->exact + h * b->head_stride + t * d, d * sizeof(float));
        return;
    }
    const int window = wide ? wide : b->window, per = each ? each : b->per; /* 0: the body's */
    const uint8_t *row = b->codes + h * b->head_stride + t * b->nbytes;
    const int32_t *rows = b->rows + (int64_t)h * b->rows_per_head;
    const int step = b->rows_per_head > 1;
    const int count = (d + per - 1) / per;
    for (int j = 0; j < count; j++) {
        uint32_t x;
        if (window == 8) {
            x = row[j];
        } else {
            const uint8_t *word = row + 3 * (j / 4);
            x = (word[0] | word[1] << 8 | (uint32_t)word[2] << 16) >> 6 * (j % 4) & 63;
        }
        const float *from = b->table + (int64_t)(rows[j * step] + x) * per;
        for (int i = 0; i < per; i++) out[j * per + i] = from[i];
    }
    if (b->meta) {
        const int64_t at = h * b->meta_stride + t * b->groups;
        float scale[MAX_ROW], offset[MAX_ROW];
        for (int g = 0; g < b->groups; g++) {
            if (b->meta == 1) {
                scale[g] = ((const float *)b->scale)[at + g];
                offset[g] = b->offset ? ((const float *)b->offset)[at + g] : 0.0f;
            } else {
                scale[g] = b->scale_table[((const uint8_t *)b->scale)[at + g]];
                if (b->offset) {
                    const float zero = (float)((const uint8_t *)b->offset)[at + g] * b->zero_step;
                    offset[g] = -zero * scale[g];
                }
            }
        }
        if (b->groups == 1) {
            for (int c = 0; c < d; c++) out[c] *= scale[0];
            if (b->offset)
                for (int c = 0; c < d; c++) out[c] += offset[0];
        } else {
            const int size = d / b->groups;
            for (int c = 0; c < d; c++) out[c] *= scale[c / size];
            if (b->offset)
                for (int c = 0; c < d; c++) out[c] += offset[c / size];
        }
    }
    if (b->slot_index) {
        const int64_t at = h * b->slot_stride + t * b->slots;
        for (int k = 0; k < b->slots; k++) {
            const uint32_t c = b->index_bytes == 1 ? ((const uint8_t *)b->slot_index)[at + k]
                                                   : ((const uint16_t *)b->slot_index)[at + k];
            if (c >= (uint32_t)d)
                continue;
            if (b->slot_code)
                out[c] += b->fp8_table[((const uint8_t *)b->slot_delta)[at + k]] *
                          b->step[(int64_t)h * d + c];
            else
                out[c] += ((const float *)b->slot_delta)[at + k];
        }
    }
}

typedef struct {
    const body_t *keys, *values; /* the bodies: key rows [0, nb_keys), value rows [0, nb_values) */
    int64_t n, nb_keys, nb_values; /* the sequence's length, the positions each body holds */
    int32_t heads, groups, sinks;
    const float *q;              /* [heads, groups, D], scaled below (heads * groups * D <= MAX_Q) */
    float scale;                 /* the scores' scale: each q times it first */
    const float *cos, *sin;      /* [>= n + 1, D] both halves, or NULL: no RoPE */
    const float *tail_keys, *tail_values; /* the ring [heads, ring, D]: position t at t % ring */
    int64_t ring;
    const float *sink_keys, *sink_values; /* [heads, sinks, D] */
    const int64_t *sink_pos;     /* [sinks], -1 while empty */
    const float *new_key, *new_value; /* [heads, D]: the token at position n */
    const uint8_t *is_sink;      /* [>= n]: held in a sink slot (its body or ring row unread) */
    int64_t window;              /* a sliding window (positions > n - window), or 0 */
    float *out;                  /* [heads, groups, D] */
} attend_t;

/* q[g] . rope(k) at position t for the G queries of one head into s[g * stride]: RoPE moves
 * onto the query, (k cos) . q + (k sin) . turned (kc and ks: room for k cos and k sin). */
INLINE void score_row(const attend_t *a, const float *restrict k, int64_t t, const float *qh,
                      const float *th, float *s, int64_t stride, float *restrict kc,
                      float *restrict ks, const int d) {
    const float *kr = k;
    if (a->cos && d % 8 == 0 && d <= 128) { /* in registers: k cos and k sin once, then each q */
        const float *ct = a->cos + t * d, *st = a->sin + t * d;
        v8 rc[16], rs[16];
        for (int i = 0; i < d / 8; i++) {
            const v8 x = load8(k + 8 * i);
            rc[i] = x * load8(ct + 8 * i);
            rs[i] = x * load8(st + 8 * i);
        }
        for (int g = 0; g < a->groups; g++) {
            const float *qg = qh + g * d, *tg = th + g * d;
            v8 u = {0}, w = {0}; /* two sums, so the products do not wait on each other */
            for (int i = 0; i < d / 8; i++) {
                u += rc[i] * load8(qg + 8 * i);
                w += rs[i] * load8(tg + 8 * i);
            }
            u += w;
            s[g * stride] = ((u[0] + u[4]) + (u[1] + u[5])) + ((u[2] + u[6]) + (u[3] + u[7]));
        }
        return;
    }
    if (a->cos) {
        const float *ct = a->cos + t * d, *st = a->sin + t * d;
        for (int c = 0; c < d; c++) {
            kc[c] = k[c] * ct[c];
            ks[c] = k[c] * st[c];
        }
        kr = kc;
    }
    for (int g = 0; g < a->groups; g++) {
        const float *qg = qh + g * d, *tg = th + g * d;
        float sum = 0.0f;
        if (a->cos) {
#pragma omp simd reduction(+ : sum)
            for (int c = 0; c < d; c++) sum += kr[c] * qg[c] + ks[c] * tg[c];
        } else {
#pragma omp simd reduction(+ : sum)
            for (int c = 0; c < d; c++) sum += kr[c] * qg[c];
        }
        s[g * stride] = sum;
    }
}

/* out[g] += p[g * stride] * v for the G queries of one head. */
INLINE void add_row(const attend_t *a, const float *restrict v, const float *p, int64_t stride,
                    float *restrict out, const int d) {
    for (int g = 0; g < a->groups; g++) {
        const float w = p[g * stride];
        if (w != 0.0f)
            for (int c = 0; c < d; c++) out[g * d + c] += w * v[c];
    }
}

INLINE int attended(const attend_t *a, int64_t t) {
    return !a->is_sink[t] && (!a->window || t > a->n - a->window);
}

/* The scores of every position one sequence holds into p [heads, groups, length], -inf where
 * not attended: the rows both bodies hold read TILE at a time, then the rest one by one (the key
 * body's rows past the values', the ring, the sink slots, the new token). */
INLINE void score_all(const attend_t *a, const float *qs, const float *ts, float *restrict p,
                      const int wide, const int each, const int d) {
    const body_t *kb = a->keys;
    const int64_t n = a->n, lo = a->nb_keys < a->nb_values ? a->nb_keys : a->nb_values;
    const int64_t length = n + a->sinks + 1; /* positions 0..n-1, the sink slots, n */
    float tile[TILE * MAX_ROW], kc[MAX_ROW], ks[MAX_ROW];
    for (int h = 0; h < a->heads; h++) {
        const float *qh = qs + (int64_t)h * a->groups * d;
        const float *th = ts + (int64_t)h * a->groups * d;
        const float *ring = a->tail_keys + h * a->ring * d;
        const float *sink = a->sink_keys + (int64_t)h * a->sinks * d;
        float *ph = p + (int64_t)h * a->groups * length;
        for (int64_t t0 = 0; t0 < lo; t0 += TILE) {
            const int rows = lo - t0 < TILE ? (int)(lo - t0) : TILE;
            for (int r = 0; r < rows; r++) read_row(kb, h, t0 + r, tile + r * d, wide, each, d);
            for (int r = 0; r < rows; r++)
                score_row(a, tile + r * d, t0 + r, qh, th, ph + t0 + r, length, kc, ks, d);
        }
        for (int64_t t = lo; t < n; t++) {
            const float *k = ring + t % a->ring * d;
            if (t < a->nb_keys) {
                read_row(kb, h, t, tile, wide, each, d);
                k = tile;
            }
            score_row(a, k, t, qh, th, ph + t, length, kc, ks, d);
        }
        for (int j = 0; j < a->sinks; j++) {
            const int64_t at = a->sink_pos[j];
            const int kept = at >= 0 && at < n && (!a->window || at > n - a->window);
            if (kept)
                score_row(a, sink + j * d, at, qh, th, ph + n + j, length, kc, ks, d);
            else
                for (int g = 0; g < a->groups; g++) ph[g * length + n + j] = -INFINITY;
        }
        score_row(a, a->new_key + (int64_t)h * d, n, qh, th, ph + n + a->sinks, length, kc, ks, d);
        for (int64_t t = 0; t < n; t++)
            if (!attended(a, t))
                for (int g = 0; g < a->groups; g++) ph[g * length + t] = -INFINITY;
    }
}

/* out [heads, groups, D] = p times the values of every position, in p's order. */
INLINE void sum_all(const attend_t *a, const float *restrict p, const int wide, const int each,
                    const int d) {
    const body_t *vb = a->values;
    const int64_t n = a->n, lo = a->nb_keys < a->nb_values ? a->nb_keys : a->nb_values;
    const int64_t length = n + a->sinks + 1;
    float tile[TILE * MAX_ROW];
    for (int h = 0; h < a->heads; h++) {
        const float *ring = a->tail_values + h * a->ring * d;
        const float *sink = a->sink_values + (int64_t)h * a->sinks * d;
        const float *ph = p + (int64_t)h * a->groups * length;
        float *oh = a->out + (int64_t)h * a->groups * d;
        for (int i = 0; i < a->groups * d; i++) oh[i] = 0.0f;
        for (int64_t t0 = 0; t0 < lo; t0 += TILE) {
            const int rows = lo - t0 < TILE ? (int)(lo - t0) : TILE;
            for (int r = 0; r < rows; r++) read_row(vb, h, t0 + r, tile + r * d, wide, each, d);
            /* the tile's sum first (in registers where D allows), then added to the whole:
             * float32's error grows with TILE + n / TILE terms, not n */
            for (int g = 0; g < a->groups; g++) {
                const float *pg = ph + g * length + t0;
                float *og = oh + g * d;
                if (d % 8 == 0 && d <= 128) {
                    v8 acc[16] = {0};
                    for (int r = 0; r < rows; r++)
                        for (int i = 0; i < d / 8; i++) acc[i] += pg[r] * load8(tile + r * d + 8 * i);
                    for (int i = 0; i < d / 8; i++) store8(og + 8 * i, load8(og + 8 * i) + acc[i]);
                } else {
                    for (int c = 0; c < d; c++) {
                        float acc = 0.0f;
                        for (int r = 0; r < rows; r++) acc += pg[r] * tile[r * d + c];
                        og[c] += acc;
                    }
                }
            }
        }
        for (int64_t t = lo; t < n; t++) {
            const float *v = ring + t % a->ring * d;
            if (t < a->nb_values) {
                read_row(vb, h, t, tile, wide, each, d);
                v = tile;
            }
            add_row(a, v, ph + t, length, oh, d);
        }
        for (int j = 0; j < a->sinks; j++) add_row(a, sink + j * d, ph + n + j, length, oh, d);
        add_row(a, a->new_value + (int64_t)h * d, ph + n + a->sinks, length, oh, d);
    }
}

/* `call` with (wide, each, d) as constants where body b has one of the common shapes (8-bit
 * windows of 4, 2 or 1 codes, 6-bit windows of 2; head_dim 64 or 128), else the body's own. */
#define DISPATCH(b, call)                                                                      \
    do {                                                                                       \
        const int w = (b)->window, e = (b)->per, d = (b)->width;                               \
        const int whole = (b)->nbytes * 8 / w * e == d && (d == 64 || d == 128);               \
        if (whole && w == 8 && e == 4) d == 64 ? call(8, 4, 64) : call(8, 4, 128);             \
        else if (whole && w == 8 && e == 2) d == 64 ? call(8, 2, 64) : call(8, 2, 128);        \
        else if (whole && w == 8 && e == 1) d == 64 ? call(8, 1, 64) : call(8, 1, 128);        \
        else if (whole && w == 6 && e == 2) d == 64 ? call(6, 2, 64) : call(6, 2, 128);        \
        else call(0, 0, d);                                                                    \
    } while (0)

/* One sequence's decode attention in two calls, the softmax between them (torch's, vectorized):
 * kvcalib_scores writes the scores, -inf where not attended, into p [heads, groups, n + sinks +
 * 1]; kvcalib_sum writes the probabilities' sum of the values into a->out. */
void kvcalib_scores(const attend_t *a, float *p) {
    /* the queries scaled, and turned = [q2, -q1] of each, which RoPE moved onto q needs */
    float qs[MAX_Q], ts[MAX_Q];
    const int d = a->keys->width, half = d / 2;
    for (int64_t i = 0; i < (int64_t)a->heads * a->groups; i++) {
        for (int c = 0; c < d; c++) qs[i * d + c] = a->q[i * d + c] * a->scale;
        for (int c = 0; c < half; c++) {
            ts[i * d + c] = qs[i * d + half + c];
            ts[i * d + half + c] = -qs[i * d + c];
        }
    }
#define SCORE_ALL(W, E, D) score_all(a, qs, ts, p, W, E, D)
    DISPATCH(a->keys, SCORE_ALL);
}

void kvcalib_sum(const attend_t *a, const float *p) {
#define SUM_ALL(W, E, D) sum_all(a, p, W, E, D)
    DISPATCH(a->values, SUM_ALL);
}
