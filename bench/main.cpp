// flashmsa_bench: runs the registered stage benchmarks (bench/bench_<stage>.cu) over named configs,
// sequence lengths and selection patterns, prints one line per row and writes the rows as JSON.
//
//   flashmsa_bench [--stages select,forward] [--configs paper,specialized] [--seqlens 8192,131072]
//                  [--patterns random,hot,tile_shared,uniform] [--repeats N] [--out rows.json]
//
// Without --stages every stage runs except the opt-in ones (warmup: dense causal, seconds per run
// at 128K), which run only when named.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "common/flags.h"
#include "common/patterns.h"
#include "flashmsa/api.h"

namespace flashmsa::bench {

std::vector<Registration>& registry() {
  static std::vector<Registration> registrations;
  return registrations;
}

double device_memory_used_gb() {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0.0;
  return double(total_bytes - free_bytes) / 1e9;
}

namespace {

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

void write_json(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream out(path);
  out << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    out << "  {\"system\": " << json_string(row.system) << ", \"stage\": " << json_string(row.stage)
        << ", \"config\": " << json_string(row.config)
        << ", \"pattern\": " << (row.pattern.empty() ? "null" : json_string(row.pattern))
        << ", \"S\": " << row.seqlen << ", \"B\": " << row.batch << ", \"ms\": " << row.ms
        << ", \"tflops\": " << row.tflops << ", \"peak_mem_gb\": " << row.peak_mem_gb
        << ", \"note\": " << json_string(row.note) << "}" << (i + 1 < rows.size() ? "," : "")
        << "\n";
  }
  out << "]\n";
}

}  // namespace
}  // namespace flashmsa::bench

int main(int argc, char** argv) {
  using namespace flashmsa::bench;
  Options options;
  std::vector<std::string> stages;
  std::string out_path = "bench_rows.json";
  // Every flag is checked before any GPU work: a usage error names the flag and the value.
  const auto usage_error = [](const std::string& message) {
    std::fprintf(stderr, "flashmsa_bench: %s\n", message.c_str());
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    // Taken only by a known flag, so an unknown one is named as such also when it comes last.
    const auto take_value = [&]() -> std::string {
      if (i + 1 >= argc || split(argv[i + 1]).empty()) usage_error(flag + " needs a value");
      return argv[++i];
    };
    std::string error;
    if (flag == "--stages") {
      stages = split(take_value());
      for (const std::string& stage : stages) {
        const auto named = [&](const Registration& registration) {
          return registration.stage == stage;
        };
        if (std::none_of(registry().begin(), registry().end(), named)) {
          usage_error("--stages: unknown stage '" + stage + "'");
        }
      }
    } else if (flag == "--configs") {
      options.configs = split(take_value());
      for (const std::string& config : options.configs) {
        if (flashmsa::cases::find_config(config) == nullptr) {
          usage_error("--configs: unknown config '" + config + "'");
        }
      }
    } else if (flag == "--seqlens") {
      options.seqlens.clear();
      for (const std::string& item : split(take_value())) {
        const std::optional<int64_t> seqlen =
            flashmsa::testing::parse_integer("--seqlens", item, 1, int64_t(1) << 30, error);
        if (!seqlen) usage_error(error);
        options.seqlens.push_back(*seqlen);
      }
    } else if (flag == "--patterns") {
      options.patterns = split(take_value());
      for (const std::string& pattern : options.patterns) {
        // SPEC.md's patterns, and `uniform`, the benchmarks' own draw per query.
        flashmsa::patterns::Pattern parsed;
        if (pattern != "uniform" && !flashmsa::patterns::parse_pattern(pattern, &parsed)) {
          usage_error("--patterns: unknown pattern '" + pattern + "' (random, hot, tile_shared, uniform)");
        }
      }
    } else if (flag == "--repeats") {
      const std::optional<int64_t> repeats =
          flashmsa::testing::parse_integer(flag, take_value(), 1, 1000, error);
      if (!repeats) usage_error(error);
      options.repeats = int(*repeats);
    } else if (flag == "--out") {
      out_path = take_value();
    } else {
      usage_error("unknown flag " + flag);
    }
  }
  if (!flashmsa::hopper_available()) {
    std::fprintf(stderr, "flashmsa_bench: no Hopper GPU (H100/H200) here; nothing to time\n");
    return 1;
  }
  std::vector<Row> rows;
  for (const Registration& registration : registry()) {
    bool wanted = stages.empty() && !registration.opt_in;
    for (const std::string& stage : stages) wanted = wanted || stage == registration.stage;
    if (!wanted) continue;
    registration.function(options, rows);
  }
  for (const Row& row : rows) {
    std::printf("%-9s %-12s %-12s %-11s S=%-8lld %9.3f ms %7.1f TFLOP/s %s\n", row.system.c_str(),
                row.stage.c_str(), row.config.c_str(), row.pattern.c_str(),
                static_cast<long long>(row.seqlen), row.ms, row.tflops, row.note.c_str());
  }
  write_json(out_path, rows);
  return 0;
}
