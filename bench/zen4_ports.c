/* Which instructions share vpdpbusd's execution pipes on this CPU (the VNNI kernel's choices in
 * codegen/vnni_linear.py rest on it): a loop of 12 independent vpdpbusd, alone and with 4 or 8
 * other instructions beside them. Where an addition leaves the time per iteration unchanged it
 * runs on other pipes; where it adds one dot's time per instruction it competes for vpdpbusd's.
 *
 *     gcc -O2 bench/zen4_ports.c -o build/zen4_ports && build/zen4_ports
 *
 * Needs AVX-512 VNNI and GFNI (AMD Zen 4, Intel Ice Lake and later). Not part of `make test`.
 */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define DOT(r) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #r "\n"
#define DOTS DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7) DOT(8) DOT(9) DOT(10) DOT(11)
#define GF2P8(r) "vgf2p8affineqb $0, %%zmm29, %%zmm28, %%zmm" #r "\n"
#define AND(r) "vpandq %%zmm29, %%zmm28, %%zmm" #r "\n"
#define AND_MEM(r) "vpandq 128(%0), %%zmm29, %%zmm" #r "\n"
#define MUL(r) "vmulps %%zmm29, %%zmm28, %%zmm" #r "\n"
#define FMA(r) "vfmadd231ps %%zmm29, %%zmm28, %%zmm" #r "\n"
#define CVT(r) "vcvtdq2ps %%zmm28, %%zmm" #r "\n"
#define BCAST_MEM(r) "vpbroadcastd 8(%0), %%zmm" #r "\n"
#define BCAST_GPR(r) "vpbroadcastd %%eax, %%zmm" #r "\n"
#define FOUR(op) op(12) op(13) op(14) op(15)
#define EIGHT(op) op(12) op(13) op(14) op(15) op(20) op(21) op(22) op(23)

#define RUN(name, body)                                                                   \
    {                                                                                     \
        long n = 20000000;                                                                \
        double t0 = now();                                                                \
        for (long i = 0; i < n; i++) __asm__ volatile(body ::"r"(buf) : "eax", "memory"); \
        double ns = (now() - t0) / n * 1e9;                                               \
        printf("| %s | %.2f | %.2f |\n", name, ns, 12 / ns);                            \
    }

int main(void) {
    static int buf[256] __attribute__((aligned(64)));
    printf("| 12 vpdpbusd + | ns per iteration | vpdpbusd per ns |\n|---|---|---|\n");
    RUN("nothing", DOTS)
    RUN("4 vgf2p8affineqb", DOTS FOUR(GF2P8))
    RUN("8 vgf2p8affineqb", DOTS EIGHT(GF2P8))
    RUN("4 vpandq", DOTS FOUR(AND))
    RUN("8 vpandq", DOTS EIGHT(AND))
    RUN("4 vpandq from memory", DOTS FOUR(AND_MEM))
    RUN("4 vmulps", DOTS FOUR(MUL))
    RUN("4 vfmadd231ps", DOTS FOUR(FMA))
    RUN("4 vcvtdq2ps", DOTS FOUR(CVT))
    RUN("8 vpbroadcastd from memory", DOTS EIGHT(BCAST_MEM))
    RUN("4 vpbroadcastd from a GPR", DOTS FOUR(BCAST_GPR))
    return 0;
}
