// Uniform host-side checks for the boundary of the public API (STYLE.md point 8).
//
// validate.cpp states every rule of SPEC.md §6 with one of these macros, so each failure becomes
// the same kind of Status: "<argument>: <rule>, got <offending values>". They return from the
// enclosing function, which must return Status. Kernels behind src/api assume these checks passed.
#pragma once

#include <sstream>
#include <string>

#include "flashmsa/api.h"

namespace flashmsa::detail {

// Streams every part into one string: str_cat("got H=", 64, ", Hp=", 6).
template <typename... Parts>
std::string str_cat(const Parts&... parts) {
  std::ostringstream text;
  (text << ... << parts);
  return text.str();
}

// Whether the workspace layouts of `mode` are defined for `shape`: it passes validate's shape rules,
// a kernel is built for its head dims, and in sparse mode the schedule can index it
// (kernels/schedule/config.h). The *_workspace_size() queries return 0 otherwise: the ops refuse
// such a shape, and the layouts' arithmetic (divisions by ⌊128 / M⌋, products of the sizes) holds
// only inside these bounds.
bool workspace_defined(const ProblemShape& shape, Mode mode);

}  // namespace flashmsa::detail

// When `cond` is false, return Status{code, "<arg>: <message parts...>"} from the enclosing
// function.
#define FLASHMSA_CHECK_STATUS(cond, code, arg, ...)                                         \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      return ::flashmsa::Status{code, ::flashmsa::detail::str_cat(arg, ": ", __VA_ARGS__)}; \
    }                                                                                       \
  } while (0)

// A violated SPEC.md §6 rule.
#define FLASHMSA_CHECK_ARG(cond, arg, ...) \
  FLASHMSA_CHECK_STATUS(cond, ::flashmsa::StatusCode::kInvalidArgument, arg, __VA_ARGS__)

// A valid input that this build has no kernel for.
#define FLASHMSA_CHECK_SUPPORTED(cond, arg, ...) \
  FLASHMSA_CHECK_STATUS(cond, ::flashmsa::StatusCode::kUnsupported, arg, __VA_ARGS__)

// Propagate a failed Status from a helper check.
#define FLASHMSA_RETURN_IF_ERROR(expr)                                          \
  do {                                                                          \
    if (::flashmsa::Status flashmsa_status_ = (expr); !flashmsa_status_.ok()) { \
      return flashmsa_status_;                                                  \
    }                                                                           \
  } while (0)
