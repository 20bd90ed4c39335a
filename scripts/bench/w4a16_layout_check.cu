// w4a16_layout_check.cu: host emulation of the W4A16 kernel's fragment logic, no GPU needed.
// Checks that the repacked words (repack_word / repack_scale_word, the code the GPU repack runs),
// the dequantisation bit trick, the mma.m16n8k16 A/B/C fragment layouts, the ldmatrix row
// addresses, the scale-group flush and the split-K part order agree with an fp64 dequant
// reference, on odd shapes and groups 32/64/128. Useful before spending GPU time on a kernel edit.
//   cc -std=c11 -D_GNU_SOURCE -Icore -c core/error.c -o /tmp/error.o
//   nvcc -std=c++17 -arch=sm_90 -Icore -Icuda scripts/bench/w4a16_layout_check.cu cuda/w4a16_skinny.cu \
//        /tmp/error.o -o /tmp/w4a16_layout_check
//   /tmp/w4a16_layout_check        # prints EMU OK (exit 0) or EMU FAIL
#include "../../cuda/w4a16.cu"
static const int XS = 72;
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
static float bf2f(uint32_t b) { uint32_t u = b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint32_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); uint32_t r = ((u >> 16) & 1) + 0x7FFF; return (u + r) >> 16; }
static uint32_t h_and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
static uint32_t h_fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t lo = f2bf(bf2f(a & 0xffff) * bf2f(b & 0xffff) + bf2f(c & 0xffff));
  uint32_t hi = f2bf(bf2f(a >> 16) * bf2f(b >> 16) + bf2f(c >> 16));
  return lo | hi << 16;
}
static void h_dequant4(uint32_t w, uint32_t a[4]) {
  const uint32_t MASK = 0x000F000Fu, EX = 0x43004300u, ONE = 0x3F803F80u, M136 = 0xC308C308u;
  a[0] = h_fma2(h_and_or(w, MASK, EX), ONE, M136);
  a[1] = h_fma2(h_and_or(w >> 4, MASK, EX), ONE, M136);
  a[2] = h_fma2(h_and_or(w >> 8, MASK, EX), ONE, M136);
  a[3] = h_fma2(h_and_or(w >> 12, MASK, EX), ONE, M136);
}
// warp-level mma: A[32][4] regs, B[32][2] regs, C[32][4] floats
static void h_mma(float C[32][4], uint32_t A[32][4], uint32_t B[32][2]) {
  float a[16][16], b[16][8];
  for (int l = 0; l < 32; l++) {
    int g = l >> 2, c = l & 3;
    a[g][2*c] = bf2f(A[l][0] & 0xffff); a[g][2*c+1] = bf2f(A[l][0] >> 16);
    a[g+8][2*c] = bf2f(A[l][1] & 0xffff); a[g+8][2*c+1] = bf2f(A[l][1] >> 16);
    a[g][2*c+8] = bf2f(A[l][2] & 0xffff); a[g][2*c+9] = bf2f(A[l][2] >> 16);
    a[g+8][2*c+8] = bf2f(A[l][3] & 0xffff); a[g+8][2*c+9] = bf2f(A[l][3] >> 16);
    b[2*c][g] = bf2f(B[l][0] & 0xffff); b[2*c+1][g] = bf2f(B[l][0] >> 16);
    b[2*c+8][g] = bf2f(B[l][1] & 0xffff); b[2*c+9][g] = bf2f(B[l][1] >> 16);
  }
  for (int l = 0; l < 32; l++) {
    int g = l >> 2, c = l & 3;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2*c, 2*c+1, 2*c, 2*c+1};
    for (int r = 0; r < 4; r++) { float s = C[l][r]; for (int k = 0; k < 16; k++) s += a[rows[r]][k] * b[k][cols[r]]; C[l][r] = s; }
  }
}
// ldmatrix x2 from a smem tile sx (bf16 bits, row stride XS): lane addresses as in the kernel
static void h_ldmatrix_x2(uint32_t B[32][2], const uint16_t *sx, int j, int kk) {
  const uint16_t *addr[16];
  for (int l = 0; l < 16; l++) addr[l] = sx + (j * 8 + (l & 7)) * XS + kk * 16 + ((l >> 3) & 1) * 8;
  for (int l = 0; l < 32; l++)
    for (int m = 0; m < 2; m++) {
      const uint16_t *row = addr[m * 8 + (l >> 2)];
      B[l][m] = row[2 * (l & 3)] | (uint32_t)row[2 * (l & 3) + 1] << 16;
    }
}
int main() {
  srand(7);
  int fails = 0;
  int shapes[][4] = {{40, 192, 32, 5}, {48, 256, 128, 8}, {33, 256, 64, 13}, {16, 96, 32, 3}, {64, 512, 128, 9}};
  for (auto &sh : shapes) {
    int N = sh[0], K = sh[1], G = sh[2], M = sh[3];
    std::vector<uint32_t> raw((size_t)N * K / 8);
    for (auto &w : raw) w = (uint32_t)rand() ^ ((uint32_t)rand() << 16);
    int ng = K / G;
    std::vector<uint16_t> sc((size_t)N * ng);
    for (auto &s : sc) s = (uint16_t)f2bf((rand() / (float)RAND_MAX - 0.3f) * 0.05f);
    std::vector<uint16_t> x((size_t)M * K);
    for (auto &v : x) v = (uint16_t)f2bf((rand() / (float)RAND_MAX - 0.5f) * 4);
    // reference
    std::vector<double> ref((size_t)M * N);
    for (int m = 0; m < M; m++) for (int n = 0; n < N; n++) {
      double s = 0;
      for (int k = 0; k < K; k++) {
        int u = (raw[(size_t)n * (K/8) + k/8] >> (4 * (k & 7))) & 15;
        s += (double)(u - 8) * bf2f(sc[(size_t)n * ng + k / G]) * bf2f(x[(size_t)m * K + k]);
      }
      ref[(size_t)m * N + n] = s;
    }
    int kc = kc_of(K), nt = tiles_of(N), gp = groups_pad_of(K, G);
    int parts, cpp; split_of(K, G, (N + 63) / 64, 1536, &parts, &cpp);
    parts = (kc >= 2 && G <= 64) ? 2 : parts;  // exercise a split
    cpp = (kc + parts - 1) / parts; if (G == 128 && cpp % 2) cpp++; parts = (kc + cpp - 1) / cpp;
    std::vector<float> out((size_t)M * N, NAN);
    std::vector<float> partial((size_t)parts * M * N, NAN);
    const int MT8 = (M + 7) / 8;
    for (int t = 0; t < nt; t++) for (int part = 0; part < parts; part++) for (int jt = 0; jt < MT8; jt++) {
      int c0 = part * cpp, c1 = std::min(kc, c0 + cpp);
      float acc[32][4] = {}, tmp[32][4] = {};
      for (int c = c0; c < c1; c++) {
        // smem x tile of 8 tokens (tile jt) x 64 k, zero-filled
        std::vector<uint16_t> sx(8 * XS, 0);
        for (int r = 0; r < 8; r++) for (int kk = 0; kk < 64; kk++) {
          int m = jt * 8 + r, k = c * 64 + kk;
          if (m < M && k < K) sx[r * XS + kk] = x[(size_t)m * K + k];
        }
        uint32_t sw[16]; int g0 = (c * 64) / G; int SG = G >= 64 ? 1 : 64 / G;
        for (int gl = 0; gl < SG; gl++) for (int j = 0; j < 8; j++) sw[gl * 8 + j] = repack_scale_word(sc.data(), N, ng, t, g0 + gl, j);
        for (int kk = 0; kk < 4; kk++) {
          uint32_t B[32][2], A[32][4];
          h_ldmatrix_x2(B, sx.data(), 0, kk);
          for (int l = 0; l < 32; l++) h_dequant4(repack_word(raw.data(), N, K, t, c, l, kk), A[l]);
          h_mma(tmp, A, B);
          int gs = log2_of(G);
          if (((c * 64 + kk * 16 + 16) & (G - 1)) == 0) {
            int gl = (kk * 16) >> gs;
            for (int l = 0; l < 32; l++) {
              uint32_t w2 = sw[gl * 8 + (l >> 2)];
              float slo = bf2f(w2 & 0xffff), shi = bf2f(w2 >> 16);
              acc[l][0] = fmaf(tmp[l][0], slo, acc[l][0]); acc[l][1] = fmaf(tmp[l][1], slo, acc[l][1]);
              acc[l][2] = fmaf(tmp[l][2], shi, acc[l][2]); acc[l][3] = fmaf(tmp[l][3], shi, acc[l][3]);
              for (int r = 0; r < 4; r++) tmp[l][r] = 0;
            }
          }
        }
      }
      for (int l = 0; l < 32; l++) for (int r = 0; r < 4; r++) {
        int n = t * 16 + (l >> 2) + (r >= 2 ? 8 : 0), m = jt * 8 + (l & 3) * 2 + (r & 1);
        if (n < N && m < M) partial[((size_t)part * M + m) * N + n] = acc[l][r];
      }
    }
    double maxerr = 0, maxref = 0; int nan = 0;
    for (int m = 0; m < M; m++) for (int n = 0; n < N; n++) {
      float v = partial[(size_t)m * N + n];
      for (int p = 1; p < parts; p++) v += partial[((size_t)p * M + m) * N + n];
      if (!(v == v)) nan++;
      maxerr = std::max(maxerr, fabs(v - ref[(size_t)m * N + n])); maxref = std::max(maxref, fabs(ref[(size_t)m * N + n]));
    }
    printf("N %d K %d G %d M %d parts %d: max err %.3g (max |ref| %.3g) nan %d\n", N, K, G, M, parts, maxerr, maxref, nan);
    if (nan || maxerr > 1e-5 * maxref) fails++;
  }
  printf(fails ? "EMU FAIL\n" : "EMU OK\n");
  return fails;
}
