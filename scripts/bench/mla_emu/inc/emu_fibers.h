/* emu_fibers.h: the state and the block launcher of the fiber SIMT emulation (cuda_internal.cuh
 * and mla_mma.cuh here declare what it defines). Definitions, not declarations: include it once,
 * in an emulator's main file, after mla_mma.cuh. launch() runs a grid one block at a time, one
 * ucontext fiber per thread; a fiber yields at barriers and warp-collective steps. */
#pragma once
#include "mla_mma.cuh"
#include <functional>
#include <vector>

emu_dim threadIdx, blockIdx, blockDim, gridDim;
emu_bar emu_block_bar, emu_warp_bars[32];
uint64_t emu_xbuf[32][32];
uint32_t mla_emu_x[32][32][8];
std::vector<mla::emu_cp> mla::emu_cp_pending[1024];
unsigned mla::emu_cp_committed[1024];
unsigned char emu_smem_buf[240 * 1024] __attribute__((aligned(16)));
unsigned char *mla_emu_smem() { return emu_smem_buf; }
inline void kd_st(void *p, int dt, size_t i, float v) {
    if (dt == KD_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = mla::f2bf(v);
}

/* fibers: the scheduler runs each live fiber in turn until it yields (at a barrier) or ends */
static ucontext_t emu_sched;
static std::vector<ucontext_t> emu_fib;
static std::vector<char> emu_done;
static std::vector<std::vector<char>> emu_stacks;
static int emu_cur;
void emu_yield() { swapcontext(&emu_fib[emu_cur], &emu_sched); }
static std::function<void()> *emu_body;
static void emu_entry() { emu_body[0](); emu_done[emu_cur] = 1; }

template <class F> static void launch(int gx, int gy, int gz, int block, F f) {
    std::function<void()> body = f;
    emu_body = &body;
    blockDim.x = block;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = gz;
    emu_fib.assign(block, ucontext_t());
    emu_stacks.resize(block);
    for (auto &st : emu_stacks) st.resize(256 * 1024);
    for (int z = 0; z < gz; z++)
        for (int y = 0; y < gy; y++)
            for (int x = 0; x < gx; x++) {
                blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
                emu_block_bar = emu_bar{block, 0, 0};
                for (int w = 0; w < 32; w++) emu_warp_bars[w] = emu_bar{32, 0, 0};
                emu_done.assign(block, 0);
                mla::emu_cp_reset();
                for (int t = 0; t < block; t++) {
                    getcontext(&emu_fib[t]);
                    emu_fib[t].uc_stack.ss_sp = emu_stacks[t].data();
                    emu_fib[t].uc_stack.ss_size = emu_stacks[t].size();
                    emu_fib[t].uc_link = &emu_sched;
                    makecontext(&emu_fib[t], emu_entry, 0);
                }
                for (int live = block; live > 0;) {
                    live = 0;
                    for (int t = 0; t < block; t++) {
                        if (emu_done[t]) continue;
                        emu_cur = t;
                        threadIdx.x = t;
                        swapcontext(&emu_sched, &emu_fib[t]);
                        if (!emu_done[t]) live++;
                    }
                }
            }
}

