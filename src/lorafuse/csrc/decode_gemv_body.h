// The SIMD body of gemv_rows (decode_gemv.h), written once against a vector traits struct V and
// included by decode_gemv_avx512.cpp / decode_gemv_avx2.cpp inside their target pragma and their
// own namespace, after V is defined:
//   V::F (fp32 vector), V::W (lanes), V::kRegs (vector registers), V::kMaxRows (rows of x per
//   pass), zero / load / set1 / mul / fma / hsum, and the weight loaders from_bf16, from_f16,
//   from_i8 (W codes as floats) and q4(bytes, c) (sub-vector c of a 32-weight group's codes,
//   minus 8, as floats; weight index c·W within the group).
// No lambdas here: a lambda does not inherit the target pragma's ISA on every compiler.

// Bytes of W per weight, times 2 (q4 is half a byte).
template <WFmt Fm>
constexpr int64_t twice_bytes() {
  return Fm == WFmt::F32 ? 8 : Fm == WFmt::I8 ? 2 : Fm == WFmt::Q4 ? 1 : 4;
}

// Weight rows per block for M rows of x: as many independent FMA chains as the registers hold
// (M·R accumulators, R weight vectors, one x vector, one scale), a power of two up to 8.
template <int M>
constexpr int rows_per_block() {
  constexpr int fit = (V::kRegs - 2) / (M + 1);
  return fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

// Vector c of weight row `row` at element k (plain formats: k + c·W; grouped ones: within the
// group starting at k), dequantised except for the scale.
template <WFmt Fm>
inline typename V::F load_w(const void* row, int64_t k, int c) {
  if constexpr (Fm == WFmt::F32) {
    return V::load(static_cast<const float*>(row) + k + c * V::W);
  } else if constexpr (Fm == WFmt::BF16) {
    return V::from_bf16(static_cast<const uint16_t*>(row) + k + c * V::W);
  } else if constexpr (Fm == WFmt::F16) {
    return V::from_f16(static_cast<const uint16_t*>(row) + k + c * V::W);
  } else if constexpr (Fm == WFmt::I8) {
    return V::from_i8(static_cast<const int8_t*>(row) + k + c * V::W);
  } else {
    return V::q4(static_cast<const uint8_t*>(row) + k / 2, c);
  }
}

// acc[m][j] += Σ over one chunk (CH weights from element k) of x[m]·W[j]; `sc` the chunk's
// scales (grouped formats) or null.
template <WFmt Fm, int M, int R, int CH>
inline void chunk(const void* const* rows, const float* x, int64_t ldx, int64_t k,
                  const float* const* sc, typename V::F (&acc)[M][R]) {
  using F = typename V::F;
  F s[R];
  if constexpr (Fm == WFmt::I8 || Fm == WFmt::Q4) {
    for (int j = 0; j < R; ++j) s[j] = V::set1(*sc[j]);
  }
  for (int c = 0; c < CH / V::W; ++c) {
    F wv[R];
    for (int j = 0; j < R; ++j) {
      wv[j] = load_w<Fm>(rows[j], k, c);
      if constexpr (Fm == WFmt::I8 || Fm == WFmt::Q4) wv[j] = V::mul(wv[j], s[j]);
    }
    for (int m = 0; m < M; ++m) {
      const F xv = V::load(x + m * ldx + k + c * V::W);
      for (int j = 0; j < R; ++j) acc[m][j] = V::fma(xv, wv[j], acc[m][j]);
    }
  }
}

// y[m·ldy + j] = x[m]·W[n + j] for m < M, j < R.
template <WFmt Fm, int M, int R>
void block(const WeightView& w, int64_t n, const float* x, int64_t ldx, float* y, int64_t ldy) {
  using F = typename V::F;
  const int64_t K = w.K, rb = K * twice_bytes<Fm>() / 2;  // bytes per weight row
  const uint8_t* base = static_cast<const uint8_t*>(w.data) + n * rb;
  const void* rows[R];
  for (int j = 0; j < R; ++j) rows[j] = base + j * rb;
  F acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = V::zero();
  // Chunk: a group (32 weights, one scale) of the grouped formats, else 4 vectors.
  constexpr int CH = (Fm == WFmt::I8 || Fm == WFmt::Q4) ? kGroup : 4 * V::W;
  int64_t k = 0;
  for (; k + CH <= K; k += CH) {
    // Ask for the next R rows' lines as these are read: short weight rows streamed from memory
    // are picked up late by the hardware prefetchers (decode_linear.cpp).
    const int64_t b1 = (k + CH) * twice_bytes<Fm>() / 2;
    for (int64_t b = (k * twice_bytes<Fm>() / 2 + 63) / 64 * 64; b < b1; b += 64) {
      for (int j = 0; j < R; ++j) __builtin_prefetch(base + (R + j) * rb + b);
    }
    const float* sc[R];
    if constexpr (Fm == WFmt::I8 || Fm == WFmt::Q4) {
      for (int j = 0; j < R; ++j) sc[j] = w.scales + (n + j) * (K / kGroup) + k / kGroup;
    }
    chunk<Fm, M, R, CH>(rows, x, ldx, k, sc, acc);
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < R; ++j) {
      float s = V::hsum(acc[m][j]);
      for (int64_t i = k; i < K; ++i) {  // plain formats: the tail past the last chunk
        float wi;
        if constexpr (Fm == WFmt::F32) {
          wi = static_cast<const float*>(rows[j])[i];
        } else {
          wi = V::scalar_w(static_cast<const uint16_t*>(rows[j])[i], Fm == WFmt::BF16);
        }
        s += x[m * ldx + i] * wi;
      }
      y[m * ldy + j] = s;
    }
  }
}

template <WFmt Fm, int M>
void rows_m(const WeightView& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n0,
            int64_t n1) {
  constexpr int R = rows_per_block<M>();
  int64_t n = n0;
  for (; n + R <= n1; n += R) block<Fm, M, R>(w, n, x, ldx, y + n, ldy);
  for (; n < n1; ++n) block<Fm, M, 1>(w, n, x, ldx, y + n, ldy);
}

template <WFmt Fm>
void rows_any_m(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y,
                int64_t ldy, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return rows_m<Fm, 1>(w, x, ldx, y, ldy, n0, n1);
    case 2: return rows_m<Fm, 2>(w, x, ldx, y, ldy, n0, n1);
    case 3: return rows_m<Fm, 3>(w, x, ldx, y, ldy, n0, n1);
    case 4: return rows_m<Fm, 4>(w, x, ldx, y, ldy, n0, n1);
  }
  if constexpr (V::kMaxRows > 4) {
    switch (M) {
      case 5: return rows_m<Fm, 5>(w, x, ldx, y, ldy, n0, n1);
      case 6: return rows_m<Fm, 6>(w, x, ldx, y, ldy, n0, n1);
      case 7: return rows_m<Fm, 7>(w, x, ldx, y, ldy, n0, n1);
      case 8: return rows_m<Fm, 8>(w, x, ldx, y, ldy, n0, n1);
    }
  }
}

// All M rows of x in passes of kMaxRows over tiles of W's rows small enough (~16 KiB) to be
// read again from L1/L2 by the later passes: memory reads W once per call whatever M is.
template <WFmt Fm>
void gemv_fmt(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
              int64_t n0, int64_t n1) {
  const int64_t rb = std::max<int64_t>(1, w.K * twice_bytes<Fm>() / 2);
  const int64_t tile = M <= V::kMaxRows ? n1 - n0 : std::max<int64_t>(8, 16384 / rb / 8 * 8);
  for (int64_t t = n0; t < n1; t += tile) {
    const int64_t te = std::min(n1, t + tile);
    for (int64_t m0 = 0; m0 < M; m0 += V::kMaxRows) {
      const int64_t mb = std::min<int64_t>(V::kMaxRows, M - m0);
      rows_any_m<Fm>(w, x + m0 * ldx, mb, ldx, y + m0 * ldy, ldy, t, te);
    }
  }
}

void gemv(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
          int64_t n0, int64_t n1) {
  switch (w.fmt) {
    case WFmt::F32: return gemv_fmt<WFmt::F32>(w, x, M, ldx, y, ldy, n0, n1);
    case WFmt::BF16: return gemv_fmt<WFmt::BF16>(w, x, M, ldx, y, ldy, n0, n1);
    case WFmt::F16: return gemv_fmt<WFmt::F16>(w, x, M, ldx, y, ldy, n0, n1);
    case WFmt::I8: return gemv_fmt<WFmt::I8>(w, x, M, ldx, y, ldy, n0, n1);
    case WFmt::Q4: return gemv_fmt<WFmt::Q4>(w, x, M, ldx, y, ldy, n0, n1);
  }
}
