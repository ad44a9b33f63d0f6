// Reads and writes of a `KVCache` layer on the CPU, XLA FFI custom calls
// (pbsd_jax.models.attention.cpu_kernels). Shapes as in `KVCache`, S slots:
//   k  T[layers, B, kv_heads, head_dim, S] keys, slots last
//   v  T[layers, B, kv_heads, S, head_dim] values
// or one layer's arrays without the leading axis (a per-layer cache). T is f32 or bf16 (two
// handlers of each call).
//
// Decode attention: one query per row (a decode step) over the slots of a layer up to the
// row's own slot, read where they lie: XLA:CPU copies every block of keys and values out of the
// cache before it reads it, so its decode attention moves each cached byte about three times.
// Here each head of each row is one task of the intra-op thread pool, its slots taken in blocks
// of kBlock with an online softmax (flash-decoding), so a step reads each filled key and value
// once and nothing past the row's slot.
//   q      f32[B, kv_heads, groups, head_dim]  the queries, already scaled by 1/sqrt(head_dim)
//   k, v, mask pred[B, S] (slots that hold a real token), last s32[B] (each row attends to
//   slots <= last[b]), layer s32[] (the layer of k and v to read)
//   result f32[B, kv_heads, groups, head_dim]; a row with no slot to attend to gets zeros.
//
// Cache write: new keys and values stored at per-row slots of one layer, in place (the results
// alias k and v). XLA:CPU scatters a bf16 array by converting all of it to f32 and back, every
// layer of every decode step; this writes only the new slots, f32 or bf16.
//   k, v, new_k T[B, kv_heads, N, head_dim], new_v T[B, kv_heads, N, head_dim],
//   slots s32[B, N] (token j of row b goes to slot slots[b, j]; one outside [0, S) is dropped),
//   layer s32[]; results: k and v with the new slots written.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 256;
constexpr int64_t kMaxGroups = 16;
constexpr int64_t kMaxDim = 256;

inline float ToFloat(float x) { return x; }

inline float ToFloat(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// exp(x) for x <= 0, exactly 0 below -87 (and at -inf): x = n ln2 + r, a degree-7 polynomial
// in r times 2^n (relative error ~1e-7). Branch-free, so the loops calling it vectorise; libm's
// expf is a scalar call.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = static_cast<float>(static_cast<int32_t>(clamped * 1.44269504f - 0.5f));
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.0f ? 0.0f : p * two_n;
}

// One head of one row: `groups` queries q[g, d] over slots [0, n) of keys k[d, s] (`size`
// slots apart) and values v[s, d], skipping slots where `mask` is false.
template <typename T>
void AttendHead(const float* q, const T* k, const T* v, const bool* mask, int64_t n,
                int64_t size, int64_t groups, int64_t dim, float* out) {
  float best[kMaxGroups], total[kMaxGroups], scores[kMaxGroups][kBlock], acc[kMaxGroups][kMaxDim];
  for (int64_t g = 0; g < groups; ++g) {
    best[g] = std::numeric_limits<float>::lowest();  // finite: exp(best - top) is never NaN
    total[g] = 0.0f;
    std::fill(acc[g], acc[g] + dim, 0.0f);
  }
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t width = std::min(kBlock, n - start);
    const bool* m = mask + start;
    for (int64_t g = 0; g < groups; ++g) {
      float* sc = scores[g];
      std::fill(sc, sc + width, 0.0f);
      for (int64_t d = 0; d < dim; ++d) {
        const float qd = q[g * dim + d];
        const T* kd = k + d * size + start;
#pragma omp simd
        for (int64_t s = 0; s < width; ++s) sc[s] += qd * ToFloat(kd[s]);
      }
      float top = best[g];
      for (int64_t s = 0; s < width; ++s) top = m[s] ? std::max(top, sc[s]) : top;
      const float rescale = ExpNonPositive(best[g] - top);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < width; ++s) {
        sc[s] = m[s] ? ExpNonPositive(sc[s] - top) : 0.0f;
        sum += sc[s];
      }
      best[g] = top;
      total[g] = total[g] * rescale + sum;
      for (int64_t i = 0; i < dim; ++i) acc[g][i] *= rescale;
    }
    for (int64_t s = 0; s < width; ++s) {
      if (!m[s]) continue;
      const T* vs = v + (start + s) * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float p = scores[g][s];
        float* a = acc[g];
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) a[i] += p * ToFloat(vs[i]);
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
    for (int64_t i = 0; i < dim; ++i) out[g * dim + i] = acc[g][i] * inv;
  }
}

// The shape of a cache's keys and values, all layers (rank 5) or one layer (rank 4).
struct CacheShape {
  int64_t layers, rows, heads, dim, size;
};

// False where k and v are not the keys and values of one cache.
template <typename Dims>
bool ReadCacheShape(const Dims& kd, const Dims& vd, CacheShape& c) {
  if (kd.size() != vd.size() || kd.size() < 4 || kd.size() > 5) return false;
  const size_t lead = kd.size() - 4;
  c = {lead ? kd[0] : 1, kd[lead], kd[lead + 1], kd[lead + 2], kd[lead + 3]};
  return (lead == 0 || vd[0] == c.layers) && vd[lead] == c.rows && vd[lead + 1] == c.heads &&
         vd[lead + 2] == c.size && vd[lead + 3] == c.dim;
}

// Runs fn(0) .. fn(count - 1) on the calling thread and on helpers scheduled on the pool, tasks
// claimed from a shared counter; the caller waits only for claimed tasks, so a helper the pool
// never starts is harmless.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, Fn fn) {
  struct Tasks {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable finished;
  };
  auto tasks = std::make_shared<Tasks>();
  auto drain = [tasks, fn, count] {
    for (int64_t t; (t = tasks->next.fetch_add(1)) < count;) {
      fn(t);
      if (tasks->done.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(tasks->mu);
        tasks->finished.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain] { drain(); });
  drain();
  std::unique_lock<std::mutex> lock(tasks->mu);
  tasks->finished.wait(lock, [&] { return tasks->done.load() == count; });
}

template <ffi::DataType T>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<T> k,
                           ffi::Buffer<T> v, ffi::Buffer<ffi::PRED> mask,
                           ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto md = mask.dimensions();
  CacheShape c;
  if (qd.size() != 4 || !ReadCacheShape(k.dimensions(), v.dimensions(), c) ||
      qd[0] != c.rows || qd[1] != c.heads || qd[3] != c.dim || md.size() != 2 ||
      md[0] != c.rows || md[1] != c.size || last.element_count() != c.rows) {
    return ffi::Error::InvalidArgument(
        "decode attention: q (rank 4), k and v (rank 4 or 5), mask and last disagree");
  }
  const int64_t rows = c.rows, heads = c.heads, groups = qd[2], dim = c.dim, size = c.size;
  if (groups > kMaxGroups || dim > kMaxDim) {
    return ffi::Error::InvalidArgument("decode attention: at most 16 groups and 256 head dims");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= c.layers) return ffi::Error::InvalidArgument("decode attention: bad layer");
  using Native = ffi::NativeType<T>;
  const int64_t per_layer = rows * heads * dim * size;
  const Native* keys = k.typed_data() + l * per_layer;
  const Native* values = v.typed_data() + l * per_layer;
  const bool* real = mask.typed_data();
  const int32_t* slots = last.typed_data();
  const float* queries = q.typed_data();
  float* result = out->typed_data();
  auto run = [=](int64_t t) {
    const int64_t b = t / heads;
    const int64_t n = std::clamp<int64_t>(int64_t{slots[b]} + 1, 0, size);
    AttendHead(queries + t * groups * dim, keys + t * dim * size, values + t * size * dim,
               real + b * size, n, size, groups, dim, result + t * groups * dim);
  };
  ParallelFor(pool, rows * heads, run);
  return ffi::Error::Success();
}

template <ffi::DataType T>
ffi::Error WriteCache(ffi::ThreadPool pool, ffi::Buffer<T> k, ffi::Buffer<T> v,
                      ffi::Buffer<T> new_k, ffi::Buffer<T> new_v, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<T> k_out,
                      ffi::ResultBuffer<T> v_out) {
  const auto nd = new_k.dimensions();
  const auto wd = new_v.dimensions();
  const auto sd = slots.dimensions();
  CacheShape c;
  if (!ReadCacheShape(k.dimensions(), v.dimensions(), c) || nd.size() != 4 || wd.size() != 4 ||
      sd.size() != 2 || nd[0] != c.rows || nd[1] != c.heads || nd[3] != c.dim ||
      wd[0] != c.rows || wd[1] != c.heads || wd[2] != nd[2] || wd[3] != c.dim ||
      sd[0] != c.rows || sd[1] != nd[2]) {
    return ffi::Error::InvalidArgument(
        "cache write: k and v (rank 4 or 5), new keys and values (rank 4) and slots disagree");
  }
  const int64_t rows = c.rows, heads = c.heads, dim = c.dim, size = c.size, n = nd[2];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= c.layers) return ffi::Error::InvalidArgument("cache write: bad layer");
  using Native = ffi::NativeType<T>;
  Native* keys = k_out->typed_data();
  Native* values = v_out->typed_data();
  if (keys != k.typed_data()) std::memcpy(keys, k.typed_data(), k.size_bytes());
  if (values != v.typed_data()) std::memcpy(values, v.typed_data(), v.size_bytes());
  const int64_t per_layer = rows * heads * dim * size;
  keys += l * per_layer;
  values += l * per_layer;
  const Native* fresh_k = new_k.typed_data();
  const Native* fresh_v = new_v.typed_data();
  const int32_t* where = slots.typed_data();
  ParallelFor(pool, rows * heads, [=](int64_t t) {
    const int32_t* row_slots = where + (t / heads) * n;
    Native* row_k = keys + t * dim * size;
    Native* row_v = values + t * size * dim;
    const Native* new_keys = fresh_k + t * n * dim;
    const Native* new_values = fresh_v + t * n * dim;
    for (int64_t d = 0; d < dim; ++d) {  // runs of consecutive slots in each key row
      Native* key_row = row_k + d * size;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s = row_slots[j];
        if (s >= 0 && s < size) key_row[s] = new_keys[j * dim + d];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = row_slots[j];
      if (s >= 0 && s < size) {
        std::memcpy(row_v + s * dim, new_values + j * dim, dim * sizeof(Native));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define PBSD_DECODE_ATTENTION(name, T)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DecodeAttention<T>,                       \
                                ffi::Ffi::Bind()                                \
                                    .Ctx<ffi::ThreadPool>()                     \
                                    .Arg<ffi::Buffer<ffi::F32>>()               \
                                    .Arg<ffi::Buffer<T>>()                      \
                                    .Arg<ffi::Buffer<T>>()                      \
                                    .Arg<ffi::Buffer<ffi::PRED>>()              \
                                    .Arg<ffi::Buffer<ffi::S32>>()               \
                                    .Arg<ffi::Buffer<ffi::S32>>()               \
                                    .Ret<ffi::Buffer<ffi::F32>>())

PBSD_DECODE_ATTENTION(PbsdDecodeAttentionF32, ffi::F32);
PBSD_DECODE_ATTENTION(PbsdDecodeAttentionBF16, ffi::BF16);

#define PBSD_WRITE_CACHE(name, T)                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, WriteCache<T>,                            \
                                ffi::Ffi::Bind()                                \
                                    .Ctx<ffi::ThreadPool>()                     \
                                    .Arg<ffi::Buffer<T>>()                      \
                                    .Arg<ffi::Buffer<T>>()                      \
                                    .Arg<ffi::Buffer<T>>()                      \
                                    .Arg<ffi::Buffer<T>>()                      \
                                    .Arg<ffi::Buffer<ffi::S32>>()               \
                                    .Arg<ffi::Buffer<ffi::S32>>()               \
                                    .Ret<ffi::Buffer<T>>()                      \
                                    .Ret<ffi::Buffer<T>>())

PBSD_WRITE_CACHE(PbsdWriteCacheF32, ffi::F32);
PBSD_WRITE_CACHE(PbsdWriteCacheBF16, ffi::BF16);
