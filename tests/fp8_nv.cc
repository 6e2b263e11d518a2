/*
 * fp8_nv.cc - NVIDIA's own host implementation of the fp8 conversions (the CUDA toolkit's
 * cuda_fp8.hpp, compiled for the host), behind a C interface, for tests/check_fp8.c to
 * compare ampd's gpu/fp8.c with. Built only where the toolkit's headers are (HAVE_CUDA).
 *
 * Threads: reentrant.
 */
#include <cuda_fp8.h>

extern "C" unsigned char fp8_nv_from_f32(float x, int e5m2, int saturate)
{
    return __nv_cvt_float_to_fp8(x, saturate ? __NV_SATFINITE : __NV_NOSAT,
                                 e5m2 ? __NV_E5M2 : __NV_E4M3);
}

/* The fp16 bits of code v (NVIDIA decodes fp8 to half; every fp8 value is exact there). */
extern "C" unsigned short fp8_nv_to_f16(unsigned char v, int e5m2)
{
    __half_raw h = __nv_cvt_fp8_to_halfraw(v, e5m2 ? __NV_E5M2 : __NV_E4M3);
    return h.x;
}
