// Attention kernels for XLA:CPU, called through XLA's FFI (models/attention/cpu.py builds and
// registers them). fp32 only.
//
// Vectors are GCC vector extensions of 16 floats: with -march=native they compile to one
// AVX-512 register where the CPU has it and to two AVX2 registers (or four SSE ones) elsewhere.
// Work is shared out over XLA's intra-op thread pool (ffi::ThreadPool), the caller working too.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4), __may_alias__));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16u*>(p); }
inline void store16(float* p, f32x16 x) { *reinterpret_cast<f32x16u*>(p) = x; }
inline f32x16 splat(float x) { return f32x16{} + x; }

inline float hsum(f32x16 x) {
  f32x8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for 16 lanes (Cephes' expf: |error| <= 2 ulp), exp(-inf) = 0 and large negative
// arguments flush to 0.
inline f32x16 vexp(f32x16 x) {
  const f32x16 hi = splat(88.3762626647949f), lo = splat(-87.0f);
  f32x16 xc = x < lo ? lo : (x > hi ? hi : x);
  const f32x16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  f32x16 n = (xc * 1.44269504088896341f + magic) - magic;
  f32x16 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.0f;
  i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  f32x16 y = p * scale;
  return x < lo ? f32x16{} : y;
}

// Row operations over head_dim = n floats, 16 lanes at a time and the tail one by one.
inline float dot(const float* a, const float* b, int64_t n) {
  f32x16 acc{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a x
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(y + i, load16(y + i) + a * load16(x + i));
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale_to(float* y, float a, const float* x, int64_t n) {  // y = a x
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(y + i, a * load16(x + i));
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
    buf.resize(rows * seen + rows * d);
    float* s = buf.data();
    float* acc = s + rows * seen;
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
    std::vector<float> inv(rows);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * seen;
      float m = kNegInf;
      for (int64_t j = 0; j < seen; ++j) m = std::max(m, sr[j]);
      if (m == kNegInf) {
        inv[r] = 0.0f;  // sees no key: zeros, and p stays 0 below
        for (int64_t j = 0; j < seen; ++j) sr[j] = 0.0f;
        continue;
      }
      f32x16 total{};
      int64_t j = 0;
      for (; j + 16 <= seen; j += 16) {
        f32x16 p = vexp(load16(sr + j) - m);
        store16(sr + j, p);
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
