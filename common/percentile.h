// Percentile: the nearest-rank percentile of a sample, as benchmarks and reports print them.
//
//   double p99 = ubep::Percentile(latencies_us, 0.99);
//
// q in (0, 1]; 0 for an empty sample. Takes the sample by value (it sorts a copy).
#ifndef UBEP_COMMON_PERCENTILE_H_
#define UBEP_COMMON_PERCENTILE_H_

#include <algorithm>
#include <cmath>
#include <vector>

namespace ubep {

inline double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::min(values.size(), std::max<size_t>(rank, 1)) - 1];
}

}  // namespace ubep

#endif  // UBEP_COMMON_PERCENTILE_H_
