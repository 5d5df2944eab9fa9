// Attention kernels for XLA:CPU, called through XLA's FFI (models/attention/cpu.py builds and
// registers them). fp32 only.
//
// Vectors are GCC vector extensions as wide as the target's registers (-march=native picks
// the CPU's). Work is shared out over XLA's intra-op thread pool (ffi::ThreadPool), the caller
// working too.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The widest vectors the target has: 16 floats (AVX-512), 8 (AVX) or 4 (SSE). Wider GCC
// vectors than the target's registers compile to scalar code in places (40x slower here).
#if defined(__AVX512F__)
#define LONGRL_LANES 16
#elif defined(__AVX__)
#define LONGRL_LANES 8
#else
#define LONGRL_LANES 4
#endif
constexpr int kLanes = LONGRL_LANES;
typedef float fvec __attribute__((vector_size(4 * LONGRL_LANES)));
typedef int32_t ivec __attribute__((vector_size(4 * LONGRL_LANES)));
typedef float fvec_unaligned
    __attribute__((vector_size(4 * LONGRL_LANES), aligned(4), __may_alias__));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline fvec load(const float* p) { return *reinterpret_cast<const fvec_unaligned*>(p); }
inline void store(float* p, fvec x) { *reinterpret_cast<fvec_unaligned*>(p) = x; }
inline fvec splat(float x) { return fvec{} + x; }

inline float hsum(fvec x) {
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += x[i];
  return sum;
}

// exp(x) lane by lane (Cephes' expf: |error| <= 2 ulp), exp(-inf) = 0 and large negative
// arguments flush to 0.
inline fvec vexp(fvec x) {
  const fvec hi = splat(88.3762626647949f), lo = splat(-87.0f);
  fvec xc = x < lo ? lo : (x > hi ? hi : x);
  const fvec magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  fvec n = (xc * 1.44269504088896341f + magic) - magic;
  fvec r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  fvec p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.0f;
  ivec e = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &e, sizeof(scale));
  fvec y = p * scale;
  return x < lo ? fvec{} : y;
}

// Row operations over head_dim = n floats, a vector at a time and the tail one by one.
inline float dot(const float* a, const float* b, int64_t n) {
  fvec acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a x
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, load(y + i) + a * load(x + i));
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale_to(float* y, float a, const float* x, int64_t n) {  // y = a x
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, a * load(x + i));
  for (; i < n; ++i) y[i] = a * x[i];
}

// fn(i) for i in [0, n) on the caller and up to (pool threads - 1) helpers. The caller waits
// for the items, never for the helpers: a helper that starts late finds no item left and
// returns, so a pool whose threads are all busy (or all waiting here) cannot deadlock.
void parallel_for(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& fn) {
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Job {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n;
    const std::function<void(int64_t)>* fn;
  };
  auto job = std::make_shared<Job>();
  job->n = n;
  job->fn = &fn;
  auto work = [](Job& job) {
    int64_t mine = 0;
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.n; ++mine) {
      (*job.fn)(i);
    }
    if (mine) job.done.fetch_add(mine, std::memory_order_release);
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job, work] { work(*job); });
  work(*job);
  for (int spins = 0; job->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
}

// ---- decode: queries against a KV cache ----
//
// q: [b, ql, h, d]; k, v: [b, kh, slots, d]; valid: bool[b, slots]; first_slot: the cache slot
// of the first query. Query t sees slot j iff valid[j] and j <= first_slot + t (the rule of
// models/attention/reference.py: cache_mask); a query that sees none outputs zeros. Only the
// slots any query can see are read.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> first_slot,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t b = qd[0], ql = qd[1], h = qd[2], d = qd[3], kh = kd[1], slots = kd[2];
  auto vd = v.dimensions();
  if (kd[0] != b || kd[3] != d || h % kh || vd[0] != b || vd[1] != kh || vd[2] != slots ||
      vd[3] != d || valid.dimensions()[0] != b || valid.dimensions()[1] != slots) {
    return ffi::Error::InvalidArgument("decode attention: inconsistent q, k, v, valid shapes");
  }
  const int64_t g = h / kh, rows = ql * g;
  const int64_t slot0 = first_slot.typed_data()[0];
  const int64_t seen = std::clamp<int64_t>(slot0 + ql, 0, slots);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* validp = valid.typed_data();
  float* op = out->typed_data();

  parallel_for(pool, b * kh, [&](int64_t item) {
    const int64_t bi = item / kh, ki = item % kh;
    thread_local std::vector<float> buf;
    buf.resize(rows * seen + rows * d + rows);
    float* s = buf.data();       // [rows x seen] scores, then probabilities
    float* acc = s + rows * seen;  // [rows x d]
    float* inv = acc + rows * d;   // [rows] 1 / softmax normaliser
    auto qrow = [&](int64_t r) { return qp + ((bi * ql + r / g) * h + ki * g + r % g) * d; };
    const float* kbase = kp + (bi * kh + ki) * slots * d;
    const float* vbase = vp + (bi * kh + ki) * slots * d;
    const bool* vld = validp + bi * slots;
    for (int64_t j = 0; j < seen; ++j) {
      const float* kj = kbase + j * d;
      for (int64_t r = 0; r < rows; ++r) {
        if (!vld[j] || j > slot0 + r / g) {
          s[r * seen + j] = kNegInf;
          continue;
        }
        s[r * seen + j] = dot(qrow(r), kj, d) * scale;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * seen;
      float m = kNegInf;
      for (int64_t j = 0; j < seen; ++j) m = std::max(m, sr[j]);
      if (m == kNegInf) {
        inv[r] = 0.0f;  // sees no key: zeros, and p stays 0 below
        for (int64_t j = 0; j < seen; ++j) sr[j] = 0.0f;
        continue;
      }
      fvec total{};
      int64_t j = 0;
      for (; j + kLanes <= seen; j += kLanes) {
        fvec p = vexp(load(sr + j) - m);
        store(sr + j, p);
        total += p;
      }
      float sum = hsum(total);
      for (; j < seen; ++j) {
        sr[j] = std::exp(sr[j] - m);
        sum += sr[j];
      }
      inv[r] = 1.0f / sum;
    }
    std::fill(acc, acc + rows * d, 0.0f);
    for (int64_t j = 0; j < seen; ++j) {
      if (!vld[j]) continue;
      const float* vj = vbase + j * d;
      for (int64_t r = 0; r < rows; ++r) {
        const float p = s[r * seen + j];
        if (p == 0.0f) continue;
        axpy(acc + r * d, p, vj, d);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      scale_to(op + ((bi * ql + r / g) * h + ki * g + r % g) * d, inv[r], acc + r * d, d);
    }
  });
  return ffi::Error::Success();
}

// ---- matrix products on small packed blocks ----

// Accumulators a micro-kernel keeps in registers (of 32 with AVX-512, else 16), and vectors
// across one output panel.
constexpr int kAccVectors = kLanes == 16 ? 24 : 12;
constexpr int kMaxPanel = 4;

// C[i][0:kLanes NV] (+)= sum_k A(i, k) B[k][0:kLanes NV] for i < MR, with
// A(i, k) = A[i * ars + k * acs] (a row-major A, or a transposed one), B's rows ldb apart and
// C's ldc apart. The MR x NV accumulators stay in registers over the whole k loop.
template <int MR, int NV>
inline void micro_kernel(int64_t kk, const float* A, int64_t ars, int64_t acs, const float* B,
                         int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  fvec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? load(C + i * ldc + kLanes * v) : fvec{};
  for (int64_t k = 0; k < kk; ++k) {
    fvec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + kLanes * v);
    for (int i = 0; i < MR; ++i) {
      const float a = A[i * ars + k * acs];
      for (int v = 0; v < NV; ++v) acc[i][v] += a * b[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) store(C + i * ldc + kLanes * v, acc[i][v]);
}

template <int NV>
constexpr int rows_for() { return std::min(8, kAccVectors / NV); }

template <int NV, int MR = rows_for<NV>()>
void panel(int64_t m, int64_t kk, const float* A, int64_t ars, int64_t acs, const float* B,
           int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    micro_kernel<MR, NV>(kk, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate);
  if constexpr (MR > 1) {
    if (i < m) panel<NV, MR / 2 ? MR / 2 : 1>(m - i, kk, A + i * ars, ars, acs, B, ldb,
                                              C + i * ldc, ldc, accumulate);
  }
}

// C[m x n] (+)= A[m x kk] B[kk x n], n a multiple of kLanes; A(i, k) = A[i * ars + k * acs].
void gemm(int64_t m, int64_t n, int64_t kk, const float* A, int64_t ars, int64_t acs,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t c = 0; c < n;) {
    const int64_t nv = std::min<int64_t>(kMaxPanel, (n - c) / kLanes);
    switch (nv) {
      case 4: panel<4>(m, kk, A, ars, acs, B + c, ldb, C + c, ldc, accumulate); break;
      case 3: panel<3>(m, kk, A, ars, acs, B + c, ldb, C + c, ldc, accumulate); break;
      case 2: panel<2>(m, kk, A, ars, acs, B + c, ldb, C + c, ldc, accumulate); break;
      default: panel<1>(m, kk, A, ars, acs, B + c, ldb, C + c, ldc, accumulate); break;
    }
    c += kLanes * nv;
  }
}

// ---- training: causal attention within segments, forward and backward ----
//
// q: [b, sq, h, d] (already scaled by 1/sqrt(d)); k, v: [b, sk, kh, d]; q_seg: i32[b, sq] and
// kv_seg: i32[b, sk], 0 = padding; q_pos: i32[sq] and kv_pos: i32[sk], the causal order (shared
// by the rows). Query i sees key j iff kv_pos[j] <= q_pos[i], kv_seg[j] == q_seg[i] and
// q_seg[i] != 0 (the rule of models/attention/blockwise.py); a query that sees none outputs
// zeros, with lse = +inf. Single-device attention passes the same array for both sides and
// positions 0..s-1; ring attention (models/attention/ring.py) passes its local queries against
// a key/value chunk from another device, with their zigzag positions.
//
// A work item is one KV head of one row and a block of query positions; its rows are the g
// query heads of that KV head times the block's positions (row r = head * nq + position), so
// keys and values are read once for the whole group. Key blocks are kKeys positions; pairs of
// blocks that no query of the block can see (causally or by segment) are skipped. Everything a
// product touches is packed into thread-local buffers whose width dp is head_dim rounded up
// to 16, zero-padded, so any head_dim works.

constexpr int64_t kKeys = 64;

struct Dims {
  int64_t b, s, sk, h, kh, g, d, dp, bq;  // s: query positions; sk: key positions;
                                          // dp: padded head_dim; bq: query positions per block
};

Dims dims_of(ffi::Span<const int64_t> q, ffi::Span<const int64_t> k) {
  Dims x{q[0], q[1], k[1], q[2], k[2], q[2] / k[2], q[3], (q[3] + 15) / 16 * 16, 0};
  x.bq = std::clamp<int64_t>(128 / x.g, 16, 64);  // ~128 rows per block
  return x;
}

// One side's segment ids (of one row) and causal positions.
struct Side {
  const int32_t* seg;
  const int32_t* pos;
};

// The least and greatest position of [p0, p0 + n).
std::pair<int32_t, int32_t> position_range(const int32_t* pos, int64_t p0, int64_t n) {
  const auto [lo, hi] = std::minmax_element(pos + p0, pos + p0 + n);
  return {*lo, *hi};
}

enum class Visible { kNone, kSome, kAll };

// Which (query, key) pairs of a block pair are visible; mask[t * kKeys + j] for kSome.
// q_range: position_range of the query block.
Visible block_mask(Side q, int64_t q0, int64_t nq, std::pair<int32_t, int32_t> q_range, Side kv,
                   int64_t k0, int64_t nk, uint8_t* mask) {
  const auto [k_lo, k_hi] = position_range(kv.pos, k0, nk);
  if (k_lo > q_range.second) return Visible::kNone;
  const int32_t first = q.seg[q0];
  bool uniform = first != 0 && k_hi <= q_range.first;
  for (int64_t t = 0; uniform && t < nq; ++t) uniform = q.seg[q0 + t] == first;
  for (int64_t j = 0; uniform && j < nk; ++j) uniform = kv.seg[k0 + j] == first;
  if (uniform) return Visible::kAll;
  int64_t count = 0;
  for (int64_t t = 0; t < nq; ++t) {
    const int32_t st = q.seg[q0 + t], pt = q.pos[q0 + t];
    for (int64_t j = 0; j < kKeys; ++j) {
      const bool on = j < nk && st != 0 && kv.seg[k0 + j] == st && kv.pos[k0 + j] <= pt;
      mask[t * kKeys + j] = on;
      count += on;
    }
  }
  return count ? Visible::kSome : Visible::kNone;
}

// n rows of d floats, `row_stride` apart in x, into dst [n x dp], zero-padded to dp.
void pack_rows(const float* x, int64_t row_stride, int64_t n, int64_t d, int64_t dp, float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(dst + t * dp, x + t * row_stride, d * sizeof(float));
    std::fill(dst + t * dp + d, dst + (t + 1) * dp, 0.0f);
  }
}

// nk rows of d floats, `row_stride` apart in x, as the transposed block dst [d x kKeys],
// zero past nk.
void pack_transposed(const float* x, int64_t row_stride, int64_t nk, int64_t d, float* dst) {
  for (int64_t c = 0; c < d; ++c) {
    for (int64_t j = 0; j < nk; ++j) dst[c * kKeys + j] = x[j * row_stride + c];
    std::fill(dst + c * kKeys + nk, dst + (c + 1) * kKeys, 0.0f);
  }
}

// One thread's buffers, reused by each work item it runs. rows = g x bq at most.
struct ForwardScratch {
  std::vector<float> q, out;    // [rows x dp]: the block's queries; its unnormalised output
  std::vector<float> p;         // [rows x kKeys]: scores, then probabilities
  std::vector<float> keys_t;    // [d x kKeys]: the key block, transposed
  std::vector<float> values;    // [kKeys x dp]
  std::vector<float> max, sum;  // [rows]: the online softmax's running max and normaliser
  std::vector<uint8_t> mask;    // [bq x kKeys]
};

struct BackwardScratch {
  std::vector<float> q, dout, dq;        // [rows x dp]
  std::vector<float> p, ds;              // [rows x kKeys]: probabilities; score gradients
  std::vector<float> keys_t, values_t;   // [d x kKeys]
  std::vector<float> keys;               // [kKeys x dp]
  std::vector<float> lse, delta;         // [rows]: delta = sum(dout * out) per row
  std::vector<float> dk, dv;             // [s x dp]: one KV head's gradients over the row
  std::vector<uint8_t> mask;             // [bq x kKeys]
};

// The g heads' query (or output gradient) rows of one block, packed [g * nq x dp].
void pack_group(const float* x, const Dims& n, int64_t bi, int64_t ki, int64_t q0, int64_t nq,
                float* dst) {
  for (int64_t gg = 0; gg < n.g; ++gg)
    pack_rows(x + ((bi * n.s + q0) * n.h + ki * n.g + gg) * n.d, n.h * n.d, nq, n.d, n.dp,
              dst + gg * nq * n.dp);
}

// out: [b, s, h, d]; lse: [b, s, h], the log-sum-exp of each query's visible scores.
ffi::Error FlashForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_seg,
                        ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                        ffi::Buffer<ffi::S32> kv_pos, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<ffi::F32> lse) {
  const Dims n = dims_of(q.dimensions(), k.dimensions());
  const int64_t q_blocks = (n.s + n.bq - 1) / n.bq;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();

  parallel_for(pool, n.b * n.kh * q_blocks, [&](int64_t item) {
    // Later query blocks see more keys: hand them out first.
    const int64_t qb = q_blocks - 1 - item % q_blocks, ki = item / q_blocks % n.kh,
                  bi = item / q_blocks / n.kh;
    const int64_t q0 = qb * n.bq, nq = std::min(n.bq, n.s - q0), rows = n.g * nq;
    const Side qs{q_seg.typed_data() + bi * n.s, q_pos.typed_data()};
    const Side ks{kv_seg.typed_data() + bi * n.sk, kv_pos.typed_data()};
    const auto q_range = position_range(qs.pos, q0, nq);
    thread_local ForwardScratch w;
    w.q.resize(rows * n.dp);
    w.out.assign(rows * n.dp, 0.0f);
    w.p.resize(rows * kKeys);
    w.keys_t.resize(n.d * kKeys);
    w.values.resize(kKeys * n.dp);
    w.max.assign(rows, kNegInf);
    w.sum.assign(rows, 0.0f);
    w.mask.resize(n.bq * kKeys);
    pack_group(qp, n, bi, ki, q0, nq, w.q.data());
    for (int64_t k0 = 0; k0 < n.sk; k0 += kKeys) {
      const int64_t nk = std::min(kKeys, n.sk - k0);
      const Visible vis = block_mask(qs, q0, nq, q_range, ks, k0, nk, w.mask.data());
      if (vis == Visible::kNone) continue;
      const float* kb = kp + ((bi * n.sk + k0) * n.kh + ki) * n.d;
      const float* vb = vp + ((bi * n.sk + k0) * n.kh + ki) * n.d;
      pack_transposed(kb, n.kh * n.d, nk, n.d, w.keys_t.data());
      pack_rows(vb, n.kh * n.d, nk, n.d, n.dp, w.values.data());
      gemm(rows, kKeys, n.d, w.q.data(), n.dp, 1, w.keys_t.data(), kKeys, w.p.data(), kKeys, false);
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = w.p.data() + r * kKeys;
        const uint8_t* mr = w.mask.data() + (r % nq) * kKeys;
        for (int64_t j = 0; j < kKeys; ++j)
          if (j >= nk || (vis == Visible::kSome && !mr[j])) sr[j] = kNegInf;
        fvec mx = splat(kNegInf);
        for (int64_t j = 0; j < kKeys; j += kLanes) {
          fvec x = load(sr + j);
          mx = x > mx ? x : mx;
        }
        float row_max = kNegInf;
        for (int lane = 0; lane < kLanes; ++lane) row_max = std::max(row_max, mx[lane]);
        const float m_new = std::max(w.max[r], row_max);
        if (m_new == kNegInf) {  // no key seen yet
          std::fill(sr, sr + kKeys, 0.0f);
          continue;
        }
        fvec total{};
        for (int64_t j = 0; j < kKeys; j += kLanes) {
          fvec p = vexp(load(sr + j) - m_new);
          store(sr + j, p);
          total += p;
        }
        const float correction = w.max[r] == kNegInf ? 0.0f : std::exp(w.max[r] - m_new);
        w.sum[r] = w.sum[r] * correction + hsum(total);
        w.max[r] = m_new;
        if (correction != 1.0f) {
          scale_to(w.out.data() + r * n.dp, correction, w.out.data() + r * n.dp, n.dp);
        }
      }
      gemm(rows, n.dp, nk, w.p.data(), kKeys, 1, w.values.data(), n.dp, w.out.data(), n.dp, true);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t gg = r / nq, t = r % nq, head = ki * n.g + gg;
      float* o = op + ((bi * n.s + q0 + t) * n.h + head) * n.d;
      const bool seen = w.sum[r] > 0.0f;
      scale_to(o, seen ? 1.0f / w.sum[r] : 0.0f, w.out.data() + r * n.dp, n.d);
      lp[(bi * n.s + q0 + t) * n.h + head] =
          seen ? w.max[r] + std::log(w.sum[r]) : std::numeric_limits<float>::infinity();
    }
  });
  return ffi::Error::Success();
}

// dq, dk, dv of FlashForward, given the output cotangent dout [b, s, h, d], the log-sum-exp
// lse [b, s, h] and delta = sum(dout * out) over head_dim [b, s, h]. Under ring attention lse
// and out are those of all key chunks together, so each chunk's call gives its share.
// A work item is one KV head of one row, whole: it owns those rows of dk and dv (and dq), so
// no two threads add into the same gradient.
ffi::Error FlashBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_seg,
                         ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                         ffi::Buffer<ffi::S32> kv_pos, ffi::Buffer<ffi::F32> lse,
                         ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::F32> dout,
                         ffi::ResultBuffer<ffi::F32> dq,
                         ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  const Dims n = dims_of(q.dimensions(), k.dimensions());
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* lp = lse.typed_data();
  const float* deltap = delta.typed_data();
  const float* dop = dout.typed_data();
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();

  parallel_for(pool, n.b * n.kh, [&](int64_t item) {
    const int64_t ki = item % n.kh, bi = item / n.kh;
    const Side qs{q_seg.typed_data() + bi * n.s, q_pos.typed_data()};
    const Side ks{kv_seg.typed_data() + bi * n.sk, kv_pos.typed_data()};
    thread_local BackwardScratch w;
    const int64_t max_rows = n.g * n.bq;
    w.q.resize(max_rows * n.dp);
    w.dout.resize(max_rows * n.dp);
    w.dq.resize(max_rows * n.dp);
    w.p.resize(max_rows * kKeys);
    w.ds.resize(max_rows * kKeys);
    w.keys_t.resize(n.d * kKeys);
    w.values_t.resize(n.d * kKeys);
    w.keys.resize(kKeys * n.dp);
    w.lse.resize(max_rows);
    w.delta.resize(max_rows);
    w.mask.resize(n.bq * kKeys);
    w.dk.assign(n.sk * n.dp, 0.0f);
    w.dv.assign(n.sk * n.dp, 0.0f);
    for (int64_t q0 = 0; q0 < n.s; q0 += n.bq) {
      const int64_t nq = std::min(n.bq, n.s - q0), rows = n.g * nq;
      pack_group(qp, n, bi, ki, q0, nq, w.q.data());
      pack_group(dop, n, bi, ki, q0, nq, w.dout.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (bi * n.s + q0 + r % nq) * n.h + ki * n.g + r / nq;
        w.lse[r] = lp[at];
        w.delta[r] = deltap[at];
      }
      const auto q_range = position_range(qs.pos, q0, nq);
      std::fill(w.dq.begin(), w.dq.begin() + rows * n.dp, 0.0f);
      for (int64_t k0 = 0; k0 < n.sk; k0 += kKeys) {
        const int64_t nk = std::min(kKeys, n.sk - k0);
        const Visible vis = block_mask(qs, q0, nq, q_range, ks, k0, nk, w.mask.data());
        if (vis == Visible::kNone) continue;
        const float* kb = kp + ((bi * n.sk + k0) * n.kh + ki) * n.d;
        const float* vb = vp + ((bi * n.sk + k0) * n.kh + ki) * n.d;
        pack_transposed(kb, n.kh * n.d, nk, n.d, w.keys_t.data());
        pack_transposed(vb, n.kh * n.d, nk, n.d, w.values_t.data());
        pack_rows(kb, n.kh * n.d, nk, n.d, n.dp, w.keys.data());
        float* P = w.p.data();
        float* dS = w.ds.data();
        gemm(rows, kKeys, n.d, w.q.data(), n.dp, 1, w.keys_t.data(), kKeys, P, kKeys, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* pr = P + r * kKeys;
          const fvec shift = splat(w.lse[r]);
          for (int64_t j = 0; j < kKeys; j += kLanes) store(pr + j, vexp(load(pr + j) - shift));
          const uint8_t* mr = w.mask.data() + (r % nq) * kKeys;
          for (int64_t j = 0; j < kKeys; ++j)
            if (j >= nk || (vis == Visible::kSome && !mr[j])) pr[j] = 0.0f;
        }
        // dv[keys] += P^T dout; dP = dout V^T; dS = P (dP - delta); dk += dS^T q; dq += dS k.
        gemm(nk, n.dp, rows, P, 1, kKeys, w.dout.data(), n.dp, w.dv.data() + k0 * n.dp, n.dp, true);
        gemm(rows, kKeys, n.d, w.dout.data(), n.dp, 1, w.values_t.data(), kKeys, dS, kKeys, false);
        for (int64_t r = 0; r < rows; ++r) {
          const fvec delta = splat(w.delta[r]);
          for (int64_t j = 0; j < kKeys; j += kLanes) {
            store(dS + r * kKeys + j, load(P + r * kKeys + j) * (load(dS + r * kKeys + j) - delta));
          }
        }
        gemm(nk, n.dp, rows, dS, 1, kKeys, w.q.data(), n.dp, w.dk.data() + k0 * n.dp, n.dp, true);
        gemm(rows, n.dp, nk, dS, kKeys, 1, w.keys.data(), n.dp, w.dq.data(), n.dp, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = ki * n.g + r / nq, pos = q0 + r % nq;
        std::memcpy(dqp + ((bi * n.s + pos) * n.h + head) * n.d, w.dq.data() + r * n.dp,
                    n.d * sizeof(float));
      }
    }
    for (int64_t j = 0; j < n.sk; ++j) {
      const int64_t at = ((bi * n.sk + j) * n.kh + ki) * n.d;
      std::memcpy(dkp + at, w.dk.data() + j * n.dp, n.d * sizeof(float));
      std::memcpy(dvp + at, w.dv.data() + j * n.dp, n.d * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LongrlDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LongrlFlashForward, FlashForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LongrlFlashBackward, FlashBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
