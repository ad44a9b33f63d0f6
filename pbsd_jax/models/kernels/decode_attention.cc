// Decode attention on the CPU, an XLA FFI custom call (pbsd_jax.models.cpu_kernels).
//
// One query per row (a decode step) over the slots of a `KVCache` layer up to the row's own
// slot, read where they lie: XLA:CPU copies every block of keys and values out of the cache
// before it reads it, so its decode attention moves each cached byte about three times. Here
// each head of each row is one task of the intra-op thread pool, its slots taken in blocks of
// kBlock with an online softmax (flash-decoding), so a step reads each filled key and value
// once and nothing past the row's slot.
//
// Operands (shapes as in `KVCache`, S slots):
//   q      f32[B, kv_heads, groups, head_dim]  the queries, already scaled by 1/sqrt(head_dim)
//   k      T[layers, B, kv_heads, head_dim, S] keys, slots last
//   v      T[layers, B, kv_heads, S, head_dim] values
//   mask   pred[B, S]                          slots that hold a real token
//   last   s32[B]                              each row attends to slots <= last[b]
//   layer  s32[]                               the layer of k and v to read
// Result: f32[B, kv_heads, groups, head_dim]; a row with no slot to attend to gets zeros.
// T is f32 or bf16 (two handlers).

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

// Tasks claimed from a shared counter by the calling thread and by helpers scheduled on the
// pool; the caller waits only for claimed tasks, so a helper the pool never starts is harmless.
struct Tasks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
};

template <ffi::DataType T>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<T> k,
                           ffi::Buffer<T> v, ffi::Buffer<ffi::PRED> mask,
                           ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  const auto md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5) {
    return ffi::Error::InvalidArgument("decode attention: q must be rank 4, k and v rank 5");
  }
  const int64_t rows = qd[0], heads = qd[1], groups = qd[2], dim = qd[3];
  const int64_t layers = kd[0], size = kd[4];
  if (kd[1] != rows || kd[2] != heads || kd[3] != dim || vd[0] != layers || vd[1] != rows ||
      vd[2] != heads || vd[3] != size || vd[4] != dim || md.size() != 2 || md[0] != rows ||
      md[1] != size || last.element_count() != rows) {
    return ffi::Error::InvalidArgument("decode attention: q, k, v, mask and last disagree");
  }
  if (groups > kMaxGroups || dim > kMaxDim) {
    return ffi::Error::InvalidArgument("decode attention: at most 16 groups and 256 head dims");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("decode attention: bad layer");
  using Native = ffi::NativeType<T>;
  const int64_t per_layer = rows * heads * dim * size;
  const Native* keys = k.typed_data() + l * per_layer;
  const Native* values = v.typed_data() + l * per_layer;
  const bool* real = mask.typed_data();
  const int32_t* slots = last.typed_data();
  const float* queries = q.typed_data();
  float* result = out->typed_data();
  const int64_t count = rows * heads;
  auto run = [=](int64_t t) {
    const int64_t b = t / heads;
    const int64_t n = std::clamp<int64_t>(int64_t{slots[b]} + 1, 0, size);
    AttendHead(queries + t * groups * dim, keys + t * dim * size, values + t * size * dim,
               real + b * size, n, size, groups, dim, result + t * groups * dim);
  };
  auto tasks = std::make_shared<Tasks>();
  auto drain = [tasks, run, count] {
    for (int64_t t; (t = tasks->next.fetch_add(1)) < count;) {
      run(t);
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
