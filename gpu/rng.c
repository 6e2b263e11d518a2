/*
 * rng.c - the seeded random number generator every component draws from: xoshiro256**
 * seeded through splitmix64, with uniform, normal (Box-Muller) and bounded integer draws.
 *
 * Invariants: a gpu_rng stream depends only on its seed, so a job with the same seed is
 * reproducible bit for bit. Threads: a gpu_rng belongs to one thread.
 */
#include <math.h>

#include "gpu/gpu_int.h"

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void gpu_rng_seed(gpu_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t gpu_rng_next(gpu_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

float gpu_rng_uniform(gpu_rng *r)
{
    return (float)(gpu_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

float gpu_rng_normal(gpu_rng *r)
{
    double u1 = ((double)(gpu_rng_next(r) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (double)(gpu_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint32_t gpu_rng_below(gpu_rng *r, uint32_t n)
{
    return (uint32_t)(((gpu_rng_next(r) >> 32) * (uint64_t)n) >> 32);
}
