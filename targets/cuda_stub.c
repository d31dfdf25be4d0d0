/* A stand-in libcuda.so.1 for build machines without an NVIDIA driver.
 * It lets TVM's CUDA runtime module load (so TVM compiles kernels with nvcc
 * into a fatbin); every driver call reports "no device". */
#define KILN_NO_DEVICE 100 /* CUDA_ERROR_NO_DEVICE */
static const char *kiln_msg = "kiln build stub: no CUDA device on this machine";
int cuGetErrorName(int e, const char **s) { (void)e; *s = kiln_msg; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; *s = kiln_msg; return 0; }
int cuDeviceGetName(char *n, int l, int d) { (void)n; (void)l; (void)d; return KILN_NO_DEVICE; }
int cuFuncSetAttribute(void *f, int a, int v) { (void)f; (void)a; (void)v; return KILN_NO_DEVICE; }
int cuLaunchKernelEx(const void *c, void *f, void **p, void **x) { (void)c; (void)f; (void)p; (void)x; return KILN_NO_DEVICE; }
int cuModuleGetFunction(void **f, void *m, const char *n) { (void)f; (void)m; (void)n; return KILN_NO_DEVICE; }
int cuModuleLoadData(void **m, const void *img) { (void)m; (void)img; return KILN_NO_DEVICE; }
int cuModuleUnload(void *m) { (void)m; return KILN_NO_DEVICE; }
int cuTensorMapEncodeTiled(void) { return KILN_NO_DEVICE; }
