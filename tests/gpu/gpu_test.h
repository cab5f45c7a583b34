// Common pieces of the GPU test executable: every test starts with FLASHMSA_REQUIRE_HOPPER() so the
// suite skips with a message (and passes) on a machine without an H100/H200.
#pragma once

#include <gtest/gtest.h>

#include "common/cases.h"
#include "common/device_buffers.h"
#include "flashmsa/api.h"
#include "reference/reference.h"

#define FLASHMSA_REQUIRE_HOPPER()                                                           \
  do {                                                                                      \
    if (!::flashmsa::hopper_available()) {                                                  \
      GTEST_SKIP() << "no Hopper GPU (H100/H200) on this machine: GPU test skipped";        \
    }                                                                                       \
  } while (0)
