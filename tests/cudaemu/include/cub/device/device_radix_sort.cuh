/*
 * device_radix_sort.cuh (emulator) - cub::DeviceRadixSort::SortPairs on the CPU for the CUDA
 * emulator: the same two-call protocol (a size query with d_temp_storage NULL, then the
 * sort) and the same result, a stable ascending sort of the pairs by bits
 * [begin_bit, end_bit) of the key. The temporary storage is checked to be device memory of
 * the size the query returned (emu_device_span in emu.cc).
 */
#ifndef AMPD_CUDAEMU_CUB_RADIX_SORT_CUH
#define AMPD_CUDAEMU_CUB_RADIX_SORT_CUH

#include <algorithm>
#include <vector>

#include "cuda_runtime.h"
#include "tests/cudaemu/emu.h"

namespace cub {
struct DeviceRadixSort {
    template <typename K, typename V, typename N>
    static cudaError_t SortPairs(void *d_temp_storage, size_t &temp_storage_bytes,
                                 const K *keys_in, K *keys_out, const V *values_in,
                                 V *values_out, N num_items, int begin_bit = 0,
                                 int end_bit = (int)sizeof(K) * 8, cudaStream_t stream = 0)
    {
        (void)stream;
        size_t n = (size_t)num_items;
        if (d_temp_storage == NULL) {
            temp_storage_bytes = 256 + n * (sizeof(K) + sizeof(V));
            return cudaSuccess;
        }
        emu_device_begin();
        cudaError_t e = sort(d_temp_storage, temp_storage_bytes, keys_in, keys_out, values_in,
                             values_out, n, begin_bit, end_bit);
        emu_device_end();
        return e;
    }

  private:
    template <typename K, typename V>
    static cudaError_t sort(void *d_temp_storage, size_t temp_storage_bytes, const K *keys_in,
                            K *keys_out, const V *values_in, V *values_out, size_t n,
                            int begin_bit, int end_bit)
    {
        if (emu_device_span(d_temp_storage, temp_storage_bytes) != 0 ||
            temp_storage_bytes < 256 + n * (sizeof(K) + sizeof(V)) ||
            emu_device_span(keys_in, n * sizeof(K)) != 0 ||
            emu_device_span(keys_out, n * sizeof(K)) != 0 ||
            emu_device_span(values_in, n * sizeof(V)) != 0 ||
            emu_device_span(values_out, n * sizeof(V)) != 0 || begin_bit < 0 ||
            end_bit > (int)sizeof(K) * 8 || begin_bit >= end_bit)
            return cudaErrorInvalidValue;
        unsigned long long m = end_bit - begin_bit >= 64
                                   ? ~0ULL
                                   : ((1ULL << (end_bit - begin_bit)) - 1) << begin_bit;
        std::vector<size_t> order(n);
        for (size_t i = 0; i < n; i++)
            order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
            return ((unsigned long long)keys_in[a] & m) < ((unsigned long long)keys_in[b] & m);
        });
        std::vector<K> k(n);
        std::vector<V> v(n);
        for (size_t i = 0; i < n; i++) {
            k[i] = keys_in[order[i]];
            v[i] = values_in[order[i]];
        }
        std::copy(k.begin(), k.end(), keys_out);
        std::copy(v.begin(), v.end(), values_out);
        return cudaSuccess;
    }
};
} /* namespace cub */

#endif /* AMPD_CUDAEMU_CUB_RADIX_SORT_CUH */
