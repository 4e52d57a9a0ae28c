// weightedScale (backend.h): the averaging factor of a weighted bucket, read
// from the limbs its own collective summed.

#include <cmath>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"

namespace sfsync {

double weightedScale(const ReduceSpec& spec, const char* limbs, sf_dtype dtype) {
  const size_t esize = dtypeSize(dtype);
  std::vector<double> sums(static_cast<size_t>(spec.weight.limbs));
  for (size_t j = 0; j < sums.size(); ++j) sums[j] = loadFromDtype(limbs + j * esize, dtype);
  const double weight = spec.weight.decode(sums.data());
  if (weight == 0.0 || !std::isfinite(weight)) return 1.0;
  return 1.0 / weight;
}

}  // namespace sfsync
