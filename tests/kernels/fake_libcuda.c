/* A stand-in for libcuda.so.1 with the entry points the shipped-binary loader calls
 * (kernels/triton/binaries_cuda.py): it loads nothing and launches nothing, and keeps what
 * it was given so a test can read it back.  Built by tests/kernels/test_shipped_binaries.py. */
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 64
int capability_major = 9, capability_minor = 0, driver_version = 12080, shared_optin = 232448;
int static_shared = 0, max_threads = 1024, fail_load = 0;
int n_declared = 0;                     /* parameters cuFuncGetParamInfo reports (-1: no such call) */
size_t declared_sizes[MAX_PARAMS];
int n_copied = 0;                       /* parameters cuLaunchKernel copies (8 bytes each) */
uint64_t launched_params[MAX_PARAMS];
unsigned launched_grid[3], launched_block[3], launched_shared;
void *launched_stream, *launched_function;
int launches = 0, dynamic_shared_set = -1;
static void *current = 0;

int cuInit(unsigned flags) { return 0; }
int cuDriverGetVersion(int *v) { *v = driver_version; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) {
  *v = attr == 75 ? capability_major : attr == 76 ? capability_minor : attr == 97 ? shared_optin : 0;
  return 0;
}
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSetCurrent(void *c) { current = c; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int dev) { *c = (void *)(uintptr_t)(0x1000 + dev); return 0; }
int cuModuleLoadData(void **m, const void *image) { if (fail_load) return 200; *m = (void *)0x2000; return 0; }
int cuModuleGetFunction(void **f, void *m, const char *name) { *f = (void *)0x3000; return 0; }
int cuFuncGetAttribute(int *v, int attr, void *f) { *v = attr == 0 ? max_threads : attr == 1 ? static_shared : 0; return 0; }
int cuFuncSetAttribute(void *f, int attr, int value) { if (attr == 8) dynamic_shared_set = value; return 0; }
int cuFuncSetCacheConfig(void *f, int config) { return 0; }
int cuFuncGetParamInfo(void *f, size_t index, size_t *offset, size_t *size) {
  if ((int)index >= n_declared) return 1;
  *offset = 0; *size = declared_sizes[index]; return 0;
}
int cuGetErrorString(int code, const char **text) { *text = "stub error"; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **params, void **extra) {
  launched_function = f; launched_stream = stream; launched_shared = shared;
  launched_grid[0] = gx; launched_grid[1] = gy; launched_grid[2] = gz;
  launched_block[0] = bx; launched_block[1] = by; launched_block[2] = bz;
  for (int i = 0; i < n_copied && i < MAX_PARAMS; i++) memcpy(&launched_params[i], params[i], 8);
  launches++;
  return 0;
}
