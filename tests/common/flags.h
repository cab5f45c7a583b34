// Command-line helpers shared by the `flashmsa` command and the benchmarks.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <system_error>

namespace flashmsa::testing {

// `value` as a whole decimal integer in [low, high]; otherwise nullopt, with `error` naming the
// flag, the range and the value.
inline std::optional<int64_t> parse_integer(const std::string& flag, const std::string& value, int64_t low,
                                            int64_t high, std::string& error) {
  int64_t parsed = 0;
  const char* end = value.data() + value.size();
  const auto [stop, status] = std::from_chars(value.data(), end, parsed);
  if (value.empty() || status != std::errc() || stop != end || parsed < low || parsed > high) {
    error = flag + " must be an integer in [" + std::to_string(low) + ", " + std::to_string(high) + "], got '" +
            value + "'";
    return std::nullopt;
  }
  return parsed;
}

}  // namespace flashmsa::testing
