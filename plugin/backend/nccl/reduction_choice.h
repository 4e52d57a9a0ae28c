#pragma once
// Which NCCL reduction a bucket needs: ncclAvg for a plain average, ncclSum
// for a plain sum, else one pre-multiplied sum (ncclRedOpCreatePreMulSum)
// whose factor folds the pre-scale and the post-scale together:
// sum_r(p * x_r) * q == sum_r((p * q) * x_r). One pass over the data, no
// scaling kernel of our own. Separate from NCCL so that it is tested without
// a GPU.

#include <cmath>

namespace sfsync {
namespace nccl {

enum class Reduction { kSum, kAverage, kPreMulSum };

struct ReductionChoice {
  Reduction kind;
  double factor;  // for kPreMulSum: what each rank multiplies its input by
};

inline ReductionChoice chooseReduction(double prescale, double postscale, int worldSize) {
  if (prescale == 1.0 && postscale == 1.0) return {Reduction::kSum, 1.0};
  if (prescale == 1.0 && worldSize > 1 && postscale == 1.0 / double(worldSize)) {
    return {Reduction::kAverage, postscale};
  }
  return {Reduction::kPreMulSum, prescale * postscale};
}

}  // namespace nccl
}  // namespace sfsync
