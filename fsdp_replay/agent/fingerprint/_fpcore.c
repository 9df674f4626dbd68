/* sk64 fingerprints of host memory in one pass (see docs/trace-format.md#sk64).
 *
 * A plain C library, loaded with ctypes (fsdp_replay/agent/native.py): it uses no Python API, so
 * one build serves every Python version of the process it is injected into. The agent falls back
 * to the torch implementation when it is missing; both give the same fingerprints.
 *
 * The torch path reads a tensor three times (column sums, row sums, a float sum for the non-finite
 * flag) and spends most of its time in per-call overhead for tensors under a megabyte. Here every
 * 256-byte row is read once: its 32 int64 words are added to the column sums and to the row sum,
 * and its float elements are checked for an all-ones exponent while the row is in L1.
 *
 * Little-endian only (the loader refuses to use it elsewhere). Thread-safe: the row-sum scratch
 * buffer is per thread.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_WORDS 32
#define ROW_BYTES (ROW_WORDS * 8)

/* Element kinds for the non-finite check (kept in step with native.py). */
enum { KIND_NONE = 0, KIND_F16 = 1, KIND_BF16 = 2, KIND_F32 = 3, KIND_F64 = 4 };

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

/* ---- CRC-32 (zlib's polynomial, reflected, slicing by 8) ------------------------------------ */
static uint32_t crc_table[8][256];

__attribute__((constructor)) static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
}

/* zlib.crc32(buf, crc): continues a CRC-32 from crc. */
static uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
              crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^
              crc_table[2][(w >> 40) & 0xFF] ^ crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

uint32_t fsdpr_crc32(uint32_t crc, const void *p, size_t n) { return crc32_update(crc, (const uint8_t *)p, n); }

/* ---- one pass over whole rows ----------------------------------------------------------------- */
/* GCC/clang vector extensions: 256-bit vectors (AVX2 in the avx2 clone, two SSE2 registers or NEON
 * pairs elsewhere), loaded without alignment. */
typedef uint64_t u64x4 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef u64x4 u64x4_u __attribute__((aligned(1), may_alias));

/* Adds rows [0, nrows) at p to col[], writes their sums to rowsums[], and returns whether an
 * element of the given kind is NaN or infinite (its exponent bits are all ones). */
HOT static int sketch_rows(const uint8_t *p, size_t nrows, uint64_t *restrict col, uint64_t *restrict rowsums,
                           int kind) {
    u64x4 c[8];
    memcpy(c, col, sizeof c);
    u64x4 hit = {0, 0, 0, 0};
    const u32x8 e32 = {0x7F800000u, 0x7F800000u, 0x7F800000u, 0x7F800000u,
                       0x7F800000u, 0x7F800000u, 0x7F800000u, 0x7F800000u};
    const uint16_t m16 = kind == KIND_BF16 ? 0x7F80 : 0x7C00;
    const u16x16 e16 = {m16, m16, m16, m16, m16, m16, m16, m16, m16, m16, m16, m16, m16, m16, m16, m16};
    const uint64_t m64 = 0x7FF0000000000000ull;
    const u64x4 e64 = {m64, m64, m64, m64};
    for (size_t r = 0; r < nrows; r++, p += ROW_BYTES) {
        const u64x4_u *v = (const u64x4_u *)p;
        u64x4 a[8];
        for (int k = 0; k < 8; k++) {
            a[k] = v[k];
            c[k] += a[k];
        }
        u64x4 s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        rowsums[r] = (s[0] + s[1]) + (s[2] + s[3]);
        switch (kind) { /* the row is in registers: the check costs no memory traffic */
        case KIND_F32:
            for (int k = 0; k < 8; k++) hit |= (u64x4)(((u32x8)a[k] & e32) == e32);
            break;
        case KIND_F16:
        case KIND_BF16:
            for (int k = 0; k < 8; k++) hit |= (u64x4)(((u16x16)a[k] & e16) == e16);
            break;
        case KIND_F64:
            for (int k = 0; k < 8; k++) hit |= (u64x4)((a[k] & e64) == e64);
            break;
        default:
            break;
        }
    }
    memcpy(col, c, sizeof c);
    return (hit[0] | hit[1] | hit[2] | hit[3]) != 0;
}

static __thread uint64_t *scratch;
static __thread size_t scratch_rows;

static uint64_t *rows_buffer(size_t rows) {
    if (rows > scratch_rows) {
        uint64_t *p = realloc(scratch, rows * 8);
        if (!p) return NULL;
        scratch = p;
        scratch_rows = rows;
    }
    return scratch;
}

/* sk64 from a sketch: crc32(nbytes || colsums || rowsums) << 32 | (lo + hi of the word sum). */
static uint64_t sk64_value(uint64_t nbytes, const uint64_t *col, const uint64_t *rowsums, size_t rows) {
    uint8_t n8[8];
    for (int i = 0; i < 8; i++) n8[i] = (uint8_t)(nbytes >> (8 * i));
    uint32_t crc = crc32_update(0, n8, 8);
    crc = crc32_update(crc, (const uint8_t *)col, ROW_BYTES);
    crc = crc32_update(crc, (const uint8_t *)rowsums, rows * 8);
    uint64_t total = 0;
    for (int k = 0; k < ROW_WORDS; k++) total += col[k];
    return (uint64_t)crc << 32 | (uint32_t)((uint32_t)total + (uint32_t)(total >> 32));
}

/* sk64 and the non-finite flag of `nbytes` bytes at `data`, and of `slices` equal consecutive
 * slices of them: fps[0]/nfs[0] for the whole, fps[1 + i]/nfs[1 + i] for slice i (one slice: the
 * whole again). With more than
 * one slice, each slice must be whole rows (nbytes divisible by slices * 256). Returns 0, or -1
 * for arguments it does not take or when memory for the row sums cannot be had. */
int fsdpr_sk64(const void *data, size_t nbytes, size_t slices, int kind, uint64_t *fps, uint8_t *nfs) {
    if (slices == 0 || (slices > 1 && nbytes % (slices * ROW_BYTES)) || kind < 0 || kind > KIND_F64) return -1;
    size_t rows = (nbytes + ROW_BYTES - 1) / ROW_BYTES;
    uint64_t *rowsums = rows_buffer(rows ? rows : 1);
    if (!rowsums) return -1;
    const uint8_t *p = (const uint8_t *)data;
    size_t full = nbytes / ROW_BYTES;
    uint64_t total_col[ROW_WORDS] = {0};
    int any_bad = 0;
    if (slices == 1) {
        any_bad = sketch_rows(p, full, total_col, rowsums, kind);
        if (full < rows) { /* the last row, zero-padded (the element check sees zeros: finite) */
            uint8_t last[ROW_BYTES] = {0};
            memcpy(last, p + full * ROW_BYTES, nbytes - full * ROW_BYTES);
            any_bad |= sketch_rows(last, 1, total_col, rowsums + full, kind);
        }
        fps[0] = fps[1] = sk64_value(nbytes, total_col, rowsums, rows);
        nfs[0] = nfs[1] = (uint8_t)any_bad;
        return 0;
    }
    size_t per = rows / slices;
    for (size_t i = 0; i < slices; i++) {
        uint64_t col[ROW_WORDS] = {0};
        int bad = sketch_rows(p + i * per * ROW_BYTES, per, col, rowsums + i * per, kind);
        fps[1 + i] = sk64_value(nbytes / slices, col, rowsums + i * per, per);
        nfs[1 + i] = (uint8_t)bad;
        for (int k = 0; k < ROW_WORDS; k++) total_col[k] += col[k];
        any_bad |= bad;
    }
    fps[0] = sk64_value(nbytes, total_col, rowsums, rows);
    nfs[0] = (uint8_t)any_bad;
    return 0;
}

/* fsdpr_sk64 of n buffers (whole, one slice each): one call for a step's parameters. */
int fsdpr_sk64_many(size_t n, const uint64_t *ptrs, const uint64_t *nbytes, const int32_t *kinds, uint64_t *fps,
                    uint8_t *nfs) {
    for (size_t i = 0; i < n; i++) {
        uint64_t f[2];
        uint8_t b[2];
        if (fsdpr_sk64((const void *)(uintptr_t)ptrs[i], (size_t)nbytes[i], 1, kinds[i], f, b)) return -1;
        fps[i] = f[0];
        nfs[i] = b[0];
    }
    return 0;
}

/* An ABI check for the loader: the layout constants this build was made with. */
int fsdpr_abi(void) { return 1000 * ROW_WORDS + 2; }
