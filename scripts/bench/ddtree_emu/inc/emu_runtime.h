/* emu_runtime.h: the SIMT emulation's state and its launch (cuda_internal.cuh declares the
 * state). Include it once per program, after cuda_internal.cuh and before the kernels. */
#pragma once
#include <memory>
#include <thread>
#include <vector>

thread_local emu_dim threadIdx, blockIdx;
emu_dim blockDim, gridDim;
std::barrier<> *emu_block_bar;
std::barrier<> *emu_warp_bar[64];
uint64_t emu_xbuf[64][32];
std::mutex emu_atomic_mu;

/* the blocks of a grid.x x grid_y grid one after another (__shared__ is static), one OS thread
 * per CUDA thread; a last partial warp gets a barrier of its own size */
template <class F> static void launch(int grid, int block, F f, int grid_y = 1) {
    blockDim.x = block;
    gridDim.x = grid;
    gridDim.y = grid_y;
    for (int by = 0; by < grid_y; by++)
        for (int b = 0; b < grid; b++) {
            std::barrier<> bar(block);
            emu_block_bar = &bar;
            std::vector<std::unique_ptr<std::barrier<>>> wb;
            for (int w = 0; w < (block + 31) / 32; w++) {
                wb.emplace_back(new std::barrier<>(block - 32 * w < 32 ? block - 32 * w : 32));
                emu_warp_bar[w] = wb.back().get();
            }
            std::vector<std::thread> th;
            for (int t = 0; t < block; t++)
                th.emplace_back([&, t, b, by] { threadIdx.x = t; blockIdx.x = b; blockIdx.y = by; f(); });
            for (auto &x : th) x.join();
        }
}
