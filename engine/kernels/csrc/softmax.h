// The log-softmax of fp32 rows, bit for bit MLX's (softmax.cpp).
#pragma once

#include <cstdint>

namespace mlxchat {

// y = x - logsumexp(x, axis=-1, keepdims=True) for `rows` rows of n floats (row-contiguous),
// identical to MLX 0.32's CPU ops; rows split over the pool's threads. `isa`: the kernels' unit
// ("avx512-vnni", "avx512", "avx2", "generic"), whose instructions the exps use.
void log_softmax_rows(const float* x, float* y, int64_t rows, int64_t n, const char* isa);

}  // namespace mlxchat
