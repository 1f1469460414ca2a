// Force-included into every C++ source (lorafuse._ext.compile_flags: -include glibc_compat.h), so
// a module built on a new glibc loads on glibc 2.28, the floor of torch's own manylinux_2_28
// wheels, and `auditwheel repair --plat manylinux_2_28_*` can tag a wheel carrying it.
//
// glibc 2.34 moved dlopen & co. and pthread_once into libc.so.6 under new symbol versions; the
// older versions stay there as compatibility symbols (and in libdl / libpthread on older glibc,
// which torch loads), so every reference is bound to the old version here. libstdc++ (GCC 11+)
// reads glibc 2.32's __libc_single_threaded when <sys/single_threaded.h> exists; the build renames
// it (-D__libc_single_threaded=lorafuse_libc_single_threaded) to this constant 0, "never
// single-threaded": reference counts always use atomics, as on glibc before 2.32.
// Reproduce: `auditwheel show` on a wheel built without it names GLIBC_2.32 and GLIBC_2.34 (and
// GLIBC_2.29 where a kernel calls the double exp, as the mixer kernels do).
#pragma once
#if defined(__linux__)
#include <features.h>  // defines __GLIBC__ (g++ has set _GNU_SOURCE on its command line already)
#endif
#if defined(__GLIBC__)
#if defined(__x86_64__)
#define LORAFUSE_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define LORAFUSE_GLIBC_BASE "GLIBC_2.17"
#endif
#ifdef LORAFUSE_GLIBC_BASE
__asm__(".symver dlopen,dlopen@" LORAFUSE_GLIBC_BASE);
__asm__(".symver dlclose,dlclose@" LORAFUSE_GLIBC_BASE);
__asm__(".symver dlsym,dlsym@" LORAFUSE_GLIBC_BASE);
__asm__(".symver dladdr,dladdr@" LORAFUSE_GLIBC_BASE);
__asm__(".symver dlerror,dlerror@" LORAFUSE_GLIBC_BASE);
__asm__(".symver pthread_once,pthread_once@" LORAFUSE_GLIBC_BASE);
// glibc 2.29 gave exp, exp2, log, log2 and pow new versions (faster code, the same results within
// their ulp bounds); the base versions stay as compatibility symbols.
__asm__(".symver exp,exp@" LORAFUSE_GLIBC_BASE);
__asm__(".symver exp2,exp2@" LORAFUSE_GLIBC_BASE);
__asm__(".symver log,log@" LORAFUSE_GLIBC_BASE);
__asm__(".symver log2,log2@" LORAFUSE_GLIBC_BASE);
__asm__(".symver pow,pow@" LORAFUSE_GLIBC_BASE);
#endif
#ifdef __cplusplus
extern "C" {
#endif
__attribute__((weak, visibility("hidden"))) char lorafuse_libc_single_threaded = 0;
#ifdef __cplusplus
}
#endif
#endif
