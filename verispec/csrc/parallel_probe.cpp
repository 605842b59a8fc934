// ops.parallel_threads()'s probe: how many threads an operator built as the kernels are runs on (verispec/fast/ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>

// how many distinct threads at::parallel_for hands work to in an operator built as the kernels are
int64_t parallel_threads(int64_t n) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("parallel_threads(int n) -> int", &parallel_threads);
}
