// The kernel of verispec/fast/attend.py (its docstring says what it computes and why); built by verispec/fast/ops.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

// 16 lanes are the unit of the arithmetic (a dot product's lane l sums dims l, l + 16, ...); they are held as
// P vectors of the target's native width (one AVX-512 register, two AVX2 ones, four SSE ones): GCC keeps a
// vector wider than the target's registers in memory and builds its broadcasts element by element, which
// made this kernel ~30x slower than its arithmetic on AVX2. Every operation is lane-wise over the 16 lanes
// but for the fixed reduction trees, so the bits do not depend on P.
#if defined(__AVX512F__)
constexpr int NL = 16;
#elif defined(__AVX__)
constexpr int NL = 8;
#else
constexpr int NL = 4;
#endif
constexpr int W = 16, P = W / NL;
constexpr int CB = P >= 4 ? 1 : 4 / P;  // value chunks per pass: 2 * CB * P accumulator registers (8)
constexpr int64_t SPAN = 4;  // blocks of 16 keys read by all heads in turn (head_dim 64: 16 KB of float32 keys)
constexpr int KI = 2;        // keys whose dot products run interleaved (two dependency chains)
typedef float vn __attribute__((vector_size(NL * 4)));
typedef int32_t vni __attribute__((vector_size(NL * 4)));
struct vf { vn p[P]; };

// piece by piece: a copy of the whole struct goes through the stack in halves, which stalls the loads after it
inline vf load(const float* x) {
  vf v;
  for (int k = 0; k < P; ++k) std::memcpy(&v.p[k], x + NL * k, sizeof(vn));
  return v;
}
inline void store(float* x, const vf& v) {
  for (int k = 0; k < P; ++k) std::memcpy(x + NL * k, &v.p[k], sizeof(vn));
}
inline float lane(const vf& v, int l) { return v.p[l / NL][l % NL]; }
// chunk c of a head_dim vector (C chunks, the last one `last` floats long, zeros after; FULL: head_dim is C * 16,
// known at compile time, so the loads are plain vector loads with no branch between them)
template <int C, bool FULL>
inline vf chunk(const float* x, int c, int last) {
  if (FULL || c < C - 1 || last == W) return load(x + W * c);
  vf v = {};
  for (int l = 0; l < last; ++l) v.p[l / NL][l % NL] = x[W * c + l];
  return v;
}

// the 16 lanes of one vector summed by a fixed tree: lanes l and l + 8 added, then l and l + 4, l + 2, l + 1
inline float hsum(const vf& v) {
  float t[W];
  store(t, v);
  for (int w = W / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

// acc[0..16) -> lane i = hsum(acc[i]) (the same tree, so a key's score never depends on its block
// neighbours), computed for the 16 vectors together by shuffles: per native width the same pairs are added
#if defined(__AVX512F__)
inline vf reduce16(vf* a) {
  typedef int32_t vi __attribute__((vector_size(64)));
  const vi m1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi m1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi m2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi m2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi m3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi m3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi m4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi m4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vn x[W];
  for (int p = 0; p < W; ++p) x[p] = a[p].p[0];
  for (int p = 0; p < 8; ++p) x[p] = __builtin_shuffle(x[2 * p], x[2 * p + 1], m1a) + __builtin_shuffle(x[2 * p], x[2 * p + 1], m1b);
  for (int p = 0; p < 4; ++p) x[p] = __builtin_shuffle(x[2 * p], x[2 * p + 1], m2a) + __builtin_shuffle(x[2 * p], x[2 * p + 1], m2b);
  for (int p = 0; p < 2; ++p) x[p] = __builtin_shuffle(x[2 * p], x[2 * p + 1], m3a) + __builtin_shuffle(x[2 * p], x[2 * p + 1], m3b);
  return vf{{__builtin_shuffle(x[0], x[1], m4a) + __builtin_shuffle(x[0], x[1], m4b)}};
}
#elif defined(__AVX__)
// halves of 8 lanes: step 1 adds a vector's two halves (no shuffle); steps 2-4 are the 16-lane masks
// restricted to the half they write
inline vf reduce16(vf* a) {
  const vni m2a = {0, 1, 2, 3, 8, 9, 10, 11}, m2b = {4, 5, 6, 7, 12, 13, 14, 15};
  const vni m3a = {0, 1, 4, 5, 8, 9, 12, 13}, m3b = {2, 3, 6, 7, 10, 11, 14, 15};
  const vni m4a = {0, 2, 4, 6, 8, 10, 12, 14}, m4b = {1, 3, 5, 7, 9, 11, 13, 15};
  vn h[W];
  for (int p = 0; p < W; ++p) h[p] = a[p].p[0] + a[p].p[1];
  for (int p = 0; p < 8; ++p) h[p] = __builtin_shuffle(h[2 * p], h[2 * p + 1], m2a) + __builtin_shuffle(h[2 * p], h[2 * p + 1], m2b);
  for (int p = 0; p < 4; ++p) h[p] = __builtin_shuffle(h[2 * p], h[2 * p + 1], m3a) + __builtin_shuffle(h[2 * p], h[2 * p + 1], m3b);
  for (int p = 0; p < 2; ++p) h[p] = __builtin_shuffle(h[2 * p], h[2 * p + 1], m4a) + __builtin_shuffle(h[2 * p], h[2 * p + 1], m4b);
  return vf{{h[0], h[1]}};
}
#else
inline vf reduce16(vf* a) {
  float t[W];
  for (int i = 0; i < W; ++i) t[i] = hsum(a[i]);
  return load(t);
}
#endif

// exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n); x < -87 gives 0
inline vn vexp(vn x) {
  const vn lo = x < -87.0f ? vn{} + 1.0f : vn{};
  vn xc = x < -87.0f ? vn{} - 87.0f : x;
  vni ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vni);  // round to nearest (xc <= 0)
  vn n = __builtin_convertvector(ni, vn);
  vn r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  vn p = vn{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vn y = p * r * r + r + 1.0f;
  vn two_n = (vn)((ni + 127) << 23);
  return lo != 0.0f ? vn{} : y * two_n;
}

// one kv head's g query heads for query row t (head dim D: C chunks of 16, the last `last` long): out[j]
// from q[j] over the visible columns. The g heads see the same keys, so they run together, block of 16 keys
// by block: a block's keys and values are read from the cache once for all g heads (the cache rows of a
// few hundred keys outgrow L1, and the heads one after the other streamed them from L2 g times each,
// which bounded the kernel). Each head's arithmetic is the same operations in the same order as one head
// alone. s: scratch of g * (L + 16 + 2 * C * 16 + C * 16 + 16) floats, slot: of L + 16
template <int C, bool FULL>
void row(const float* const* q, float* const* out, int64_t g, const float* K, const float* V, int64_t ks, int64_t vs,
         const float* bias, const int64_t* order, int64_t L, int last, float scale, float* s, int64_t* slot) {
  int64_t n = 0;  // the visible columns, in position order, and their slots
  for (int64_t c = 0; c < L; ++c)
    if (bias[c] == 0.0f) slot[n++] = order ? order[c] : c;
  const int64_t nb = (n + W - 1) / W;
  const float inf = std::numeric_limits<float>::infinity();
  float* qs = s + g * nb * W;       // [g][C * 16] the scaled queries
  float* os = qs + g * C * W;       // [g][2][C * 16] the value sums of even and odd keys
  float* mxs = os + 2 * g * C * W;  // [g][16] the running maxima, lane-wise
  for (int64_t j = 0; j < g; ++j) {
    for (int c = 0; c < C; ++c) {
      vf v = chunk<C, FULL>(q[j], c, last);
      for (int k = 0; k < P; ++k) v.p[k] *= scale;
      store(qs + (j * C + c) * W, v);
    }
    vf mx;
    for (int k = 0; k < P; ++k) mx.p[k] = vn{} - inf;
    store(mxs + j * W, mx);
  }
  for (int64_t b0 = 0; b0 < nb; b0 += SPAN) {  // SPAN blocks of 16 keys for every head, then the next SPAN
    for (int64_t j = 0; j < g; ++j) {
      vf qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load(qs + (j * C + c) * W);
      vf mx = load(mxs + j * W);
      for (int64_t b = b0; b < std::min(nb, b0 + SPAN); ++b) {  // 16 keys: their dot products, reduced together
        vf acc[W];
        for (int i = 0; i < W; i += KI) {  // KI keys at a time, their chains interleaved
          vf a[KI] = {};
          const float* kr[KI];  // past the last key: the last key again (its score is replaced by -inf below)
          for (int u = 0; u < KI; ++u) kr[u] = K + slot[std::min(b * W + i + u, n - 1)] * ks;
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
            for (int u = 0; u < KI; ++u) {
              const vf kc = chunk<C, FULL>(kr[u], c, last);
              for (int k = 0; k < P; ++k) a[u].p[k] += qv[c].p[k] * kc.p[k];
            }
          }
          for (int u = 0; u < KI; ++u) acc[i + u] = a[u];
        }
        vf sc = reduce16(acc);
        if ((b + 1) * W > n)  // past the last key: -inf, so exp gives 0
          for (int i = n - b * W; i < W; ++i) sc.p[i / NL][i % NL] = -inf;
        store(s + j * nb * W + b * W, sc);
        for (int k = 0; k < P; ++k) mx.p[k] = sc.p[k] > mx.p[k] ? sc.p[k] : mx.p[k];
      }
      store(mxs + j * W, mx);
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* sj = s + j * nb * W;
    const vf mx = load(mxs + j * W);
    float m = lane(mx, 0);
    for (int l = 1; l < W; ++l) m = lane(mx, l) > m ? lane(mx, l) : m;
    vf tot = {};
    for (int64_t b = 0; b < nb; ++b) {
      vf p = load(sj + b * W);
      for (int k = 0; k < P; ++k) {
        p.p[k] = vexp(p.p[k] - m);
        tot.p[k] += p.p[k];
      }
      store(sj + b * W, p);
    }
    mxs[j * W] = hsum(tot);  // the head's total, kept where its maxima were
    std::memset(os + 2 * j * C * W, 0, 2 * C * W * sizeof(float));
  }
  // the value sums: even and odd keys apart (two chains), added at the end; per block of 16 keys and head,
  // CB chunks at a time so that both chains' accumulators stay in registers
  for (int64_t b = 0; b < nb; b += SPAN) {
    const int64_t i0 = b * W, i1 = std::min(n, i0 + SPAN * W);
    for (int64_t j = 0; j < g; ++j) {
      const float* sj = s + j * nb * W;
#pragma GCC unroll 16
      for (int c0 = 0; c0 < C; c0 += CB) {
        float* o0p = os + (2 * j * C + c0) * W;
        float* o1p = o0p + C * W;
        vf o0[CB], o1[CB];
        for (int c = 0; c < CB && c0 + c < C; ++c) {
          o0[c] = load(o0p + c * W);
          o1[c] = load(o1p + c * W);
        }
        int64_t i = i0;
        for (; i + 1 < i1; i += 2) {
          const float* v0 = V + slot[i] * vs;
          const float* v1 = V + slot[i + 1] * vs;
#pragma GCC unroll 16
          for (int c = 0; c < CB && c0 + c < C; ++c) {
            const vf a0 = chunk<C, FULL>(v0, c0 + c, last), a1 = chunk<C, FULL>(v1, c0 + c, last);
            for (int k = 0; k < P; ++k) {
              o0[c].p[k] += sj[i] * a0.p[k];
              o1[c].p[k] += sj[i + 1] * a1.p[k];
            }
          }
        }
        if (i < i1) {  // the last key when n is odd (blocks hold an even number of keys)
          const float* v0 = V + slot[i] * vs;
          for (int c = 0; c < CB && c0 + c < C; ++c) {
            const vf a0 = chunk<C, FULL>(v0, c0 + c, last);
            for (int k = 0; k < P; ++k) o0[c].p[k] += sj[i] * a0.p[k];
          }
        }
        for (int c = 0; c < CB && c0 + c < C; ++c) {
          store(o0p + c * W, o0[c]);
          store(o1p + c * W, o1[c]);
        }
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float total = mxs[j * W];
    for (int c = 0; c < C; ++c) {
      const vf o0 = load(os + (2 * j * C + c) * W), o1 = load(os + ((2 * j + 1) * C + c) * W);
      vf o;
      for (int k = 0; k < P; ++k) o.p[k] = (o0.p[k] + o1.p[k]) / total;
      std::memcpy(out[j] + W * c, &o, (c < C - 1 ? W : last) * sizeof(float));
    }
  }
}

using RowFn = void (*)(const float* const*, float* const*, int64_t, const float*, const float*, int64_t, int64_t,
                       const float*, const int64_t*, int64_t, int, float, float*, int64_t*);

template <int... C>
RowFn pick(int64_t chunks, bool full, std::integer_sequence<int, C...>) {
  RowFn fn = nullptr;
  ((chunks == C + 1 ? (fn = full ? &row<C + 1, true> : &row<C + 1, false>, 0) : 0), ...);
  return fn;
}

RowFn row_for(int64_t D) { return pick((D + W - 1) / W, D % W == 0, std::make_integer_sequence<int, 16>{}); }

// q [H, T, D], k/v [KVH, S, D] (rows contiguous), bias [>= T, L] (0 visible, -inf not; rows t < T read),
// order [T, L] long or empty (columns are slots) -> [H, T, D]
at::Tensor attend(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias_,
                  const at::Tensor& order_, double scale) {
  TORCH_CHECK(q_.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              bias_.scalar_type() == at::kFloat, "attend: float32 queries, caches and bias");
  TORCH_CHECK(q_.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1,
              "attend: q [H, T, D] and caches [KVH, S, D] with contiguous rows");
  at::Tensor q = q_.contiguous(), bias = bias_.contiguous();
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), KVH = k.size(0), L = bias.size(1), g = H / KVH;
  TORCH_CHECK(H % KVH == 0 && k.size(2) == D && v.size(2) == D && bias.size(0) >= T && L <= k.size(1),
              "attend: shapes do not match");
  const bool has_order = order_.numel() > 0;
  at::Tensor order = has_order ? order_.contiguous() : order_;
  TORCH_CHECK(!has_order || (order.scalar_type() == at::kLong && order.size(0) == T && order.size(1) == L),
              "attend: order [T, L] long");
  const RowFn fn = row_for(D);
  TORCH_CHECK(fn != nullptr, "attend: head_dim ", D, " is over 256");
  const int last = static_cast<int>(D - W * ((D + W - 1) / W - 1));
  at::Tensor out = at::empty({H, T, D}, q.options());
  const float* Q = q.data_ptr<float>();
  const float* B = bias.data_ptr<float>();
  const int64_t* O = has_order ? order.data_ptr<int64_t>() : nullptr;
  float* Y = out.data_ptr<float>();
  const float* K = k.data_ptr<float>();
  const float* Vp = v.data_ptr<float>();
  const int64_t ks = k.stride(1), vs = v.stride(1), kh = k.stride(0), vh = v.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, KVH * T, 1, [&](int64_t a, int64_t b) {
    std::vector<float> s(g * (L + W + 3 * 256 + W));  // row's scratch (C * 16 <= 256)
    std::vector<int64_t> slot(L + W);
    std::vector<const float*> qs(g);
    std::vector<float*> os(g);
    for (int64_t task = a; task < b; ++task) {
      const int64_t h = task / T, t = task % T;
      for (int64_t j = 0; j < g; ++j) {
        qs[j] = Q + ((h * g + j) * T + t) * D;
        os[j] = Y + ((h * g + j) * T + t) * D;
      }
      fn(qs.data(), os.data(), g, K + h * kh, Vp + h * vh, ks, vs, B + t * L, O ? O + t * L : nullptr, L, last, sc,
         s.data(), slot.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor bias, Tensor order, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("attend", &attend);
}
