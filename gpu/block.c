/*
 * block.c - the trainer's memory blocks, and the guard mode that fences them.
 *
 * A block (the master weights, the working copy, the gradients, the optimizer state, the
 * activations, the scratch) is one zeroed allocation with a 64-byte header in front of it
 * that says how it was made, so gpu_block_free() frees it the same way whatever the mode is
 * by then. The header carries a checksum: a write into it is found by gpu_block_check(), and
 * gpu_block_free() leaves such a block alone rather than free what the header now says.
 *
 * Guard mode (AMPD_GUARD=1 in the environment at the first allocation, or gpu_guard_set()
 * in tests) maps each block on pages of its own, between two inaccessible pages: the block
 * ends within 64 bytes of the page after it, so a write past its end that leaves those bytes
 * faults at once (SIGSEGV where the write is, under a debugger too); a write before its start
 * faults on the page before it once it has crossed the header and the slack in front (64
 * bytes at least). The slack in front and the bytes behind the end hold a pattern that
 * gpu_block_check() verifies with the header: the trainer calls it after every step, so a
 * stray write that stays near the block is named (which block, how far out) by the step that
 * made it. Costs three pages a block and a pass over the slack per check.
 *
 * Invariants: a block's header is written once, at allocation; the pattern bytes are never
 * written after it. Threads: allocation, free and checks of distinct blocks may run on any
 * threads at once; the mode is read atomically.
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpu/gpu_int.h"

#define BLOCK_MAGIC 0x6B636F6C62706D61ull /* "ampblock" */
#define FILL 0xA5                         /* the pattern byte */

typedef struct {
    uint64_t magic;
    void *base;     /* what calloc or mmap returned */
    size_t bytes;   /* the block's length */
    size_t map_len; /* guarded: the mapping's length (0: calloc) */
    char name[24];
    uint64_t sum; /* of the bytes before it */
} header;

_Static_assert(sizeof(header) == 64, "a guarded block stays 64-byte aligned behind its header");

enum { GUARD_UNSET = -1 };
static _Atomic int guard_mode = GUARD_UNSET;

bool gpu_guard_on(void)
{
    int g = atomic_load(&guard_mode);
    if (g == GUARD_UNSET) {
        const char *e = getenv("AMPD_GUARD");
        int want = e != NULL && e[0] != '\0' && strcmp(e, "0") != 0;
        atomic_compare_exchange_strong(&guard_mode, &g, want);
        g = atomic_load(&guard_mode);
    }
    return g == 1;
}

void gpu_guard_set(bool on)
{
    atomic_store(&guard_mode, on ? 1 : 0);
}

static size_t round_up(size_t n, size_t to)
{
    return (n + to - 1) / to * to;
}

static size_t page(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

static uint64_t header_sum(const header *h)
{
    const unsigned char *b = (const unsigned char *)h;
    uint64_t s = 1469598103934665603ull;
    for (size_t i = 0; i < offsetof(header, sum); i++)
        s = (s ^ b[i]) * 1099511628211ull;
    return s;
}

/* p's header, copied out; false when it has been written since its block was made. */
static bool header_read(const void *p, header *h)
{
    memcpy(h, (const char *)p - sizeof(header), sizeof *h);
    return h->magic == BLOCK_MAGIC && h->sum == header_sum(h);
}

/* The block's start in a guarded mapping: its end 64-byte aligned, within 64 bytes of the
 * guard page after it; the pattern in front of the header (64 bytes at least) and behind
 * the end. */
static void *guarded(size_t bytes, header *h)
{
    size_t pg = page(), body = round_up(64 + sizeof(header) + round_up(bytes, 64), pg);
    if (bytes > SIZE_MAX / 2 || body > SIZE_MAX - 2 * pg)
        return NULL;
    char *map =
        mmap(NULL, body + 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED)
        return NULL;
    if (mprotect(map, pg, PROT_NONE) != 0 || mprotect(map + pg + body, pg, PROT_NONE) != 0) {
        munmap(map, body + 2 * pg);
        return NULL;
    }
    char *data = map + pg + body - round_up(bytes, 64);
    memset(map + pg, FILL, (size_t)(data - sizeof(header) - (map + pg)));
    memset(data + bytes, FILL, round_up(bytes, 64) - bytes);
    h->base = map;
    h->map_len = body + 2 * pg;
    return data;
}

void *gpu_block_alloc(size_t bytes, const char *name)
{
    header h = {.magic = BLOCK_MAGIC, .bytes = bytes};
    snprintf(h.name, sizeof h.name, "%s", name != NULL ? name : "block");
    char *data;
    if (gpu_guard_on()) {
        data = guarded(bytes, &h);
    } else {
        h.base = bytes <= SIZE_MAX - sizeof(header) ? calloc(1, sizeof(header) + bytes) : NULL;
        data = h.base != NULL ? (char *)h.base + sizeof(header) : NULL;
    }
    h.sum = header_sum(&h);
    if (data != NULL)
        memcpy(data - sizeof h, &h, sizeof h);
    return data;
}

void gpu_block_free(void *p)
{
    if (p == NULL)
        return;
    header h;
    if (!header_read(p, &h)) /* overwritten: gpu_block_check says so; leave it */
        return;
    if (h.map_len > 0)
        munmap(h.base, h.map_len);
    else
        free(h.base);
}

/* The first byte of [from, to) that is not the pattern, or NULL. */
static const unsigned char *changed(const unsigned char *from, const unsigned char *to)
{
    for (; from < to; from++)
        if (*from != FILL)
            return from;
    return NULL;
}

int gpu_block_check(const void *p, char *why, size_t len)
{
    char dummy[8];
    if (why == NULL) {
        why = dummy;
        len = sizeof dummy;
    }
    if (p == NULL)
        return 0;
    header h;
    if (!header_read(p, &h)) {
        snprintf(why, len, "a block's header was overwritten (a write before its start)");
        return GPU_EGUARD;
    }
    if (h.map_len == 0) /* not guarded */
        return 0;
    const unsigned char *data = p, *front = (const unsigned char *)h.base + page();
    const unsigned char *bad = changed(front, data - sizeof(header));
    if (bad != NULL) {
        snprintf(why, len, "the %s block was written %td bytes before its start", h.name,
                 data - bad);
        return GPU_EGUARD;
    }
    bad = changed(data + h.bytes, data + round_up(h.bytes, 64));
    if (bad != NULL) {
        snprintf(why, len, "the %s block was written %td bytes past its end (%zu bytes)", h.name,
                 bad - (data + h.bytes) + 1, h.bytes);
        return GPU_EGUARD;
    }
    return 0;
}
