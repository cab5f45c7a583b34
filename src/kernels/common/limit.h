// What a kernel is not built for, decided from the params alone: the field it concerns and the
// rule. Each stage's config.h states its limits as functions returning a Limit; validate()
// (src/api/validate.cpp) reports them as kUnsupported without a GPU, and the stage's launcher
// checks the same function again before any work.
#pragma once

#include <string>

#include "flashmsa/api.h"

namespace flashmsa::kernels {

struct Limit {
  const char* field = nullptr;  // "shape", "deterministic", ...
  const char* rule = nullptr;   // null: within the limits
  explicit operator bool() const { return rule != nullptr; }
};

// The Status a launcher returns for a limit (its field is already named as in the op's params).
inline Status unsupported(const Limit& limit) {
  return {StatusCode::kUnsupported, std::string(limit.field) + ": " + limit.rule};
}

}  // namespace flashmsa::kernels
