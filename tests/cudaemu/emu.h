/*
 * emu.h - what the parts of the CUDA emulator share (emu.cc, lt.cc and the cub shim):
 * device allocations and the access window around host code that touches them.
 *
 * Device memory is kept PROT_NONE while host code runs, so that host code reading a device
 * pointer faults as it would on a GPU. Between emu_device_begin() (which takes the
 * emulator's lock) and emu_device_end() the code is the device's: an allocation it touches
 * is opened, and the outermost emu_device_end() closes what was opened. Calls nest.
 */
#ifndef AMPD_CUDAEMU_EMU_H
#define AMPD_CUDAEMU_EMU_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 0 when [p, p + n) lies inside one live device allocation, else -1 */
int emu_device_span(const void *p, size_t n);
void emu_device_begin(void);
void emu_device_end(void);
/* "cudaemu: <message>" on stderr */
void emu_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#ifdef __cplusplus
}
#endif

#endif /* AMPD_CUDAEMU_EMU_H */
