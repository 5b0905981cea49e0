// A probe, not part of the app: mlxchat's exact 4-bit product (issue 51) on AMX-BF16, as measured
// on the Intel host of 2026-12-07 (docs/performance.md, "Many streams"). Build and run (a CPU
// with AMX-BF16 and Linux 5.16+; nothing else of the repository is needed):
//
//     g++ -O3 -std=c++20 -march=sapphirerapids bench/amx_probe.cpp -o /tmp/amx_probe
//     /tmp/amx_probe 1536 576      # N K: the bundled model's gate/up shape; add a third
//                                  # argument (copies) to read the weights from memory
//
// x is fp32 on the exact path, so it goes in as three bf16 parts, x = h + m + l, each exact
// (h: x's top 8 significant bits, truncated; m and l: the next 8 and 8), and every product of a
// part with a code q (0..15, exact in bf16) is exact in fp32. The weights' codes are the A tile
// (16 weight rows x 32 codes of one group, in natural order: byte j of a row's group gives the
// bf16 pair (q[2j], q[2j+1]) with one widening, a shift, a ternlog and a vpermw), x's parts the
// B tile (VNNI pairs; columns p * M + m). Per group g, TDPBF16PS gives C_g[n][p, m] = sum_k q x_p;
// then acc[n] += s[n, g] * C_g[n] (fp32), and the biases enter as one more product (b in fp16 is
// two exact bf16 parts, x's group sums three). y[m][n] = (acc[p=0] + acc[p=1]) + acc[p=2]. So
// y = s * sum(q x) + b * sum(x) with every product exact and the sums in fp32, in an order that
// does not depend on how many rows of x come together: each row's bits equal the row alone
// (checked below). AMX (like VDPBF16PS) treats bf16 denormal inputs as zero and flushes fp32
// denormal results to zero, without MXCSR: a part l below 2^-126 (|x| below ~2^-110) is lost,
// as is a group sum smaller than that. What it costs: printed per 32 weights a row, for 1, 2
// and 4 rows of x; the exact AVX-512 kernel of engine/kernels/csrc took 1.97 ns (one row) and
// 4.10 ns (four rows) per 32 weights a row on the same shape, weights in cache, one thread.
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <chrono>
#include <cmath>
#include <algorithm>
#include <sys/syscall.h>
#include <unistd.h>

static float h2f(uint16_t h) { return _cvtsh_ss(h); }

struct TileCfg { uint8_t palette, start; uint8_t rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static void amx_init() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); exit(1); }
  TileCfg c{}; c.palette = 1;
  for (int t = 0; t < 6; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

static inline uint16_t bf16_trunc(float f) { uint32_t u; memcpy(&u, &f, 4); return uint16_t(u >> 16); }
static inline float bf2f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; memcpy(&f, &u, 4); return f; }

// B tiles: per chunk c (32 k), 16 rows (pairs) x 16 dword columns; col = p * M + m (p: part 0..2).
// XB: the bias product's B tiles: x's group sums (fp32, in k order) as three bf16 parts, for
// both halves (b's hi and lo parts) of its K.
void prep(const float* x, int M, int64_t K, int gs, uint16_t* B, uint16_t* XB) {
  const int64_t C = K / 32, G = K / gs;
  memset(B, 0, C * 1024);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      float v = x[m * K + k];
      uint16_t h = bf16_trunc(v); float r = v - bf2f(h);
      uint16_t md = bf16_trunc(r); float l = r - bf2f(md);
      uint16_t lo = bf16_trunc(l);
      uint16_t parts[3] = {h, md, lo};
      int64_t c = k / 32, j = (k % 32) / 2, e = k % 2;
      for (int p = 0; p < 3; ++p) B[c * 512 + j * 32 + (p * M + m) * 2 + e] = parts[p];
    }
  const int64_t KB = (2 * G + 31) / 32 * 32;
  memset(XB, 0, KB / 32 * 1024);
  for (int m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float v = 0; for (int k = 0; k < gs; ++k) v += x[m * K + g * gs + k];
      uint16_t h = bf16_trunc(v); float r = v - bf2f(h);
      uint16_t md = bf16_trunc(r); float l = r - bf2f(md);
      uint16_t parts[3] = {h, md, bf16_trunc(l)};
      for (int64_t kk : {g, G + g}) {
        int64_t c = kk / 32, j = (kk % 32) / 2, e = kk % 2;
        for (int p = 0; p < 3; ++p) XB[c * 512 + j * 32 + (p * M + m) * 2 + e] = parts[p];
      }
    }
}

// rows [n0, n1), n1 - n0 multiple of 16 here
void rows_amx(const uint32_t* w, const uint16_t* sc, const uint16_t* bi, int64_t K, int gs, int M,
              const uint16_t* B, const uint16_t* XB, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t G = K / gs, rowb = K / 2;  // group size 32
  alignas(64) uint16_t A[2][16 * 32];
  alignas(64) float s32[16 * 64];  // G <= 64
  const int64_t KB = (2 * G + 31) / 32 * 32;
  alignas(64) uint16_t Ab[16 * 256] = {};
  const __m512i tbl = _mm512_set_epi16(0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
      0x4170,0x4160,0x4150,0x4140,0x4130,0x4120,0x4110,0x4100,0x40e0,0x40c0,0x40a0,0x4080,0x4040,0x4000,0x3f80,0);
  const __m512i m4 = _mm512_set1_epi32(0x000F000F);
  for (int64_t nb = n0; nb < n1; nb += 16) {
    // scales as fp32 (vector conversion); biases as the A tile of the bias product: row r =
    // [hi parts of b[r][0..G), lo parts], 2G padded to KB (multiple of 32) bf16
    for (int r = 0; r < 16; ++r) {
      uint16_t* ab = Ab + r * KB;
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
        _mm512_storeu_ps(s32 + r * 64 + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sc + (nb + r) * G + g)));
        const __m512 bv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, bi + (nb + r) * G + g));
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(bv), _mm512_set1_epi32(0xFFFF0000)));
        const __m512 lo = _mm512_sub_ps(bv, hi);
        _mm256_mask_storeu_epi16(ab + g, k, (__m256i)_mm512_cvtneps_pbh(hi));
        _mm256_mask_storeu_epi16(ab + G + g, k, (__m256i)_mm512_cvtneps_pbh(lo));
      }
    }
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w) + nb * rowb;
    alignas(64) float Cq[2][16 * 16];
    auto build = [&](int64_t c, uint16_t* a) {
      for (int r = 0; r < 16; ++r) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + r * rowb + c * 16)));
        __m512i d = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), m4, 0xA8);  // (b | s) & m
        _mm512_store_si512(a + r * 32, _mm512_permutexvar_epi16(d, tbl));
      }
    };
    auto scale = [&](int64_t g, const float* cb) {
      for (int r = 0; r < 16; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cb + r * 16), _mm512_set1_ps(s32[r * 64 + g]), acc[r]);
      }
    };
    // two groups a pass (tiles 0-2 and 3-5); each group's scaling after the next group's
    // product is issued (group size 32 here)
    for (int64_t g = 0; g < G; g += 2) {
      build(g, A[0]);
      _tile_loadd(0, A[0], 64); _tile_loadd(1, B + g * 512, 64); _tile_zero(2); _tile_dpbf16ps(2, 0, 1);
      if (g > 0) scale(g - 1, Cq[1]);
      _tile_stored(2, Cq[0], 64);
      if (g + 1 < G) {
        build(g + 1, A[1]);
        _tile_loadd(3, A[1], 64); _tile_loadd(4, B + (g + 1) * 512, 64); _tile_zero(5); _tile_dpbf16ps(5, 3, 4);
      }
      scale(g, Cq[0]);
      if (g + 1 < G) _tile_stored(5, Cq[1], 64);
    }
    if (G % 2 == 0) scale(G - 1, Cq[1]);
    // the biases times x's group sums: one more product, added once
    _tile_zero(2);
    for (int64_t c = 0; c < KB / 32; ++c) {
      _tile_loadd(0, Ab + c * 32, KB * 2);
      _tile_loadd(1, XB + c * 512, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, Cq[0], 64);
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_add_ps(acc[r], _mm512_load_ps(Cq[0] + r * 16));
    alignas(64) float out[16 * 16];
    for (int r = 0; r < 16; ++r) _mm512_store_ps(out + r * 16, acc[r]);
    for (int r = 0; r < 16; ++r)
      for (int m = 0; m < M; ++m) y[m * ldy + nb + r] = (out[r * 16 + m] + out[r * 16 + M + m]) + out[r * 16 + 2 * M + m];
  }
}

int main(int argc, char** argv) {
  int64_t N = atoi(argv[1]), K = atoi(argv[2]); int copies = argc > 3 ? atoi(argv[3]) : 1;
  int gs = 32; int64_t G = K / gs;
  amx_init();
  std::mt19937 rng(0);
  std::vector<std::vector<uint32_t>> ws(copies, std::vector<uint32_t>(N * K / 8));
  std::vector<std::vector<uint16_t>> ss(copies, std::vector<uint16_t>(N * G)), bs(copies, std::vector<uint16_t>(N * G));
  for (int c = 0; c < copies; ++c) { for (auto& v : ws[c]) v = rng(); for (auto& v : ss[c]) v = 0x2000 + (rng() & 0x3ff); for (auto& v : bs[c]) v = 0xa000 + (rng() & 0x3ff); }
  const int MM = 5;
  std::vector<float> x(MM * K);
  std::normal_distribution<float> nd(0, 1);
  for (auto& v : x) v = nd(rng);
  std::vector<uint16_t> B(K / 32 * 512); std::vector<uint16_t> XS(4096);  // the bias product's B tiles
  // correctness vs double reference, and identity across M
  std::vector<float> y1(N), yM(MM * N);
  prep(x.data(), MM, K, gs, B.data(), XS.data());
  rows_amx(ws[0].data(), ss[0].data(), bs[0].data(), K, gs, MM, B.data(), XS.data(), 0, N, yM.data(), N);
  double maxrel = 0; int ident = 1;
  for (int m = 0; m < MM; ++m) {
    prep(x.data() + m * K, 1, K, gs, B.data(), XS.data());
    rows_amx(ws[0].data(), ss[0].data(), bs[0].data(), K, gs, 1, B.data(), XS.data(), 0, N, y1.data(), N);
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0, mag = 0;
      const uint8_t* wr = reinterpret_cast<const uint8_t*>(ws[0].data()) + n * K / 2;
      for (int64_t k = 0; k < K; ++k) {
        int q = (wr[k / 2] >> (4 * (k & 1))) & 15;
        double wv = q * (double)h2f(ss[0][n * G + k / gs]) + h2f(bs[0][n * G + k / gs]);
        ref += wv * x[m * K + k]; mag += fabs(wv * x[m * K + k]);
      }
      maxrel = std::max(maxrel, fabs(y1[n] - ref) / mag);
      if (memcmp(&y1[n], &yM[m * N + n], 4)) ident = 0;
    }
  }
  printf("max |err| / sum|terms| = %.3g (fp32 eps 6e-8); M=1 bits == M=%d bits: %s\n", maxrel, MM, ident ? "yes" : "NO");
  for (int M : {1, 2, 4}) {
    prep(x.data(), M, K, gs, B.data(), XS.data());
    std::vector<float> y(M * N);
    double best = 1e30;
    for (int rep = 0; rep < 15; ++rep) {
      auto t = std::chrono::steady_clock::now();
      for (int it = 0; it < 20; ++it) for (int c = 0; c < copies; ++c)
        rows_amx(ws[c].data(), ss[c].data(), bs[c].data(), K, gs, M, B.data(), XS.data(), 0, N, y.data(), N);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / (20 * copies));
    }
    printf("AMX N=%ld K=%ld M=%d copies=%d: %.1f us, %.2f ns per 32w per row\n", N, K, M, copies, best * 1e6, best * 1e9 / (N * K) * 32);
  }
}
