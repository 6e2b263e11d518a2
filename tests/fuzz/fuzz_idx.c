/*
 * fuzz_idx.c - libFuzzer harness of the IDX loader (gpu/data.c, gpu_dataset_load_idx): the
 * input is an images file and a labels file (fuzz.h's split: a uint16 length, the images,
 * the labels), raw or gzip, as a data root may hold them. A set the loader accepts must keep
 * its invariants (count, features and classes positive, classes at most 256, every label
 * below classes) and gather its first and last rows; one it refuses must not have run out
 * of memory (a header's claims are not allocated before the data is there).
 *
 * Seeds: tests/fuzz/corpus/idx/ (a 3-image 2x2 pair, raw and gzip).
 */
#include "gpu/gpu.h"
#include "tests/fuzz/fuzz.h"

#define GATHER_MAX_FEATURES (1 << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *img, *lab;
    size_t nimg, nlab;
    char pimg[64], plab[64], err[512] = "";
    gpu_dataset *d = NULL;
    int fi, fl, rc;

    fuzz_split(data, size, &img, &nimg, &lab, &nlab);
    fi = fuzz_file(img, nimg, pimg, sizeof(pimg));
    fl = fuzz_file(lab, nlab, plab, sizeof(plab));
    if (fi < 0 || fl < 0)
        fuzz_fail("cannot make the input files");
    rc = gpu_dataset_load_idx(pimg, plab, &d, err, sizeof(err));
    if (rc == 0) {
        int n = gpu_dataset_count(d), f = gpu_dataset_features(d), k = gpu_dataset_classes(d);
        if (n <= 0 || f <= 0 || k <= 0 || k > 256)
            fuzz_fail("a set of %d rows, %d features and %d classes was accepted", n, f, k);
        if (f <= GATHER_MAX_FEATURES) {
            int idx[2] = {0, n - 1}, y[2];
            float *x = malloc(sizeof(float) * 2 * (size_t)f);
            if (!x)
                fuzz_fail("out of memory");
            gpu_dataset_gather(d, idx, 2, x, y);
            if (y[0] < 0 || y[0] >= k || y[1] < 0 || y[1] >= k)
                fuzz_fail("labels %d and %d of %d classes", y[0], y[1], k);
            free(x);
        }
        gpu_dataset_free(d);
    } else if (!err[0]) {
        fuzz_fail("a refused IDX pair without a message");
    } else if (rc == GPU_ENOMEM) {
        fuzz_fail("%zu bytes of input ran the loader out of memory: %s", size, err);
    }
    close(fi);
    close(fl);
    return 0;
}
